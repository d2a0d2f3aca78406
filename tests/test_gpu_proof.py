"""bench/gpu/run_all.sh: the one-shot GPU proof fits its time limit and runs end to end on the CPU (so it cannot rot).

One dry run (module fixture) with the last part's budget forced down to 2 s: the wheelhouse check, the GPU tests
(skipped), the LoL profile timed over whole steps and megatron-core's GPTModel baseline of equal executed FLOPs are
in the report, the breakdown run is marked timed out and nothing of its process group is left. The process-group
kills themselves (a grandchild that ignores SIGTERM, SIGTERM to the proof) are shown on bash and sleep, in
milliseconds; the wheelhouse installer's torch check on a virtualenv that cannot import torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pytest
from suite_support import scheduling_slack

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "gpu"
sys.path.insert(0, str(BENCH))
try:
    import install_wheelhouse
    import part_runner
    import run_all
finally:
    sys.path.remove(str(BENCH))

KILLED = "lol_bf16_breakdown"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group(pgid: int) -> list:
    """Live processes whose process group is ``pgid`` (psutil: independent of part_runner's /proc reading)."""
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return members


def _wait_for(path: Path, seconds: float = 30) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {seconds} s")


def test_the_budgets_fit_the_limit_and_run_all_sh_takes_its_timeout_from_them(capsys):
    budget = run_all.check_budget()
    assert run_all.TIME_LIMIT_S <= 480 and run_all.MARGIN_S >= 30
    assert budget["total_s"] == run_all.INSTALL_S + sum(run_all.BUDGET_S.values()) + run_all.MARGIN_S
    assert budget["total_s"] <= run_all.TIME_LIMIT_S
    # every run the proof makes has a budget; the grouped core is what lol_bf16 runs on CUDA, not a run of its own
    assert list(run_all.BUDGET_S) == [
        "gpu_tests",
        "lol_bf16",
        "dense_bf16",
        "lol_bf16_breakdown",
        "lol_fp8",
        "dense_fp8",
        "lol_fp8_breakdown",
    ]
    with pytest.raises(SystemExit, match="do not fit the proof's limit of 480 s"):
        run_all.check_budget(dict(run_all.BUDGET_S, gpu_tests=run_all.BUDGET_S["gpu_tests"] + 1))
    # run_all.sh reads the limit and the install's budget from here, and passes the limit back: a different one
    # is refused before anything is written
    assert run_all.main(["--print-budget"]) == 0
    assert capsys.readouterr().out.split() == [str(run_all.TIME_LIMIT_S), str(run_all.INSTALL_S)]
    script = (BENCH / "run_all.sh").read_text()
    assert 'run_all.py --print-budget "$@")' in script and 'timeout "$INSTALL_S"' in script
    assert 'timeout --kill-after=10 "$((LIMIT - spent))"' in script and '--time-limit "$LIMIT"' in script
    assert run_all.main(["--out", "never-written", "--time-limit", "500"]) == 2
    assert capsys.readouterr().err.strip() == (
        "run_all.py: --time-limit 500 (run_all.sh's timeout) is not the budget table's limit of 480 s (TIME_LIMIT_S)"
    )
    for spec, message in (
        ("nope=2", "no part 'nope'"),
        ("gpu_tests=0", "SECONDS must be a number in (0, 150]"),
        ("gpu_tests=151", "SECONDS must be a number in (0, 150]"),
        ("gpu_tests=x", "SECONDS must be a number in (0, 150]"),
    ):
        assert run_all.main(["--out", "never-written", "--part-timeout", spec]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"run_all.py: --part-timeout {spec}: {message}") and "\n" not in err
    assert not (REPO / "never-written").exists()


def test_a_part_past_its_budget_loses_its_whole_process_group(tmp_path):
    """The part's shell ignores SIGTERM (and so does the sleep it started, a grandchild of the caller): SIGKILL
    after the grace period takes both. A part that exits leaving a background process has that one killed."""
    pid_file = tmp_path / "grandchild"
    cmd = ["bash", "-c", f"trap '' TERM; sleep 120 & echo $! > {pid_file}; wait"]
    # the grace is also how long SIGKILLed processes have to vanish: a loaded machine schedules them later
    run = part_runner.run_part(cmd, tmp_path / "part.log", timeout_s=1.0, grace_s=scheduling_slack(0.5))
    grandchild = int(_wait_for(pid_file))
    assert run["timed_out"] and run["exit_code"] is None and run["seconds"] >= 1.0
    assert run["signals"] == ["SIGTERM", "SIGKILL"] and run["left"] == []
    assert not _alive(grandchild) and _group(run["killed_group"]) == []

    pid_file = tmp_path / "left_behind"
    cmd = ["bash", "-c", f"sleep 120 & echo $! > {pid_file}; echo started"]
    run = part_runner.run_part(cmd, tmp_path / "part2.log", timeout_s=30.0, grace_s=0.5)
    assert run["exit_code"] == 0 and not run["timed_out"]
    assert run["left_behind_killed"] == {"signals": ["SIGTERM"], "left": []}
    assert not _alive(int(_wait_for(pid_file))) and (tmp_path / "part2.log").read_text() == "started\n"


DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import part_runner, run_all
out = Path(sys.argv[2])
part_runner.install_sigterm()
proof = run_all.Proof(out, False, run_all.check_budget(), 400, {})
parts = proof.report["parts"]
def body():
    proof.part("gpu_tests", ["bash", "-c", "echo done"], parts, lambda run, log: {"ran": True, "out": log.read_text()})
    proof.part("lol_bf16", ["bash", "-c", f"sleep 120 & echo $! > {out}/grandchild; wait"], parts, lambda r, l: {})
sys.exit(proof.run(body))
"""


def test_sigterm_kills_the_part_in_flight_and_keeps_the_parts_before_it(tmp_path):
    """What run_all.sh's ``timeout`` does at the limit: SIGTERM to run_all.py (twice, as GNU timeout signals the
    command and then its process group). The part in flight loses its process group, grandchildren included;
    the report keeps the part that ended before it and says which one was stopped."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(BENCH), str(tmp_path)], stderr=subprocess.PIPE)
    try:
        grandchild = int(_wait_for(tmp_path / "grandchild"))
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 124, err.decode()[-2000:]
    assert "stopped by SIGTERM" in err.decode()
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["parts"]["gpu_tests"] == {"ran": True, "out": "done\n", "budget_s": 150}
    stopped = report["parts"]["lol_bf16"]
    assert stopped["timed_out"] and "SIGTERM" in stopped["error"] and stopped["signals"] == ["SIGTERM"]
    assert report["timed_out_parts"] == ["lol_bf16"] and not report["complete"]
    assert report["stopped"] == "SIGTERM (the proof's overall time limit) during lol_bf16"
    assert not _alive(grandchild) and _group(stopped["killed_group"]) == []
    assert not list(tmp_path.glob("*.tmp"))  # the report is written whole (temporary file, then renamed)


