"""Faults of one rank among many: a rank that stalls, dies or fails alone, and stragglers.

Each case runs real processes (gloo on CPU), one process per rank as ``srun``
starts them (no torchrun teardown to end the survivors; forked from a preloaded
interpreter, tests/cli_processes.py) or under torchrun (fresh interpreters), and
asserts how fast every rank stops, the exit status, the one line naming the
culprit (rank, host, pid or path) on every surviving rank, and what is left on
disk. The four-rank torchrun kills need no reference run: the killed run's own
losses after its last complete checkpoint are what the relaunch must repeat; the
relaunches prove the resume, so they start as ``srun`` would. Every launch runs
under a timeout that turns a hang into a failure. The training runs are the tiny
LoL model of ``test_checkpointing.py``; two processes wherever four would prove
nothing more (a fresh interpreter pays ~6 s of CPU for its imports).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import cli_processes
import pytest
from distributed import free_port
from suite_support import load_factor, scheduling_slack
from test_checkpointing import REPO, make_corpus, metrics, subprocess_env, tracker, write_config

TIMEOUT = pytest.mark.timeout(90, func_only=True)
pytestmark = pytest.mark.multiprocess  # ranks of their own: the whole machine (tests/suite_support.py)


# ------------------------------------------------------------------ helpers
def kill_rank_and_reap(proc: subprocess.Popen, rank: int, timeout: float = 60) -> tuple:
    """SIGKILL the worker of launcher ``proc`` whose ``RANK`` is ``rank``; wait for the launcher and every
    worker to go. Returns ``(launcher status, seconds until it exited, workers still alive)``."""
    import psutil

    workers = psutil.Process(proc.pid).children(recursive=True)
    next(w for w in workers if w.environ().get("RANK") == str(rank)).kill()
    t0 = time.monotonic()
    status = proc.wait(timeout=timeout)
    elapsed = time.monotonic() - t0
    _, alive = psutil.wait_procs(workers, timeout=max(0.1, timeout - elapsed))
    return status, elapsed, alive


def launch_ranks(argv: list, world: int, log_dir: Path, env=None, name: str = "rank") -> list:
    """``world`` processes of ``python argv...``, one per rank with torchrun's environment but no agent
    (as ``srun`` launches them): rank 0 hosts the rendezvous store. Each writes ``{name}{r}.log``."""
    port = free_port()
    procs = []
    for r in range(world):
        extra = dict(
            RANK=r,
            LOCAL_RANK=r,
            WORLD_SIZE=world,
            LOCAL_WORLD_SIZE=world,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **(env or {}),
        )
        log = log_dir / f"{name}{r}.log"
        log.write_bytes(b"")
        procs.append(cli_processes.start(argv, env=subprocess_env(**extra), log=log, cwd=REPO))
    return procs


def reap(procs: list, deadline: float) -> list:
    """Exit statuses; every process still running at ``deadline`` (time.monotonic) is killed and the test fails."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
                    q.wait()
            pytest.fail(f"ranks still running at the deadline (hang): {[q.pid for q in procs]}")
    return codes


