"""Tokenizer worker processes of ``preprocess`` that fail loudly instead of hanging.

``multiprocessing.Pool`` replaces a worker the OOM killer took and leaves the
task it held unfinished, so the main process waits forever. Here the workers
run under ``concurrent.futures.ProcessPoolExecutor``, whose futures fail
(``BrokenProcessPool``) when a worker dies; :func:`submit` and :func:`result`
turn that into :class:`WorkerDiedError` naming the signal and the input file.
SIGTERM in the main process raises :class:`Terminated`, so the run unwinds
and removes its temporary files.
"""

from __future__ import annotations

import signal


class WorkerDiedError(RuntimeError):
    """A tokenizer worker process died (killed, out of memory) in the middle of a task."""


class Terminated(BaseException):
    """SIGTERM arrived: unwind so that partial outputs are removed (a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it)."""


def raise_on_sigterm():
    """Make SIGTERM (Slurm's scancel, a timeout) raise :class:`Terminated` in the main thread;
    returns the previous handler (None when called outside the main thread: nothing changed).

    A forked tokenizer worker inherits the handler until its initializer resets it. When the pool
    breaks, the executor SIGTERMs the workers, some of them still in that window (a worker killed as
    the pool starts): raising there would print a traceback from the worker under the run's one-line
    error. So in any process but the one that installed it, the handler ends the process as
    SIGTERM's default action does.
    """
    import os
    import threading

    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:  # a forked child before its own handlers: die of the signal, quietly
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated("stopped by SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def worker_died(procs: dict, path: str) -> WorkerDiedError:
    """The error for a broken pool: which signal or status ended a worker (the OOM killer's SIGKILL)."""
    for p in procs.values():
        p.join(timeout=5)
    codes = [p.exitcode for p in procs.values() if p.exitcode]
    codes.sort(key=lambda c: c == -signal.SIGTERM)  # the executor SIGTERMs the survivors itself
    how = next(
        (f"killed by {signal.Signals(-c).name}" for c in codes if c < 0 and -c in signal.valid_signals()),
        f"exit status {codes[0]}" if codes else "died",
    )
    return WorkerDiedError(
        f"a tokenizer worker process {how} while tokenizing {path} "
        f"(out of memory? try fewer --workers or a smaller --max-inflight)"
    )


def process_table(pool) -> dict:
    """The executor's own pid -> Process map, the live object rather than a copy.

    Workers start on demand inside ``submit``; a copy taken after each submit misses a
    worker killed before the copy, and once the pool is broken the executor drops its
    reference (``_processes = None``) and SIGTERMs the survivors, so the error would name
    the executor's SIGTERM instead of the SIGKILL that broke the pool. The dict object
    itself outlives that and only loses workers that exited normally.
    """
    return pool._processes


def submit(pool, procs: dict, fn, task: tuple, paths: list):
    from concurrent.futures.process import BrokenProcessPool

    try:
        return pool.submit(fn, task)
    except BrokenProcessPool:
        raise worker_died(procs, paths[task[1]]) from None


def result(procs: dict, fut, meta: tuple, paths: list) -> dict:
    from concurrent.futures.process import BrokenProcessPool

    try:
        return fut.result()
    except BrokenProcessPool:
        raise worker_died(procs, paths[meta[1]]) from None


def stop_workers(pool, procs: dict, timeout: float = 10.0) -> None:
    """Cancel what is queued and kill the workers now (a failed run does not wait for them), then
    wait for the executor's management thread to finish.

    Why the wait: ``shutdown(wait=False)`` leaves that thread running while it takes the broken
    pool apart. At interpreter exit ``concurrent.futures.process._python_exit`` calls
    ``_ThreadWakeup.wakeup()`` for every such thread; ``wakeup`` checks ``_closed`` and then writes
    to the pipe that the finishing thread closes, so a thread still running at exit can make the
    run print ``OSError: [Errno 9] Bad file descriptor`` under its one-line error (CPython 3.11
    ``Lib/concurrent/futures/process.py``, ``_ThreadWakeup`` and ``_python_exit``). Once the thread
    has ended, its wakeup is closed and ``_python_exit`` writes nothing.
    """
    manager = pool._executor_manager_thread  # shutdown() drops the reference
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs.values():
        if p.is_alive():
            p.kill()
    for p in procs.values():
        p.join(timeout=timeout)
    if manager is not None:
        manager.join(timeout=timeout)
