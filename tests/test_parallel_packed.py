"""The packed (Transformer Engine) layout under parallelism equals the local layout in one process.

Under the TE spec the micro-batch is one THD stream ``[b*s, 1, h]``; sequence parallelism shards that
stream (so megatron-core MoE layers run with TP through SP) and pipeline stages exchange
``[b*s, 1, h]`` tensors. The trainer here builds the packed layout with local modules (TE itself is a
GPU library): 2-process TP=2+SP and PP=2 runs of it must give the losses and gradient norms of one
unpacked process, within 1e-5 relative.
"""

from __future__ import annotations

import pytest
from distributed import run_distributed
from test_parallel_lol import SyntheticTokens, TinyTokenizer, _config

pytestmark = pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)

MODELS = {
    "lol-moe-fixed": dict(num_experts=4, moe_ffn_hidden_size=64, moe_layers="fixed", film="depth"),
    "dense": dict(plan="dense", num_blocks=None, routed_depth=None, core_layers=2),
}


def _train(parallel: dict, packed: bool, **model) -> dict:
    import functools

    from megatron_lol.model import lol_model
    from megatron_lol.training.trainer import Trainer

    original = lol_model.LoLGPTModel.__init__
    lol_model.LoLGPTModel.__init__ = functools.partialmethod(original, packed_sequences=packed)
    try:
        cfg = _config(parallel, **model)
        trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(32, 0), None, None)).setup()
        assert trainer.model.packed is packed
        data = trainer.data_iterator(trainer.train_ds, 0)
        steps = [trainer.train_step(data) for _ in range(2)]
    finally:
        lol_model.LoLGPTModel.__init__ = original
    return {"loss": [s.loss for s in steps], "grad_norm": [s.grad_norm for s in steps]}


def _reference() -> dict:
    return {name: _train({}, False, **model) for name, model in MODELS.items()}


LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def _packed_layouts() -> dict:
    return {
        (name, layout): _train(par, True, **MODELS[name])
        for name in MODELS
        for layout, par in LAYOUTS.items()
        if not (name == "dense" and layout == "pp2")
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_packed_layout_under_tp_sp_pp_dp_equals_one_unpacked_process():
    ref = run_distributed(_reference, 1, timeout=300)[0]
    results = run_distributed(_packed_layouts, 2, timeout=600)
    assert len(results[0]) == 3
    for (name, layout), got in results[0].items():
        for key in ("loss", "grad_norm"):
            for a, b in zip(ref[name][key], got[key]):
                assert abs(a - b) <= 1e-5 * abs(a), f"{name} {layout} {key}: {got[key]} vs {ref[name][key]}"
