"""LoL training under parallel layouts equals one process.

One single-process launch gives the reference (a module fixture, made on one
core); one 2-process launch runs every 2-rank layout in turn (the Trainer
re-initialises megatron's parallel state).
Each layout trains 3 steps from the same seed on the same data; losses and
gradient norms must agree to 1e-5 relative, and the balancing bias must be
identical on every rank.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

VOCAB = 96
SEQ = 64
EOD = 1


class SyntheticTokens:
    """Deterministic token rows with documents of several lengths (EOD-separated)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(2, VOCAB, (n, SEQ + 1), generator=g)
        for i in range(n):
            for cut in torch.randint(5, SEQ, (2,), generator=g).tolist():
                self.rows[i, cut] = EOD

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": torch.ones(SEQ)}


class TinyTokenizer:
    vocab_size = VOCAB
    eod = EOD


def _config(parallel: dict, **model):
    from megatron_lol.config import config_from_dict

    m = dict(
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        n_prelude=1,
        n_coda=1,
        num_blocks=4,
        routed_depth=6,
        window_size=16,
        window_shift=8,
        vocab_size=128,
    )
    m.update(model)
    return config_from_dict(
        {
            "model": m,
            "parallel": parallel,
            "training": {
                "train_iters": 3,
                "micro_batch_size": 1,
                "global_batch_size": 4,
                "seq_length": SEQ,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 7,
            },
            "optimizer": {"lr": 1e-2, "lr_warmup_iters": 0, "clip_grad": 1.0},
        }
    )


def _train(parallel: dict, **model) -> dict:
    import torch.distributed as dist

    from megatron_lol.training.trainer import Trainer

    cfg = _config(parallel, **model)
    trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(32, 0), None, None)).setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    steps = [trainer.train_step(data) for _ in range(3)]
    # every rank that holds the library (all of them here) must hold the same bias
    balancers = trainer._balancers()
    cores = [c.module.core for c in trainer.model_chunks if c.module.core is not None]
    bias = balancers[0].bias.clone() if balancers else torch.full((1, 4), float("nan"))
    gathered = [torch.zeros_like(bias) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bias)
    held = [g for g in gathered if not torch.isnan(g).any()]
    return {
        "loss": [s.loss for s in steps],
        "grad_norm": [s.grad_norm for s in steps],
        "bias_equal": all(torch.equal(g, held[0]) for g in held),
        "bias": held[0].tolist(),
        "bias_holders": len(held),
        "local_blocks": sorted({int(k) for c in cores for k in c.blocks.keys()}),
        "library_params": sum(p.numel() for p in cores[0].blocks.parameters()) if cores else 0,
    }


LAYOUTS_2 = {
    "pp2": {"pipeline_model_parallel_size": 2},
    "pp2_vpp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2": {"expert_model_parallel_size": 2},
    "dp2": {},
    "dp2_distopt": {"use_distributed_optimizer": True},
}


LAYOUTS_4 = {
    "tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "ep2_dp2": {"expert_model_parallel_size": 2},
}


def _all_layouts_2() -> dict:
    return {name: _train(par) for name, par in LAYOUTS_2.items()}


def _all_layouts_4() -> dict:
    return {name: _train(par) for name, par in LAYOUTS_4.items()}


def _reference() -> dict:
    return _train({})


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-process run, made by the first test that asks (the one-core test below), so that the
    layouts' test holds the whole machine for its own launches only."""
    return run_distributed(_reference, 1, timeout=300)[0]


@pytest.mark.slow
def test_one_process_reference_trains_every_block(reference):
    ref = reference
    assert all(l > 0 for l in ref["loss"]) and ref["loss"][0] != ref["loss"][-1]
    assert ref["local_blocks"] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)
def test_layouts_match_single_process(reference):
    ref = reference
    results = run_distributed(_all_layouts_2, 2, timeout=900) + run_distributed(_all_layouts_4, 4, timeout=900)
    for rank, rank_result in enumerate(results[:2]):
        # EP=2: each rank holds exactly its half of the library
        assert rank_result["ep2"]["local_blocks"] == [2 * rank, 2 * rank + 1]
        assert rank_result["ep2"]["library_params"] * 2 == ref["library_params"]
    for rank_result in results:
        for name, got in rank_result.items():
            for key in ("loss", "grad_norm"):
                for a, b in zip(ref[key], got[key]):
                    assert abs(a - b) <= 1e-5 * abs(a), f"{name} {key}: {got[key]} vs 1-process {ref[key]}"
            assert got["bias_equal"], f"{name}: balancing bias differs across ranks"
            assert got["bias"] == ref["bias"], f"{name}: bias {got['bias']} vs {ref['bias']}"
