"""One writer per save directory.

Two runs on the same ``--save`` would delete each other's saves in progress and
interleave ``metrics.jsonl``. Rank 0 of a run therefore holds an exclusive
``flock`` on ``{save}/.writer.lock`` for its whole life; the kernel releases it
when the process exits, however it exits (``kill -9`` included), so a lock is
never left stale. The file records the holder's host, pid and start time for
the error message of a second run.

On a file system without ``flock`` the file alone decides: a holder on this
host whose pid is gone is stale and taken over; any other holder is refused
(the message says which file to remove once that run is known to be gone).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Optional

from megatron_lol.process_guard import pid_alive

LOCK_FILE = ".writer.lock"
# locks this process holds, by real path: a run that ended with an exception (in a notebook, a
# test) did not release its lock, and the next run of the same process takes it over
_held: dict = {}


def _describe(info: dict) -> str:
    if not info:
        return "another process"
    return f"pid {info.get('pid')} on host {info.get('host')} (since {info.get('started')})"


class SaveDirLock:
    """Exclusive ownership of a save directory by one training run."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, LOCK_FILE)
        self.fd: Optional[int] = None
        self.created: list = []  # what acquire() created (directories, then the lock file), for discard()

    def _read(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 4096).decode("utf-8", "replace") or "{}")
        except (OSError, ValueError):
            return {}

    def _write(self, fd: int) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(info) + "\n").encode())

    def acquire(self) -> Optional[str]:
        """Take the lock; returns None, or why not (one line)."""
        missing, parent = [], os.path.abspath(self.root)
        while not os.path.exists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(self.root, exist_ok=True)
        self.created = missing + ([] if os.path.exists(self.path) else [self.path])
        previous = _held.pop(os.path.realpath(self.path), None)
        if previous is not None:
            previous.release()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _describe(self._read(fd))
            os.close(fd)
            return (
                f"{self.root} is in use by another training run ({holder}; lock {self.path}): "
                f"two runs must not share one --save directory"
            )
        except (ImportError, OSError) as err:
            if isinstance(err, OSError) and err.errno not in (
                errno.ENOLCK,
                errno.EOPNOTSUPP,
                errno.ENOSYS,
                errno.EINVAL,
            ):
                os.close(fd)
                return f"{self.path}: cannot lock the save directory: {err.strerror or err}"
            problem = self._check_pid_file(fd)
            if problem is not None:
                os.close(fd)
                return problem
        self._write(fd)
        self.fd = fd
        _held[os.path.realpath(self.path)] = self
        return None

    def _check_pid_file(self, fd: int) -> Optional[str]:
        info = self._read(fd)
        if not info or info.get("released"):
            return None
        if info.get("host") == socket.gethostname():
            pid = int(info.get("pid", 0) or 0)
            if pid and pid != os.getpid() and pid_alive(pid):
                return (
                    f"{self.root} is in use by another training run ({_describe(info)}; lock "
                    f"{self.path}): two runs must not share one --save directory"
                )
            return None  # stale: its process is gone
        return (
            f"{self.root} may be in use by {_describe(info)} (this file system has no flock): "
            f"remove {self.path} once that run is gone"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        _held.pop(os.path.realpath(self.path), None)
        try:
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
            os.write(self.fd, b'{"released": true}\n')
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def discard(self) -> None:
        """Release, and remove what :meth:`acquire` created (the lock file, the directories up to the
        first that existed) as long as nothing else was written there: a run that stopped before its
        first step leaves the file system as it found it."""
        self.release()
        created, self.created = self.created, []
        if created and created[-1] == self.path:
            try:
                os.remove(self.path)
            except OSError:
                return
            created = created[:-1]
        for directory in created:  # deepest first
            try:
                os.rmdir(directory)
            except OSError:  # not empty: something else is there now
                return
