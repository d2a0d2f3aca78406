"""Truncated backprop through depth under expert parallelism equals one process.

With ``curriculum.backprop_depth`` the updates of the early routed depths are
constants for autograd (first-window tokens excepted); those frozen block calls
must go through the expert-parallel window dispatch too (each rank holds half
of the library), and the result must equal a single process's.
"""

from __future__ import annotations

import pytest
from distributed import run_distributed
from test_parallel_lol import SyntheticTokens, TinyTokenizer, _config

pytestmark = pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)


def _train_truncated(parallel: dict, first_window_full: bool) -> dict:
    import dataclasses

    from megatron_lol.training.trainer import Trainer

    cfg = _config(parallel)
    cfg = dataclasses.replace(
        cfg,
        curriculum=dataclasses.replace(cfg.curriculum, backprop_depth=2, first_window_full_backprop=first_window_full),
    )
    trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(32, 0), None, None)).setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    steps = [trainer.train_step(data) for _ in range(3)]
    return {"loss": [s.loss for s in steps], "grad_norm": [s.grad_norm for s in steps]}


def _reference() -> dict:
    return {full: _train_truncated({}, full) for full in (True, False)}


def _expert_parallel() -> dict:
    return {full: _train_truncated({"expert_model_parallel_size": 2}, full) for full in (True, False)}


@pytest.mark.slow
def test_truncated_backprop_with_expert_parallel_library_matches_one_process():
    ref = run_distributed(_reference, 1, timeout=300)[0]
    results = run_distributed(_expert_parallel, 2, timeout=600)
    for full in (True, False):
        assert all(l > 0 for l in ref[full]["loss"])
        for rank_result in results:
            got = rank_result[full]
            for key in ("loss", "grad_norm"):
                for a, b in zip(ref[full][key], got[key]):
                    assert abs(a - b) <= 1e-5 * abs(a), (
                        f"first_window_full={full} {key}: {got[key]} vs {ref[full][key]}"
                    )
