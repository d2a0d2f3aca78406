"""Faults of one rank among many: a rank that stalls, dies or fails alone, and stragglers.

Each case runs real processes (gloo on CPU), one process per rank as ``srun``
starts them (no torchrun teardown to end the survivors), and asserts how fast
every rank stops, the exit status, the one line naming the culprit (rank, host,
pid or path) on every surviving rank, and what is left on disk. Every launch
runs under a timeout that turns a hang into a failure. The training runs are
the tiny LoL model of ``test_checkpointing.py``; two processes wherever four
would prove nothing more (each process pays ~10 s of megatron-core import on
one core).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import free_port
from test_checkpointing import REPO, make_corpus, metrics, subprocess_env, tracker, write_config

TIMEOUT = pytest.mark.timeout(90, func_only=True)


# ------------------------------------------------------------------ helpers
def launch_ranks(argv: list, world: int, log_dir: Path, env=None, name: str = "rank") -> list:
    """``world`` processes of ``python argv...``, one per rank with torchrun's environment but no agent
    (as ``srun`` launches them): rank 0 hosts the rendezvous store. Each writes ``{name}{r}.log``."""
    port = free_port()
    procs = []
    for r in range(world):
        extra = dict(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, **(env or {}))
        log = open(log_dir / f"{name}{r}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, *map(str, argv)], cwd=str(REPO), env=subprocess_env(**extra),
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
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
            pytest.fail(f"a rank exited ({dead}) before {text!r} appeared in {path}: "
                        f"{path.read_text(errors='replace')[-3000:]}")
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
@pytest.mark.parametrize("stopped", [1, 0])
def test_sigstop_of_one_rank_stops_every_other_rank_naming_it(tmp_path, stopped):
    """SIGSTOP of rank 1 of 3 (watched by rank 2, which tells rank 0 through the store), or of rank 0,
    which also serves the store: each survivor exits with status 5 within the heartbeat timeout, with one
    line naming the stopped rank's host and pid."""
    script = tmp_path / "hb_rank.py"
    script.write_text(_HEARTBEAT_RANK)
    timeout = 3.0
    procs = launch_ranks([script, 0.5, timeout], 3, tmp_path)
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
    # the timeout, plus at most a period to notice and a period to pass the word on (and slack for a busy host)
    assert timeout <= elapsed <= timeout + 6, elapsed
    host = socket.gethostname()
    for r in range(3):
        if r == stopped:
            continue
        out = (tmp_path / f"rank{r}.log").read_text()
        lines = [line for line in out.splitlines() if "stopped answering" in line]
        assert len(lines) == 1, out
        assert f"rank {stopped} (host {host}, pid {victim.pid})" in lines[0], lines[0]
        assert lines[0].startswith("megatron-lol train: error:") and f"rank {r} stops (status 5)" in lines[0]
        assert "Traceback" not in out, out
