"""Settings of one launched process that come from where it runs, not from the config.

* :func:`resolve_threads`: torch's intra-op threads. Its default (every core of
  the machine per process) collapses throughput on a shared node: eight ranks
  of a node each start as many threads as the node has cores, and a job on a
  slice of a busy machine spends its time in contended OpenMP barriers. The
  default here is the process's share of what Slurm allocated (or of the CPUs
  it may run on outside Slurm).
* :func:`record_exit`: the exit status and one-line error of a rank, written
  where the sbatch scripts read it (``$MEGATRON_LOL_STATUS_DIR``).
  ``torchrun`` reports any failed worker as status 1 and ``srun
  --kill-on-bad-exit`` reports the ranks it killed (143), so neither tells
  the batch script that a run stopped with a configuration error (2), a
  non-finite loss (3), tensor-parallel ranks that routed differently (4), a
  rank that stopped answering (5, :mod:`megatron_lol.training.heartbeat`) or
  saved for a requeue (85); the record does.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from megatron_lol.errors import CliError

STATUS_DIR_ENV = "MEGATRON_LOL_STATUS_DIR"
STALL_EXIT = 5  # a rank stopped answering or died (megatron_lol.training.heartbeat)


def _positive_int(value: Optional[str]) -> Optional[int]:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def _processes_per_task(env: Mapping[str, str]) -> int:
    """Processes sharing this process's Slurm task: torchrun's workers of a node share one task."""
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1
    return 1


def resolve_threads(explicit: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """``(threads, where the number came from)`` for ``torch.set_num_threads``.

    In order: ``--threads``; ``OMP_NUM_THREADS`` (an explicit choice of the user
    or launcher); ``SLURM_CPUS_PER_TASK`` divided by the processes of this task
    (torchrun: its local workers; srun: one); ``SLURM_CPUS_ON_NODE`` divided by
    the processes of this node; the CPUs this process may run on
    (``sched_getaffinity``) divided by the processes of this node.
    """
    env = os.environ if env is None else env
    if explicit is not None:
        if explicit < 1:
            raise CliError(f"--threads: must be >= 1 (got {explicit})")
        return explicit, "--threads"
    omp = _positive_int(env.get("OMP_NUM_THREADS"))
    if omp:
        return omp, "OMP_NUM_THREADS"
    local = _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1
    per_task = _positive_int(env.get("SLURM_CPUS_PER_TASK"))
    if per_task:
        procs = _processes_per_task(env)
        return max(1, per_task // procs), f"SLURM_CPUS_PER_TASK={per_task} / {procs} process(es) per task"
    on_node = _positive_int(env.get("SLURM_CPUS_ON_NODE"))
    if on_node:
        return max(1, on_node // local), f"SLURM_CPUS_ON_NODE={on_node} / {local} process(es) per node"
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // local), f"{cpus} usable CPU(s) / {local} process(es) per node"


def apply_threads(explicit: Optional[int] = None) -> tuple[int, str]:
    """Set torch's intra-op threads (:func:`resolve_threads`); returns what was set and why."""
    import torch

    n, why = resolve_threads(explicit)
    torch.set_num_threads(n)
    return n, why


def record_exit(code: int, message: str, status_dir: Optional[str] = None) -> Optional[str]:
    """Write ``CODE MESSAGE`` (one line) to ``{status_dir}/rank-{RANK}.status``; nothing for status 0
    or without a status directory. Returns the path written."""
    status_dir = os.environ.get(STATUS_DIR_ENV) if status_dir is None else status_dir
    if not status_dir or code == 0:
        return None
    line = " ".join(str(message).split()) or f"exit status {code}"
    rank = os.environ.get("RANK", "0")
    path = os.path.join(status_dir, f"rank-{rank}.status")
    try:
        os.makedirs(status_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(f"{int(code)} {line}\n")
        os.replace(path + ".tmp", path)
    except OSError:  # the record is a courtesy: never turn it into a second failure
        return None
    return path
