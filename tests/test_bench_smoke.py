"""The benchmarks in bench/ run (tiny sizes) and print their tables.

Timings are not asserted (speed is measured by running the benchmarks, not by
tests); what is asserted is that each script runs end to end, checks what it
checks (layer_call.py: the two layer paths give identical outputs) and prints
every row it promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_layer_call_runs_and_paths_agree():
    out = _run(
        "layer_call.py",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--ffn",
        "64",
        "--tokens",
        "96",
        "--window",
        "8",
        "--calls",
        "1,4",
        "--reps",
        "1",
    )
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "4"] and [r[1] for r in rows] == ["96", "24"]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_step_time_runs_every_model(tmp_path):
    out_json = tmp_path / "step.json"
    out = _run(
        "step_time.py",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--ffn",
        "64",
        "--seq",
        "64",
        "--window",
        "16",
        "--shift",
        "8",
        "--batch",
        "2",
        "--vocab",
        "128",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out_json),
    )
    result = json.loads(out_json.read_text())
    assert set(result["models"]) == {"lol", "fixed", "forced", "dense"}
    for name, row in result["models"].items():
        assert len(row["cpu_times_s"]) == 2 and row["cpu_median_s"] > 0, name
        assert row["flops_allowed"] > 0 and row["predicted_ratio_executed"] > 0, name
        assert row["ratio_of_mins"] > 0, name
    assert "paired lol/this" in out
    assert result["fused_cpu_kernel"] is True  # the CPU kernel builds here, so the benchmark times it
    assert "gated combine: fused CPU kernel" in out


def test_launches_counts_every_path_and_the_grouped_core_reads_nothing_back():
    out = _run(
        "launches.py",
        "--blocks",
        "2,4",
        "--depth",
        "2",
        "--seq",
        "32",
        "--film",
        "depth",
        "--reps",
        "0",
        "--what",
        "counts,stacking",
        "--stacking-shapes",
        "quickstart",
    )
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["local"], ["packed"])]
    paths = {(r[0], r[1], " ".join(r[2:4])) for r in rows if r[2] in ("core", "model")}
    assert paths == {
        (lay, L, p)
        for lay in ("local", "packed")
        for L in ("2", "4")
        for p in ("core ref", "core grouped", "model ref", "model grouped")
    }
    assert {r[0] for r in rows if r[2] == "dense"} == {"local", "packed"}
    for r in rows:
        if r[2:4] == ["core", "grouped"]:
            assert r[4:6] == ["0", "0"], r  # no host synchronisation, forward or backward
        if r[2:4] in (["core", "ref"], ["model", "ref"]):
            # the per-block executor reads its group sizes once per routed depth (D = 2), nothing per
            # block call, on the local and the packed layout alike (its THD offsets come from the device)
            assert r[4:6] == ["2", "0"] and r[-2:] == ["tolist", "2"], r
        if r[2:4] == ["model", "grouped"]:  # at most 2 reads a micro-batch, local and packed (THD RoPE included)
            assert int(r[4]) + int(r[5]) <= 2, r
        if r[2] == "dense":  # given the host layout, its THD offsets too (a one-word path: columns from 3)
            assert r[3:5] == ["0", "0"], r
    assert "L=4 / dense" in out
    assert any(line.startswith("quickstart") for line in out.splitlines())  # the stacking measurement


def test_launches_expert_parallel_reads_the_split_sizes_once_per_depth():
    out = _run("launches.py", "--blocks", "2,4", "--depth", "2", "--seq", "32", "--what", "expert-parallel")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["local"], ["packed"])]
    assert {(r[0], r[1], r[3]) for r in rows} == {
        (lay, L, p) for lay in ("local", "packed") for L in ("2", "4") for p in ("ref", "grouped")
    }
    for r in rows:
        if r[3] == "grouped":  # one read per routed depth (the exchange's split sizes), none in backward
            assert r[4:6] == ["2", "0"] and r[-2:] == ["tolist", "2"], r
        else:  # the per-block executor behind the same exchange: its block sizes from the split table
            assert r[4:6] == ["2", "0"] and r[-2:] == ["tolist", "2"], r  # THD offsets found without a read


def test_bf16_grads_prints_both_paths_for_each_depth():
    out = _run("bf16_grads.py", "--depths", "2", "5", "--hidden", "32", "--seq", "32", "--batch", "2")
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "reference"), ("2", "grouped"), ("5", "reference"), ("5", "grouped")]
    # BF16 against FP32: a small error, not zero (the runs really differ in precision)
    assert all(0 < float(r[-2]) < 0.2 and float(r[-2]) <= float(r[-1]) for r in rows)