def kill_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for_text(path: Path, text: str, procs: list, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead:
            kill_all(procs)
            pytest.fail(
                f"a rank exited ({dead}) before {text!r} appeared in {path}: {path.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.05)
    kill_all(procs)
    pytest.fail(f"{text!r} did not appear in {path} within {timeout} s")


# a rank that beats and runs all-reduces until it is stopped; torch only, so three start in seconds
_HEARTBEAT_RANK = """
import sys, time, torch, torch.distributed as dist
from megatron_lol.training.heartbeat import Heartbeat
dist.init_process_group("gloo")
hb = Heartbeat(interval=float(sys.argv[1]), timeout=float(sys.argv[2])).start()
print("ready", flush=True)
t = torch.ones(1)
while True:
    dist.all_reduce(t)
    time.sleep(0.05)
"""


# ------------------------------------------------------------------ 2. one rank stalls
@TIMEOUT
@pytest.mark.mostly_waiting  # three ranks that beat and sleep: the machine was 29 % busy while it held both cores
@pytest.mark.parametrize("stopped", [1, 0])
def test_sigstop_of_one_rank_stops_every_other_rank_naming_it(tmp_path, stopped):
    """SIGSTOP of rank 1 of 3 (watched by rank 2, which tells rank 0 through the store), or of rank 0,
    which also serves the store: each survivor exits with status 5 within the heartbeat timeout, with one
    line naming the stopped rank's host and pid."""
    script = tmp_path / "hb_rank.py"
    script.write_text(_HEARTBEAT_RANK)
    interval, timeout = 0.5, 3.0
    procs = launch_ranks([script, interval, timeout], 3, tmp_path)
    try:
        for r in range(3):
            wait_for_text(tmp_path / f"rank{r}.log", "ready", procs, 60)
        time.sleep(1.0)  # a few beats of every rank
        victim = procs[stopped]
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        survivors = [p for r, p in enumerate(procs) if r != stopped]
        codes = reap(survivors, t0 + 30)
        elapsed = time.monotonic() - t0
    finally:
        kill_all(procs)
    assert codes == [5, 5], codes
    # the timeout counts from the stopped rank's last beat, which a busy host may have delayed before the
    # SIGSTOP: the detector's own count of silent seconds (in the line) is what must reach the timeout; then
    # at most a period to notice and a period to pass the word on (slack grown with the machine's load)
    assert elapsed <= timeout + scheduling_slack(6), (elapsed, load_factor())
    host = socket.gethostname()
    for r in range(3):
        if r == stopped:
            continue
        out = (tmp_path / f"rank{r}.log").read_text()
        lines = [line for line in out.splitlines() if "stopped answering" in line]
        assert len(lines) == 1, out
        assert f"rank {stopped} (host {host}, pid {victim.pid})" in lines[0], lines[0]
        assert lines[0].startswith("megatron-lol train: error:") and f"rank {r} stops (status 5)" in lines[0]
        assert silent_seconds(lines[0]) >= timeout, lines[0]
        assert "Traceback" not in out, out


# ------------------------------------------------------------------ training runs of two ranks
RUNNER = REPO / "tests" / "fault_rank_runner.py"
TRAIN_ITERS = 6
HB_TIMEOUT = 6  # seconds: short for the tests, long enough that a busy one-core machine never trips it
HB_INTERVAL = 0.5
HEARTBEAT = ["--heartbeat-interval", str(HB_INTERVAL), "--heartbeat-timeout", str(HB_TIMEOUT)]
RUN_TIMEOUT = 75  # a hang guard: two forked ranks train the tiny model in ~10 s


def train_ranks(config: Path, save: Path, log_dir: Path, *args, faults=(), name="rank", world=2) -> list:
    """``megatron-lol train`` on ``world`` ranks, one process each, with ``faults`` of fault_rank_runner.py."""
    return launch_ranks(
        [RUNNER, *faults, "--", "train", "--config", config, "--save", save, *HEARTBEAT, *args],
        world,
        log_dir,
        name=name,
    )


def silent_seconds(line: str) -> int:
    """The seconds of silence the heartbeat counted before it declared a rank (or the store) gone."""
    found = re.search(r"(?:no heartbeat|no reply) for (\d+) s \(heartbeat timeout", line)
    assert found, line
    return int(found.group(1))


def one_error_line(out: str) -> str:
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("megatron-lol train: error:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    prefix, tok = make_corpus(root / "data")
    config = write_config(
        root / "tiny.yaml", prefix, tok, str(root / "cache"), train_iters=TRAIN_ITERS, save_interval=2
    )
    return {"root": root, "config": config}


@pytest.fixture(scope="module")
def continued(corpus):
    """Rank 1's shards of the save of iteration 4 hit ENOSPC, with training.on_save_failure=continue, and rank 1
    is a straggler: the run goes on to iteration 6. Its losses are those of an uninterrupted run (neither fault
    changes the arithmetic), the reference for the resume tests."""
    root = corpus["root"]
    save, logs = root / "continued", root / "continued_logs"
    logs.mkdir()
    procs = train_ranks(
        corpus["config"], save, logs, "--on-save-failure", "continue", faults=["enospc=1:4", "slow=1:0.6"]
    )
    codes = reap(procs, time.monotonic() + RUN_TIMEOUT)
    out = (logs / "rank0.log").read_text()
    assert codes == [0, 0], out[-3000:] + (logs / "rank1.log").read_text()[-3000:]
    return {"save": save, "out": out, "metrics": metrics(save)}


# ------------------------------------------------------------------ 3. one rank fails alone
@TIMEOUT
def test_save_failure_on_one_rank_with_on_save_failure_continue_and_a_straggler(continued):
    """Every rank agreed the save of iteration 4 failed; the line names rank 1, its host and its shard; the
    tracker stayed at 2 until the save of 6; the log line's min/max ms/iter names the straggler, rank 1."""
    save, out = continued["save"], continued["out"]
    lines = [line for line in out.splitlines() if "saving iteration 4 failed" in line]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    assert f"writing {save}/.tmp_iter_0000004/__1_0.distcp on rank 1 (host {socket.gethostname()})" in line, line
    assert "No space left on device (ENOSPC)" in line and "last complete checkpoint is iter_0000002" in line, line
    assert "on_save_failure=continue" in line
    assert tracker(save) == TRAIN_ITERS and not (save / "iter_0000004").exists()
    assert not any(p.name.startswith(".tmp_") for p in save.iterdir())
    got = continued["metrics"]
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1))
    # rank 1 sleeps 600 ms in every forward, before its gradient reduction (a loaded machine delays a rank by
    # a few hundred ms now and then; idle, the noise is tens of ms)
    assert all(r["max_ms_rank"] == 1 and r["min_ms_rank"] == 0 for r in got.values()), got
    assert all(r["max_ms_per_iteration"] - r["min_ms_per_iteration"] > 150 for r in got.values()), got
    assert "min/max ms/iter" in out and "(rank 1)" in out.split("min/max ms/iter")[1].split("|")[0]


@TIMEOUT
def test_save_failure_on_one_rank_stops_every_rank_with_one_line(corpus, tmp_path):
    """The default (training.on_save_failure=stop), with asynchronous saves (the synchronous path is the
    ``continued`` run's): both ranks exit 2 with the same line naming rank 1 and its shard; iteration 2 stays
    the latest checkpoint; nothing partial is left."""
    save = tmp_path / "stop"
    procs = train_ranks(corpus["config"], save, tmp_path, "--async-save", faults=["enospc=1:4"])
    codes = reap(procs, time.monotonic() + RUN_TIMEOUT)
    assert codes == [2, 2], codes
    lines = [one_error_line((tmp_path / f"rank{r}.log").read_text()) for r in range(2)]
    assert lines[0] == lines[1], lines
    assert f"saving iteration 4 failed: writing {save}/.tmp_iter_0000004/__1_0.distcp on rank 1" in lines[0]
    assert "ENOSPC" in lines[0] and "no rank moved the tracker" in lines[0]
    assert tracker(save) == 2 and sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002"
    ]
    assert not any(p.name.startswith(".tmp_") for p in save.iterdir())