def test_the_venv_that_cannot_import_torch_falls_back_to_a_pythonpath_directory(tmp_path, monkeypatch, capfd):
    """install_wheelhouse.py checks the virtualenv it made: one without the system's packages cannot import torch,
    so it is removed and the wheels go into a directory on PYTHONPATH, with one line saying why."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tinypkg-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        whl.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        whl.writestr("tinypkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("tinypkg-1.0.dist-info/RECORD", "")
    (tmp_path / "req.txt").write_text("tinypkg==1.0\n")
    monkeypatch.setattr(install_wheelhouse, "VENV_OPTIONS", [])  # no system site packages: no torch there
    monkeypatch.delenv("PYTHONPATH", raising=False)
    setting = install_wheelhouse.install(wheels, tmp_path / "req.txt", tmp_path / "env", "auto")
    assert setting == f"PYTHONPATH={tmp_path / 'env' / 'site'}"
    assert (tmp_path / "env" / "site" / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert not (tmp_path / "env" / "venv").exists()
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"install_wheelhouse.py: the virtualenv {tmp_path / 'env' / 'venv'}")
    assert "import torch fails there (ModuleNotFoundError: No module named 'torch')" in err
    assert err.endswith("installing into a directory on PYTHONPATH instead")
    with pytest.raises(SystemExit, match="does not see this interpreter's torch"):
        install_wheelhouse.install(wheels, tmp_path / "req.txt", tmp_path / "env2", "venv")
    assert not (tmp_path / "env2" / "venv").exists()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_proof")
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "bench/gpu/run_all.sh", "--dry-run", "--part-timeout", f"{KILLED}=2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = json.loads((out / "gpu_report.json").read_text()) if (out / "gpu_report.json").exists() else None
    return proc, report


@pytest.mark.timeout(600)
def test_run_all_dry_run_writes_the_report(dry_run):
    proc, report = dry_run
    # the one timed-out part fails the proof; everything before it is in the report
    assert proc.returncode == 1 and report is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert report["dry_run"] and report["complete"] and not report["environment"]["cuda"]
    assert report["timed_out_parts"] == [KILLED]
    assert {k: v for k, v in report["budget"].items() if k in run_all.check_budget()} == run_all.check_budget()
    assert report["budget"]["part_timeouts"] == {KILLED: 2.0} and report["budget"]["seconds_left"] < 480
    tests = report["parts"]["gpu_tests"]
    # the GPU tests were collected and run by pytest: every one skips without CUDA, none fails
    assert tests["ran"] and tests["exit_code"] == 0 and not tests["failed"] and not tests["passed"]
    # a dry run's parts get DRY_RUN_SLACK times their budgets (a shared CPU is slow), except the forced one
    assert report["budget"]["slack"] == run_all.DRY_RUN_SLACK > 1
    assert tests["budget_s"] == run_all.DRY_RUN_SLACK * run_all.BUDGET_S["gpu_tests"] > tests["seconds"]
    assert len(tests["skipped"]) == 16 and any(
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
    assert set(bf16["runs"]) == {"lol_bf16", "dense_bf16", "lol_over_dense_tokens_per_s"}
    for name in ("lol_bf16", "dense_bf16"):
        run = bf16["runs"][name]
        assert "error" not in run, run.get("error")
        assert run["tokens_per_s_per_gpu"] > 0 and run["mfu"] is None  # no peak for a CPU
        assert run["budget_s"] == run_all.DRY_RUN_SLACK * run_all.BUDGET_S[name]
        # whole steps, no section timers (CUDA events on a GPU; the wall clock here)
        assert run["timing"]["steps"] == "wall_clock" and run["timing"]["section_timers"] is False
    # the dense baseline is megatron-core's GPTModel with the LoL layer spec
    assert bf16["runs"]["dense_bf16"]["model"] == "megatron.core.models.gpt.GPTModel"
    assert bf16["runs"]["dense_bf16"]["spec"] == "local"
    # the profiles measured the models whose executed FLOPs were matched
    assert bf16["runs"]["lol_bf16"]["flops_per_step_executed"] == pytest.approx(dense["lol_flops_per_step"])
    assert bf16["runs"]["dense_bf16"]["flops_per_step_executed"] == pytest.approx(dense["dense_flops_per_step"])
    assert bf16["runs"]["lol_over_dense_tokens_per_s"] > 0
    assert report["parts"]["throughput_fp8"] == {
        "ran": False,
        "reason": "needs Transformer Engine on a GPU with FP8 (8.9+)",
    }
    assert report["goals"] == {"measured": False, "reason": "dry run"}


def test_the_part_killed_by_its_budget_is_marked_and_leaves_no_process(dry_run):
    _, report = dry_run
    killed = report["parts"]["throughput_bf16"]["breakdown"][KILLED]
    assert killed["timed_out"] and killed["exit_code"] is None and killed["budget_s"] == 2.0
    assert killed["error"] == "timed out after 2 s (its budget): its process group was killed"
    assert killed["signals"][0] == "SIGTERM" and killed["left"] == []
    assert _group(killed["killed_group"]) == [] and not _alive(killed["killed_group"])
