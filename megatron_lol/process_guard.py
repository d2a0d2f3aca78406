"""Helper processes that die with the process that started them.

``kill -9`` (or the OOM killer) gives a process no chance to stop its children:
they are reparented to init and live on -- a checkpoint writer's result-queue
manager waits forever for connections, a tokenizer worker for tasks. Each such
child calls :func:`die_with_parent` right after it starts: on Linux the kernel
then sends it SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``);
elsewhere a daemon thread polls the parent's pid once a second.

:func:`guard_forked_children` does the same for every child that a process
forks from its main thread from then on (``os.register_at_fork``): megatron-core
forks its checkpoint writers itself, so this is the one place to reach them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
_libc = None
_fork_guard = {"installed": False, "parent": None, "from_main_thread": False}


def _prctl_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where it is not available."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def die_with_parent(parent_pid: int) -> None:
    """Make the calling process exit when ``parent_pid`` (its parent) is gone.

    Called in the child. The parent may already have died between the fork and
    this call: then the child has been reparented and exits at once.
    """
    if _prctl_death_signal(signal.SIGKILL):
        if os.getppid() != parent_pid:
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="die-with-parent").start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _before_fork() -> None:
    _fork_guard["parent"] = os.getpid()
    _fork_guard["from_main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # the death signal follows the forking *thread*: only the main thread lives as long as
    # the process, so children forked from other threads are left alone
    if _fork_guard["from_main_thread"] and _fork_guard["parent"] is not None:
        die_with_parent(_fork_guard["parent"])


def guard_forked_children() -> None:
    """From now on, every child forked from this process's main thread dies with it (idempotent)."""
    if _fork_guard["installed"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _fork_guard["installed"] = True