@TIMEOUT
def test_corrupt_shard_of_one_rank_stops_every_rank_naming_file_and_rank(corpus, continued, tmp_path):
    """Flipped bytes in rank 1's shard of the latest checkpoint: both ranks stop with status 2 before training,
    with one line naming the file and the rank that wrote it; nothing on disk changes."""
    import shutil

    save = tmp_path / "corrupt"
    shutil.copytree(continued["save"], save)
    shard = save / "iter_0000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    procs = train_ranks(corpus["config"], save, tmp_path)
    codes = reap(procs, time.monotonic() + RUN_TIMEOUT)
    assert codes == [2, 2], codes
    for r in range(2):
        line = one_error_line((tmp_path / f"rank{r}.log").read_text())
        assert f"{shard} is corrupted or truncated: its SHA-256 differs" in line, line
        assert "(written by rank 1)" in line, line
    assert shard.read_bytes() == bytes(data) and tracker(save) == TRAIN_ITERS


# ------------------------------------------------------------------ 2. one rank stalls, in training
@TIMEOUT
@pytest.mark.mostly_waiting  # three ranks wait out the timeout: 56 % busy while it held both cores
def test_sigstop_of_one_rank_of_a_tp2_dp2_run_ends_every_rank_within_the_heartbeat_timeout(corpus, tmp_path):
    """The same in training at TP=2 x DP=2 (four ranks): rank 2 stops inside a step; rank 3 (its watcher) and
    ranks 0 and 1 (told through the store) all exit with status 5 after the heartbeat timeout (plus a period
    or two), each with one line naming rank 2's host and pid."""
    save = tmp_path / "stall"
    procs = train_ranks(
        corpus["config"],
        save,
        tmp_path,
        "--train-iters",
        3000,
        "--save-interval",
        3000,
        "--tensor-model-parallel-size",
        2,
        world=4,
    )
    try:
        wait_for_text(tmp_path / "rank0.log", "iteration      3/", procs, 90)
        os.kill(procs[2].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        survivors = [procs[r] for r in (0, 1, 3)]
        codes = reap(survivors, t0 + 30)
        elapsed = time.monotonic() - t0
    finally:
        kill_all(procs)
    # counted from the stopped rank's last beat: the line's silent seconds reach the timeout
    assert codes == [5, 5, 5] and elapsed <= HB_TIMEOUT + scheduling_slack(6), (codes, elapsed, load_factor())
    for r in (0, 1, 3):
        line = one_error_line((tmp_path / f"rank{r}.log").read_text())
        assert silent_seconds(line) >= HB_TIMEOUT, line
        assert f"rank 2 (host {socket.gethostname()}, pid {procs[2].pid}) stopped answering" in line, line
        assert f"rank {r} stops (status 5)" in line, line


# ------------------------------------------------------------------ 1. one rank dies (no torchrun teardown)
@TIMEOUT
@pytest.mark.mostly_waiting  # two ranks, one paused in its save: 52 % busy while it held both cores
def test_kill9_of_one_rank_during_a_save_ends_the_job_and_the_relaunch_resumes_bit_identically(
    corpus, continued, tmp_path
):
    """Ranks launched one process each (as srun does): rank 1 is killed while the save of iteration 4 waits to
    be committed. Rank 0 ends non-zero within 60 s (the collective of the commit fails, or the heartbeat names
    rank 1); iteration 2 stays the latest; the relaunch resumes from it and logs the reference's losses bit for
    bit."""
    save = tmp_path / "kill"
    procs = train_ranks(corpus["config"], save, tmp_path, faults=["pause=4:30"])
    try:
        wait_for_text(tmp_path / "rank1.log", "pausing", procs, 60)
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = reap(procs, t0 + 60)
        elapsed = time.monotonic() - t0
    finally:
        kill_all(procs)
    # rank 0 waits out the pause in its own code: the heartbeat names rank 1 after its timeout
    assert codes == [5, -signal.SIGKILL] and elapsed < HB_TIMEOUT + scheduling_slack(6), (codes, elapsed)
    line = one_error_line((tmp_path / "rank0.log").read_text())
    assert f"rank 1 (host {socket.gethostname()}, pid {procs[1].pid}) stopped answering" in line, line
    assert tracker(save) == 2 and not (save / "iter_0000004").exists()
    procs = train_ranks(corpus["config"], save, tmp_path, name="again")
    codes = reap(procs, time.monotonic() + RUN_TIMEOUT)
    assert codes == [0, 0], (tmp_path / "again0.log").read_text()[-3000:]
    got, ref = metrics(save), continued["metrics"]
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1))
    for s in range(1, TRAIN_ITERS + 1):
        assert (got[s]["loss"], got[s]["grad_norm"], got[s]["lr"]) == (
            ref[s]["loss"],
            ref[s]["grad_norm"],
            ref[s]["lr"],
        ), (s, got[s], ref[s])
    assert tracker(save) == TRAIN_ITERS


