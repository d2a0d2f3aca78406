"""Two gloo processes, one launch (docs/gpu.md): what the first multi-GPU run needs from the data-parallel and
tensor-parallel ranks, on the CPU.

* **Overlapped gradient reduction** (``--overlap-grad-reduce``) with a block that receives no windows on one
  data-parallel rank: three steps (the first records megatron-core's readiness pattern, the next two launch
  the reductions during backward) equal the same steps without overlap, and the core's buckets were
  launched before the step's final gradient synchronisation.
* **Routing agreement**: two tensor-parallel ranks with the check every step agree for two steps; then test
  code patches the router's choice on rank 1 only (a planted disagreement: a decision that differs between
  the ranks) and calls the production loop (``training.cli.train_to_exit``): both ranks stop at iteration 1,
  depth 1, with the same one-line error and status 4, instead of waiting for each other's collectives. The
  launch runs under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import pytest
from distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)

SEQ, MBS = 32, 2
MODEL = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    num_blocks=3,
    routed_depth=2,
    window_size=8,
    window_shift=4,
    n_prelude=1,
    n_coda=1,
    vocab_size=128,
)


def _trainer(parallel: dict, training: dict):
    from gpu_steps import SyntheticTokens, Tokenizer

    from megatron_lol.config import config_from_dict
    from megatron_lol.training.trainer import Trainer

    cfg = config_from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            "training": dict(
                {
                    "train_iters": 3,
                    "micro_batch_size": MBS,
                    "seq_length": SEQ,
                    "log_interval": 1,
                    "eval_interval": 100,
                    "eval_iters": 0,
                    "seed": 5,
                },
                **training,
            ),
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "clip_grad": 1.0},
        }
    )
    data = SyntheticTokens(SEQ, MODEL["vocab_size"])
    return Trainer(cfg, tokenizer=Tokenizer(MODEL["vocab_size"]), datasets=(data, None, None)).setup()


def _all_windows_to_block_0(probs, bias):
    import torch

    choice = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    return choice, probs[:, 0]


def _overlap_run(overlap: bool) -> dict:
    import torch
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    import megatron_lol.model.static_routing as routing_mod

    rank = torch.distributed.get_rank()
    saved_choose, saved_start = routing_mod.choose_blocks, _ParamAndGradBucketGroup.start_grad_sync
    events: list = []

    def start(group, *args, **kwargs):
        events.append("start")
        return saved_start(group, *args, **kwargs)

    if rank == 1:  # blocks 1 and 2 get no window on this rank
        routing_mod.choose_blocks = _all_windows_to_block_0
    _ParamAndGradBucketGroup.start_grad_sync = start
    try:
        trainer = _trainer({"overlap_grad_reduce": overlap}, {"global_batch_size": 4 * MBS})
        finalize = trainer.library_sync.finalize_model_grads

        def marked(*args, **kwargs):
            events.append("finalize")
            return finalize(*args, **kwargs)

        trainer.library_sync.finalize_model_grads = marked
        it = trainer.data_iterator(trainer.train_ds, 0)
        results = []
        for _ in range(3):
            events.append("step")
            results.append(trainer.train_step(it))
        params = torch.cat([p.detach().reshape(-1).float() for p in trainer.model.parameters()])
        unused = [float(trainer.model.core.block(b).mlp.linear_fc1.weight.main_grad.abs().sum()) for b in range(3)]
    finally:
        routing_mod.choose_blocks = saved_choose
        _ParamAndGradBucketGroup.start_grad_sync = saved_start
    last = events[len(events) - 1 - events[::-1].index("step") :]  # the last step's events
    launched_in_backward = last[: last.index("finalize")].count("start")  # before its final synchronisation
    return {
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "params": params,
        "launched_in_backward": launched_in_backward,
        "used_blocks_grad": unused,
        "readiness": trainer.grad_readiness is not None,
    }


def _routing_agreement() -> dict:
    import torch

    import megatron_lol.model.static_routing as routing_mod
    from megatron_lol.parallel.routing_agreement import RoutingAgreement
    from megatron_lol.training.cli import train_to_exit

    rank = torch.distributed.get_rank()
    out = {}
    checked = []
    saved_call = RoutingAgreement.__call__

    def counting(self, depth, decision):
        checked.append((self.step, depth))
        return saved_call(self, depth, decision)

    RoutingAgreement.__call__ = counting
    try:
        trainer = _trainer({"tensor_model_parallel_size": 2}, {"train_iters": 2, "check_routing_agreement": 1})
        out["clean"] = train_to_exit(trainer)
        out["clean_checks"] = list(checked)
        saved_choose = routing_mod.choose_blocks

        def divergent(probs, bias):  # test-only plant: rank 1 sends its first window elsewhere
            choice, gate = saved_choose(probs, bias)
            choice = choice.clone()
            choice[0] = (choice[0] + 1) % probs.shape[1]
            return choice, gate

        if rank == 1:
            routing_mod.choose_blocks = divergent
        try:
            trainer = _trainer({"tensor_model_parallel_size": 2}, {"train_iters": 2, "check_routing_agreement": 1})
            out["planted"] = train_to_exit(trainer)
            out["iteration_after"] = trainer.iteration
        finally:
            routing_mod.choose_blocks = saved_choose
    finally:
        RoutingAgreement.__call__ = saved_call
    return out


def _checks() -> dict:
    import time

    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    overlap = {flag: _overlap_run(flag) for flag in (False, True)}
    t1 = time.time()
    agreement = _routing_agreement()
    return {"overlap": overlap, "agreement": agreement, "seconds": (t1 - t0, time.time() - t1)}


@pytest.mark.timeout(300)
def test_overlapped_grad_reduce_and_routing_agreement_on_two_ranks():
    results = run_distributed(_checks, 2, timeout=240)
    import torch

    print("seconds (overlap, agreement):", results[0]["seconds"])

    for rank, r in enumerate(results):
        plain, overlap = r["overlap"][False], r["overlap"][True]
        assert overlap["readiness"] and not plain["readiness"]
        assert overlap["losses"] == plain["losses"] and overlap["grad_norms"] == plain["grad_norms"]
        assert torch.equal(overlap["params"], plain["params"]), rank
        # every bucket of the last step was launched during backward, before the final synchronisation
        assert overlap["launched_in_backward"] >= 1 and plain["launched_in_backward"] == 0
    # blocks 1 and 2 ran windows on rank 0 only: their gradients reached rank 1's buffer through the reduction
    assert min(results[1]["overlap"][True]["used_blocks_grad"]) > 0
    assert results[0]["overlap"][True]["losses"] == results[1]["overlap"][True]["losses"]

    for rank, r in enumerate(results):
        a = r["agreement"]
        assert a["clean"] == (0, "") and sorted(set(a["clean_checks"])) == [(1, 1), (1, 2), (2, 1), (2, 2)]
        code, message = a["planted"]
        assert code == 4 and "\n" not in message, (rank, message)
        assert message.startswith(
            "megatron-lol train: error: routing disagreement at iteration 1, depth 1: the 2 "
            "tensor-parallel ranks chose different blocks"
        ), message
        assert a["iteration_after"] == 0  # stopped inside the first step, before any block of depth 1 ran
