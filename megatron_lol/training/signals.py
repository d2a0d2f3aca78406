"""Preemption signals and wall-clock limits, agreed on by every rank at step boundaries.

* :func:`install_handlers` makes SIGTERM and SIGUSR1 set a flag (nothing else:
  no I/O, no collective inside a signal handler). ``megatron-lol train``
  installs them first thing, so a signal that arrives while the run is still
  importing, building the model or loading a checkpoint is remembered and acted
  on at the first step boundary; nothing clears the flag before it is used.
* A stop request can also come as a file, :data:`STOP_FILE_ENV` names it: the
  Slurm scripts write the signal's name there when the batch shell or a task's
  launcher receives it (``--signal=B:USR1@T``, ``scancel --batch``, or a signal
  that reached the task before the trainer listened). Rank 0 looks for the file
  at every step end (one ``stat``).
* :class:`StopCheck` is called at *every* step end on every rank: it all-reduces
  (MAX) the local flags -- "a signal arrived" and "``exit_duration_in_mins`` has
  passed" -- so that all ranks stop after the same step, save a checkpoint and
  exit with :data:`EXIT_REQUEUE`.

Exit codes of ``megatron-lol train``:

=====  ==============================================================
0      finished ``train_iters``
2      configuration / usage error
3      non-finite loss or gradient norm beyond ``skip_nonfinite_steps``
       (or a refused save of non-finite weights)
85     :data:`EXIT_REQUEUE`: a checkpoint was saved because of SIGTERM,
       SIGUSR1 or ``exit_duration_in_mins``; the run is *not* finished
       and should be relaunched (the sbatch scripts ``scontrol requeue``)
=====  ==============================================================

``torchrun`` turns any non-zero worker status into its own status 1, so rank 0
also writes :data:`REQUEUE_MARKER` into the save directory, and every rank
records its status for the batch script (:mod:`megatron_lol.training.runtime`).
The sbatch scripts delete a marker left by an earlier job before they launch,
so only this launch's marker or status can cause a requeue.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

EXIT_REQUEUE = 85
EXIT_NONFINITE = 3
REQUEUE_MARKER = "REQUEUE_REQUESTED"
HANDLED_SIGNALS = ("SIGTERM", "SIGUSR1")
STOP_FILE_ENV = "MEGATRON_LOL_STOP_FILE"

_received: dict = {"signum": None, "count": 0}
_installed: dict = {}


def _handler(signum, frame) -> None:  # pragma: no cover - exercised through subprocesses
    _received["signum"] = signum
    _received["count"] += 1


def install_handlers(names=HANDLED_SIGNALS) -> None:
    """Make each named signal set the stop flag (main thread only; idempotent)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        sig = getattr(signal, name)
        if signal.getsignal(sig) is _handler:
            continue
        # what was there before (restore_handlers puts it back); also when something reset the handler since
        previous = signal.signal(sig, _handler)
        _installed.setdefault(sig, previous)


def ignore_preemption_signals() -> None:
    """Initializer of helper processes (checkpoint writers) that must outlive the signal:
    Slurm delivers SIGUSR1/SIGTERM to *every* process of the job step, and a helper
    with the default disposition would die in the middle of the save the signal asks for."""
    for name in HANDLED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def restore_handlers() -> None:
    for sig, old in list(_installed.items()):
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
        del _installed[sig]


def signal_received() -> Optional[int]:
    return _received["signum"]


def clear() -> None:
    _received["signum"] = None
    _received["count"] = 0


def stop_file_request(path: Optional[str] = None) -> Optional[int]:
    """The signal recorded in the stop file (``$MEGATRON_LOL_STOP_FILE``), or None.

    The file holds a signal name (``SIGUSR1``); an empty or unreadable name
    counts as SIGUSR1, the scripts' preemption signal.
    """
    path = os.environ.get(STOP_FILE_ENV) if path is None else path
    if not path:
        return None
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    name = words[0].upper() if words else "SIGUSR1"
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    return int(sig) if sig is not None and name in HANDLED_SIGNALS else int(signal.SIGUSR1)


def process_start_time() -> float:
    """Wall-clock start of this process (what ``exit_duration_in_mins`` counts from)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover
        return time.time()


class StopCheck:
    """Decides, identically on every rank, whether to save and exit after this step."""

    def __init__(self, exit_duration_in_mins: Optional[float] = None, start_time: Optional[float] = None):
        self.exit_duration_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.start_time = process_start_time() if start_time is None else start_time

    def local_flags(self) -> list:
        sig = signal_received()
        if not sig and _is_rank0():
            sig = stop_file_request()
        timed_out = self.exit_duration_s is not None and time.time() - self.start_time >= self.exit_duration_s
        return [int(sig or 0), int(timed_out)]

    def __call__(self) -> Optional[str]:
        """A reason string when all ranks must stop now, else None (one all-reduce)."""
        import torch

        from megatron_lol.platform import device

        flags = torch.tensor(self.local_flags(), dtype=torch.int64, device=device())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        sig, timed_out = (int(x) for x in flags.tolist())
        if sig:
            try:
                name = signal.Signals(sig).name
            except ValueError:  # pragma: no cover
                name = str(sig)
            return f"received {name}"
        if timed_out:
            return f"exit_duration_in_mins={self.exit_duration_s / 60:g} reached"
        return None


def _is_rank0() -> bool:
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def write_requeue_marker(save_dir: str, iteration: int, reason: str) -> None:
    """``ITERATION REASON [job=ID]``: what the saved run stopped for (Slurm's job id when there is one)."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, REQUEUE_MARKER)
    job = os.environ.get("SLURM_JOB_ID")
    with open(path + ".tmp", "w") as f:
        f.write(f"{iteration} {reason}{f' job={job}' if job else ''}\n")
    os.replace(path + ".tmp", path)


def clear_requeue_marker(save_dir: Optional[str]) -> None:
    if save_dir:
        try:
            os.remove(os.path.join(save_dir, REQUEUE_MARKER))
        except FileNotFoundError:
            pass