# ------------------------------------------------------------------ 4. stragglers in the profile report
@TIMEOUT
def test_profile_report_names_the_slowest_rank(corpus, tmp_path):
    report = tmp_path / "profile.json"
    procs = launch_ranks(
        [
            RUNNER,
            "slow=1:0.3",
            "--",
            "profile",
            "--config",
            corpus["config"],
            "--steps",
            2,
            "--warmup",
            1,
            "--no-breakdown",
            "--json",
            report,
            "--heartbeat-interval",
            0,
        ],
        2,
        tmp_path,
    )
    codes = reap(procs, time.monotonic() + RUN_TIMEOUT)
    out = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0], out[-3000:]
    import json

    rep = json.loads(report.read_text())
    assert rep["stragglers"]["slowest"]["rank"] == 1 and rep["stragglers"]["fastest"]["rank"] == 0, rep["stragglers"]
    assert f"slowest rank     1 (host {socket.gethostname()})" in out, out[-2000:]


# ------------------------------------------------------------------ settings and report helpers
def test_heartbeat_and_save_failure_settings_are_validated():
    from megatron_lol.config.schema import ConfigError, TrainingConfig

    TrainingConfig(heartbeat_interval=0).validate()  # off
    assert TrainingConfig(distributed_timeout_minutes=2).stall_timeout_seconds == 120.0
    assert TrainingConfig(heartbeat_timeout=4.0).stall_timeout_seconds == 4.0
    for kwargs, key in [
        ({"heartbeat_interval": -1.0}, "training.heartbeat_interval"),
        ({"heartbeat_timeout": 0.0}, "training.heartbeat_timeout"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 8.0}, "training.heartbeat_timeout"),
        ({"on_save_failure": "retry"}, "training.on_save_failure"),
    ]:
        with pytest.raises(ConfigError, match=key):
            TrainingConfig(**kwargs).validate()


