"""The results queue of megatron's checkpoint-writer processes, started by this package.

megatron-core's ``filesystem_async`` hands the write results of every save
(``torch.distributed.checkpoint`` objects, or the writer's exception) through one
``multiprocessing`` Manager queue per process. The Manager is a *spawned*
interpreter, and two things would make it import torch (about 2 s of CPU, paid
by every training process that saves):

* a spawned process imports the module of its initializer before it serves:
  this module imports nothing heavy at module level;
* a Manager queue unpickles each item in the server: the queue here carries
  items as pickled bytes (:class:`PickledQueueProxy`), pickled and unpickled
  by the training process and its forked writers, which have torch anyway.
"""

from __future__ import annotations

import os
import pickle
import queue
from multiprocessing.managers import BaseManager, BaseProxy

_WRITER_MANAGER = None


class PickledQueueProxy(BaseProxy):
    """A proxy of a ``queue.Queue`` in a Manager whose items cross to the server as pickled bytes.

    It offers what ``filesystem_async`` calls (``put``, ``get_nowait``) and ``get``;
    ``queue.Empty`` from the server is raised here as it is.
    """

    _exposed_ = ("put", "get", "get_nowait", "qsize")

    def put(self, item, block: bool = True, timeout=None) -> None:
        self._callmethod("put", (pickle.dumps(item), block, timeout))

    def get(self, block: bool = True, timeout=None):
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self):
        return pickle.loads(self._callmethod("get_nowait"))

    def qsize(self) -> int:
        return self._callmethod("qsize")


class WriterResultsManager(BaseManager):
    """A Manager that serves only the results queue."""


WriterResultsManager.register("Queue", queue.Queue, proxytype=PickledQueueProxy)


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

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_lol.process_guard import guard_forked_children

    guard_forked_children()
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = WriterResultsManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_writer_manager_init, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGER = manager
