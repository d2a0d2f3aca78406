"""Foil and Accordion under parallel layouts equal one process.

Foil's core is megatron-core MoE layers looped with untied attention: tensor
parallel (attention and experts split), expert parallel (megatron's token
all-to-all over the experts) and data parallel must give the 1-process losses
and gradient norms. Accordion samples one budget per micro-batch index, the same
on every rank: tensor parallel keeps the micro-batches of one process, so its
sampled run must match; data parallel splits a step's samples over ranks, so it
is compared at a fixed budget, and its ranks must draw identical budgets.
"""

from __future__ import annotations

import pytest
from distributed import run_distributed
from test_parallel_lol import SyntheticTokens, TinyTokenizer

pytestmark = pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)

FOIL = dict(
    plan="looped",
    num_blocks=2,
    routed_depth=4,
    num_experts=4,
    core_num_experts=4,
    moe_ffn_hidden_size=64,
    moe_router_topk=2,
    moe_layers="all",
    untie_attention=True,
    moe_z_loss_coeff=1e-3,
    moe_loss_average_over_executions=True,
)
ACCORDION = dict(
    plan="accordion",
    num_blocks=3,
    num_experts=4,
    moe_ffn_hidden_size=64,
    moe_router_topk=2,
    moe_layers="all",
    moe_shared_expert_intermediate_size=64,
    loop_budgets=[0, 1, 3],
    second_pass_router="separate",
    num_query_groups=2,
)


def _train(parallel: dict, model: dict) -> dict:
    import torch.distributed as dist

    from megatron_lol.config import config_from_dict
    from megatron_lol.training.trainer import Trainer

    m = dict(
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        n_prelude=1,
        n_coda=1,
        window_size=16,
        window_shift=8,
        vocab_size=128,
    )
    m.update(model)
    cfg = config_from_dict(
        {
            "model": m,
            "parallel": parallel,
            "training": {
                "train_iters": 3,
                "micro_batch_size": 1,
                "global_batch_size": 4,
                "seq_length": 64,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 7,
            },
            "optimizer": {"lr": 1e-2, "lr_warmup_iters": 0, "clip_grad": 1.0},
        }
    )
    trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(32, 0), None, None)).setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    steps = [trainer.train_step(data) for _ in range(3)]
    budgets = [s.budgets for s in steps]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, budgets)
    core = trainer.model_chunks[0].module.core
    experts = core.block(0).mlp.experts.local_experts
    return {
        "loss": [s.loss for s in steps],
        "grad_norm": [s.grad_norm for s in steps],
        "budgets": budgets,
        "budgets_equal": all(g == budgets for g in gathered),
        "local_experts": len(experts),
    }


LAYOUTS = {
    "foil_tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, FOIL),
    "foil_ep2": ({"expert_model_parallel_size": 2}, FOIL),
    "foil_dp2": ({}, FOIL),
    "accordion_tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, ACCORDION),
    "accordion_dp2_fixed": ({}, dict(ACCORDION, loop_budget=3)),
    "accordion_dp2_sampled": ({}, ACCORDION),
}


def _references() -> dict:
    return {
        "foil": _train({}, FOIL),
        "accordion": _train({}, ACCORDION),
        "accordion_fixed": _train({}, dict(ACCORDION, loop_budget=3)),
    }


def _layouts() -> dict:
    return {name: _train(par, model) for name, (par, model) in LAYOUTS.items()}


@pytest.mark.slow
def test_foil_and_accordion_layouts_match_single_process():
    ref = run_distributed(_references, 1, timeout=400)[0]
    results = run_distributed(_layouts, 2, timeout=900)
    assert ref["foil"]["local_experts"] == 4
    assert sorted({k for b in ref["accordion"]["budgets"] for k in b}) != [3]  # budgets really vary
    expect = {
        "foil_tp2_sp": "foil",
        "foil_ep2": "foil",
        "foil_dp2": "foil",
        "accordion_tp2_sp": "accordion",
        "accordion_dp2_fixed": "accordion_fixed",
    }
    for rank_result in results:
        assert rank_result["foil_ep2"]["local_experts"] == 2  # experts split over the two ranks
        assert rank_result["accordion_tp2_sp"]["budgets"] == ref["accordion"]["budgets"]
        for name, want in expect.items():
            got, base = rank_result[name], ref[want]
            for key in ("loss", "grad_norm"):
                for a, b in zip(base[key], got[key]):
                    # 2e-4, not the dense layouts' 1e-5: sharded expert GEMMs sum in another order, and a
                    # top-k near-tie moved by that rounding sends a token to another expert (measured:
                    # losses within 1e-6, the third step's grad norm of TP2+SP within 6e-5)
                    assert abs(a - b) <= 2e-4 * abs(a), f"{name} {key}: {got[key]} vs 1-process {base[key]}"
        sampled = rank_result["accordion_dp2_sampled"]
        assert sampled["budgets_equal"] and all(len(b) == 2 for b in sampled["budgets"])