def test_stragglers_and_log_line_name_the_ranks():
    from megatron_lol.training.console import format_line
    from megatron_lol.training.profile_report import stragglers

    rows = [
        {"rank": 0, "host": "a", "compute_time_s": 0.05},
        {"rank": 1, "host": "b", "compute_time_s": 0.35},
        {"rank": 2, "host": "c", "compute_time_s": None},
    ]
    assert stragglers(rows) == {
        "slowest": {"rank": 1, "host": "b", "compute_time_s": 0.35},
        "fastest": {"rank": 0, "host": "a", "compute_time_s": 0.05},
    }
    assert stragglers(rows[:1]) is None
    record = {
        "step": 3,
        "consumed_samples": 12,
        "consumed_tokens": 768,
        "ms_per_iteration": 400.0,
        "loss": 6.0,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "depth": 2,
        "tokens_per_s": 1.0,
        "tflops_per_device": 0.0,
        "skipped_iterations": 0,
        "nan_iterations": 0,
        "peak_memory_bytes": 1 << 20,
        "min_ms_per_iteration": 50.0,
        "min_ms_rank": 0,
        "max_ms_per_iteration": 350.0,
        "max_ms_rank": 1,
    }
    assert "| ms/iter 400.0 | min/max ms/iter 50.0 (rank 0)/350.0 (rank 1) | loss 6.0000" in format_line(record, 6)


@TIMEOUT
def test_kill9_of_one_rank_mid_run_ends_the_other_at_once_naming_it(corpus, tmp_path):
    """Ranks launched one process each, rank 1 killed inside training: rank 0's collective fails at once
    (gloo sees the closed connection) and, instead of a traceback, rank 0 prints one line naming rank 1 (its
    heartbeat stood still) and exits 5 within seconds, long before any timeout."""
    save = tmp_path / "midrun"
    procs = train_ranks(corpus["config"], save, tmp_path, "--train-iters", 3000, "--save-interval", 3000)
    try:
        wait_for_text(tmp_path / "rank0.log", "iteration      3/", procs, 90)
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = reap(procs, t0 + 30)
        elapsed = time.monotonic() - t0
    finally:
        kill_all(procs)
    # the closed connection, not the heartbeat timeout, ends it (the line below says which)
    assert codes == [5, -signal.SIGKILL] and elapsed < scheduling_slack(HB_TIMEOUT), (codes, elapsed)
    line = one_error_line((tmp_path / "rank0.log").read_text())
    assert (
        f"rank 1 (host {socket.gethostname()}, pid {procs[1].pid}) stopped answering: its heartbeat stopped (" in line
        and "rank 0 stops (status 5)" in line
    ), line


