"""``megatron-lol train`` with a fault injected into one rank only (test_cluster_faults.py).

Usage: ``python tests/fault_rank_runner.py [FAULT ...] -- train --config ...`` where FAULT is

* ``enospc=RANK:ITER``: on global rank RANK, every checkpoint shard of the save of iteration ITER
  fails to be written with ENOSPC (the other ranks write theirs);
* ``slow=RANK:SECONDS``: rank RANK sleeps SECONDS in every micro-batch's forward (a straggler);
* ``pause=ITER:SECONDS``: every rank sleeps SECONDS after the shards of iteration ITER are written,
  before the checkpoint is committed (a window to kill a rank in the middle of a save).

The faults are monkeypatches of this entry script, so production code carries no switch for them.
"""

from __future__ import annotations

import builtins
import errno
import os
import sys
import time


class _Full:
    """A file object whose writes fail as on a full disk."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False


def _enospc(rank: int, iteration: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real_open = builtins.open
    target = f".tmp_iter_{iteration:07d}"

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if target in str(file) and str(file).endswith(".distcp") and "w" in mode:
            return _Full(f)
        return f

    builtins.open = full_open


def _slow(rank: int, seconds: float) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    from megatron_lol.training.trainer import Trainer

    forward = Trainer._forward_step

    def slow_forward(self, *args, **kwargs):  # inside the step's own work, before its gradient reduction
        time.sleep(seconds)
        return forward(self, *args, **kwargs)

    Trainer._forward_step = slow_forward


def _pause(iteration: int, seconds: float) -> None:
    from megatron_lol.training.checkpointing.checkpointer import Checkpointer

    commit = Checkpointer._commit

    def paused_commit(self, pending, info):
        if pending.iteration == iteration:
            print(
                f"fault: rank {os.environ.get('RANK', '0')} pausing {seconds} s before committing "
                f"iteration {iteration}",
                flush=True,
            )
            time.sleep(seconds)
        return commit(self, pending, info)

    Checkpointer._commit = paused_commit


def main(argv: list) -> int:
    # torchrun drops a "--" right after the script: no faults then
    faults, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else ([], argv)
    for fault in faults:
        kind, _, value = fault.partition("=")
        rank, _, arg = value.partition(":")
        if kind == "enospc":
            _enospc(int(rank), int(arg))
        elif kind == "slow":
            _slow(int(rank), float(arg))
        elif kind == "pause":
            _pause(int(rank), float(arg))
        else:
            raise SystemExit(f"fault_rank_runner: unknown fault {fault!r}")
    from megatron_lol.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":  # not in spawned helper processes (the checkpoint writer's manager)
    sys.exit(main(sys.argv[1:]))
