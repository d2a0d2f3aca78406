"""bench/gpu/run_all.sh --dry-run: the one-shot GPU proof runs end to end on the CPU (so it cannot rot): the
wheelhouse check, the GPU tests (skipped), the LoL profile timed over whole steps, megatron-core's GPTModel
baseline of equal executed FLOPs, and the labelled breakdown run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_run_all_dry_run_writes_the_report(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        ["bash", "bench/gpu/run_all.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["dry_run"] and report["complete"] and not report["environment"]["cuda"]
    tests = report["parts"]["gpu_tests"]
    # the GPU tests were collected and run by pytest: every one skips without CUDA, none fails
    assert tests["ran"] and tests["exit_code"] == 0 and not tests["failed"] and not tests["passed"]
    assert len(tests["skipped"]) == 15 and any(
        n.startswith("test_one_gpu_equals_cpu_in_fp32[lol") for n in tests["skipped"]
    )
    # the wheelhouse list covers what the profiled config needs (Muon's packages included)
    wheelhouse = report["parts"]["wheelhouse"]
    assert wheelhouse["missing"] == [] and {"megatron-core", "emerging-optimizers", "absl-py"} <= set(
        wheelhouse["needed"]
    )
    bf16 = report["parts"]["throughput_bf16"]
    dense = bf16["dense_of_equal_flops"]
    assert 0.9 < dense["flops_ratio"] < 1.1
    for name in ("lol_bf16", "lol_bf16_grouped", "dense_bf16"):
        run = bf16["runs"][name]
        assert "error" not in run, run.get("error")
        assert run["tokens_per_s_per_gpu"] > 0 and run["mfu"] is None  # no peak for a CPU
        # whole steps, no section timers (CUDA events on a GPU; the wall clock here)
        assert run["timing"]["steps"] == "wall_clock" and run["timing"]["section_timers"] is False
    # the dense baseline is megatron-core's GPTModel with the LoL layer spec
    assert bf16["runs"]["dense_bf16"]["model"] == "megatron.core.models.gpt.GPTModel"
    assert bf16["runs"]["dense_bf16"]["spec"] == "local"
    # the profiles measured the models whose executed FLOPs were matched
    assert bf16["runs"]["lol_bf16"]["flops_per_step_executed"] == pytest.approx(dense["lol_flops_per_step"])
    assert bf16["runs"]["lol_bf16_grouped"]["flops_per_step_executed"] == pytest.approx(dense["lol_flops_per_step"])
    assert bf16["runs"]["lol_grouped_over_dense_tokens_per_s"] > 0
    assert bf16["runs"]["dense_bf16"]["flops_per_step_executed"] == pytest.approx(dense["dense_flops_per_step"])
    # the section breakdown is a separate, labelled run
    breakdown = bf16["breakdown"]["lol_bf16_breakdown"]
    assert "error" not in breakdown and breakdown["timing"]["section_timers"] is True
    assert breakdown["breakdown_s"]["core"] > 0 and "not throughput" in breakdown["note"]
    assert report["parts"]["throughput_fp8"] == {
        "ran": False,
        "reason": "needs Transformer Engine on a GPU with FP8 (8.9+)",
    }
    assert report["goals"] == {"measured": False, "reason": "dry run"}