# ------------------------------------------------------------------ 1. one rank dies under torchrun
# ------------------------------------------------------------------ 1. one rank of four dies under torchrun
@pytest.mark.timeout(150, func_only=True)
@pytest.mark.parametrize(
    "layout, when",
    [(["--tensor-model-parallel-size", "2"], "mid-run"), (["--pipeline-model-parallel-size", "2"], "save")],
    ids=["tp2_dp2_mid_run", "pp2_dp2_during_save"],
)
def test_kill9_of_one_of_four_torchrun_workers_ends_the_job_and_the_relaunch_resumes_bit_identically(
    corpus, tmp_path, layout, when
):
    """Four ranks under torchrun (TP=2 x DP=2 or PP=2 x DP=2), one of them, chosen at random, killed with
    kill -9 at a random step mid-run (steps slowed to 0.3 s so the kill lands inside the run) or while the
    save of iteration 4 waits to be committed: torchrun and every worker are gone within 60 s, the status is
    non-zero, the tracker names the last complete checkpoint and no later one exists. No reference run: the
    killed run logged the losses of the steps after that checkpoint, and the relaunch (same layout, resumed
    from it) must log those losses again bit for bit."""
    import random

    rng = random.Random()
    victim_rank = rng.randrange(4)
    save, log = tmp_path / "run", tmp_path / "torchrun.log"
    cmd = cli_processes.torchrun_command(4, RUNNER)
    args = ["--", "train", "--config", str(corpus["config"]), "--save", str(save), *HEARTBEAT, *layout]
    if when == "mid-run":
        kill_after = rng.choice([3, 4])  # the step whose metrics record triggers the kill
        faults = [f"slow={r}:0.3" for r in range(4)]
    else:
        kill_after = None
        faults = ["pause=4:5"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd + faults + args,
            cwd=str(REPO),
            env=subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        t_start = t0 = time.monotonic()
        while True:
            assert proc.poll() is None and time.monotonic() - t0 < 100, log.read_text()[-3000:]
            if kill_after is not None and max(metrics(save), default=0) >= kill_after:
                break
            if kill_after is None and f"fault: rank {victim_rank} pausing" in log.read_text(errors="replace"):
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        status, elapsed, alive = kill_rank_and_reap(proc, victim_rank)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed = f"rank {victim_rank} killed {when} (after step {kill_after})"
    print(f"{killed}: started {t0 - t_start:.1f} s in, job gone {elapsed:.1f} s later", flush=True)
    assert status != 0 and elapsed < 60 and not alive, (killed, status, elapsed, alive)
    logged = metrics(save)
    kept = tracker(save)
    done = max(logged)
    assert done < TRAIN_ITERS, f"{killed}: the kill came too late to be mid-run"
    assert kept is not None and kept < done and (save / f"iter_{kept:07d}" / "checksums.json").is_file(), (killed, kept)
    assert sorted(p.name for p in save.glob("iter_*"))[-1] == f"iter_{kept:07d}", (killed, list(save.iterdir()))
    if when == "save":
        assert kept == 2 and done == 4, (kept, done)
    # the relaunch (same layout): what it proves is the resume, so its ranks start as srun starts them
    status, out = cli_processes.run_ranks(
        [RUNNER, *args], 4, env=subprocess_env(), cwd=REPO, log=log, timeout=RUN_TIMEOUT
    )
    assert status == 0, out[-3000:]
    assert tracker(save) == TRAIN_ITERS
    records = []
    for line in (save / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            pass
    resumed = records[len(records) - (TRAIN_ITERS - kept) :]  # the relaunch's records, after the killed run's
    assert [r["step"] for r in resumed] == list(range(kept + 1, TRAIN_ITERS + 1)), (killed, records)
    for r in resumed:
        s = r["step"]
        if s <= done:  # logged by the killed run: the relaunch must reproduce it exactly
            want = [logged[s][k] for k in ("loss", "grad_norm", "lr")]
            assert [r["loss"], r["grad_norm"], r["lr"]] == want, (killed, r, logged[s])
