"""The results queue of megatron's checkpoint-writer processes, started by this package.

This module imports nothing heavy at module level on purpose: the Manager runs
in a *spawned* interpreter, which imports the module of its initializer before
it serves. Were that :mod:`.checkpointer` (torch, torch.distributed.checkpoint,
megatron-core), each training process would wait about 2 s of CPU at start-up
for a server that only passes results along.
"""

from __future__ import annotations

import os

_WRITER_MANAGER = None


def _writer_manager_init(parent_pid: int) -> None:
    from megatron_lol.process_guard import die_with_parent
    from megatron_lol.training import signals

    signals.ignore_preemption_signals()
    die_with_parent(parent_pid)


def prepare_writer_processes() -> None:
    """Start megatron's checkpoint-writer results queue ourselves: signal-proof, and dying with us.

    ``filesystem_async`` keeps one ``multiprocessing`` Manager (spawn context)
    per process for the results of its writer processes. Slurm signals every
    process of a job step, so that Manager would die of the very SIGUSR1/SIGTERM
    whose save needs it ("Connection refused" in the middle of the save). Ours
    ignores those signals (the training process still receives and handles them)
    and is killed by the kernel when the training process dies, like the writer
    processes megatron forks (:mod:`megatron_lol.process_guard`): a ``kill -9``
    of the trainer leaves no orphans.
    """
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_lol.process_guard import guard_forked_children

    guard_forked_children()
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_writer_manager_init, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGER = manager
