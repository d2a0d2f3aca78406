"""``megatron-lol VERB`` with faults injected: the tests' (and drills') entry script.

Usage: ``python tests/fault_rank_runner.py [FAULT ...] -- train --config ...`` (or under torchrun, or
as the Slurm scripts' ``MEGATRON_LOL_ENTRY``) where FAULT is

* ``enospc=RANK:ITER``: on global rank RANK, every checkpoint shard of the save of iteration ITER
  fails to be written with ENOSPC (the other ranks write theirs);
* ``slow=RANK:SECONDS``: rank RANK sleeps SECONDS in every micro-batch's forward (a straggler);
* ``pause=ITER:SECONDS``: every rank sleeps SECONDS after the shards of iteration ITER are handed to
  megatron-core, before the checkpoint is committed (a window to kill a run in the middle of a save,
  or to signal it before it ends); in the first launch of a Slurm job only: a requeued job's restart
  (``SLURM_RESTART_COUNT`` > 0) that saves ITER again needs no window and does not wait;
* ``nan=ITER[,ITER...]``: the model's output (the per-token loss) is multiplied by NaN in the forward
  passes of those 1-based iterations, so the loss *and* the gradients are non-finite.

``pause`` and ``nan`` go through the trainer's fault hooks (``megatron_lol.training.hooks.FaultHooks``,
given to the train CLI); ``enospc`` and ``slow`` are monkeypatches of this process (a full disk, a slow
rank: ``slow`` also works for ``profile``). Production code carries no switch for any of them.
"""

from __future__ import annotations

import builtins
import errno
import os
import sys
import time

from megatron_lol.training.hooks import FaultHooks, Hook


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


def _pause(iteration: int, seconds: float):
    def pause(at: int, tmp: str) -> None:
        if at == iteration and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            print(f"fault: rank {os.environ.get('RANK', '0')} pausing {seconds} s before committing {tmp}", flush=True)
            time.sleep(seconds)

    return pause


class NaNLoss(Hook):
    """Multiplies the model's output by NaN in the training forward passes of the given iterations."""

    def __init__(self, steps):
        self.steps = set(steps)
        self.handle = None

    def on_start(self, trainer) -> None:
        def poison(module, args, output):
            if module.training and trainer.iteration + 1 in self.steps:
                if isinstance(output, tuple):  # (loss, core output)
                    return (output[0] * float("nan"),) + tuple(output[1:])
                return output * float("nan")
            return output

        self.handle = trainer.model.register_forward_hook(poison)
        print(f"fault: NaN loss at iterations {sorted(self.steps)}", flush=True)

    def on_end(self, trainer, stop) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def main(argv: list) -> int:
    # torchrun drops a "--" right after the script: no faults then
    faults, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else ([], argv)
    callbacks, before_commit = [], None
    for fault in faults:
        kind, _, value = fault.partition("=")
        first, _, arg = value.partition(":")
        if kind == "enospc":
            _enospc(int(first), int(arg))
        elif kind == "slow":
            _slow(int(first), float(arg))
        elif kind == "pause":
            before_commit = _pause(int(first), float(arg))
        elif kind == "nan":
            callbacks.append(NaNLoss(int(s) for s in value.split(",") if s))
        else:
            raise SystemExit(f"fault_rank_runner: unknown fault {fault!r}")
    from megatron_lol.cli import main as cli_main

    if callbacks or before_commit:
        if rest[:1] != ["train"]:
            raise SystemExit(f"fault_rank_runner: pause and nan need the train verb (got {rest[:1]})")
        hooks = FaultHooks(callbacks=tuple(callbacks), **({"before_commit": before_commit} if before_commit else {}))
        return cli_main(rest, faults=hooks)
    return cli_main(rest)


if __name__ == "__main__":  # not in spawned helper processes (the checkpoint writer's manager)
    sys.exit(main(sys.argv[1:]))
