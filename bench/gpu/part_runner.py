"""One part of the GPU proof (bench/gpu/run_all.py) as a process group with a time budget. Standard library only.

A part is a command (pytest, ``megatron-lol profile``, the GPTModel baseline) that may start processes of its
own: the GPU tests start tests/gpu_steps.py, torchrun starts its ranks. Killing only the part's own process
when its time is up would leave those holding the GPU through the parts after it, so each part starts a
session of its own (``start_new_session``: a new process group, which its children inherit) and the whole
group is killed: SIGTERM, then SIGKILL for whatever is still alive after a grace period. run_all.py does the
same to the part in flight when it receives SIGTERM itself (run_all.sh's ``timeout``), then writes its report.

The report is written atomically (a temporary file, then ``os.replace``), so a kill at any moment leaves the
previous complete report, never half of one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

#: seconds a part's process group has to exit after SIGTERM before SIGKILL (and again after SIGKILL)
GRACE_S = 5.0


class Terminated(Exception):
    """SIGTERM arrived (run_all.sh's ``timeout``): raised in the main thread by :func:`install_sigterm`'s handler.
    :func:`run_part` sets ``killed`` (the process group it killed) on the way out."""

    killed: dict = {}


class _Spawn:
    """Whether :func:`run_part` is between starting a part and holding its handle: a SIGTERM then is deferred
    (raising inside ``Popen`` would lose the handle of a process that was already started)."""

    active = False
    pending = False


def install_sigterm() -> None:
    """Turn the first SIGTERM into :class:`Terminated`; later ones are ignored (GNU ``timeout`` signals the
    command and then its whole process group, so run_all.py receives it twice) so they cannot interrupt the
    clean-up the first one started."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _Spawn.active:
            _Spawn.pending = True
            return
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def group_members(pgid: int) -> list:
    """The live processes of process group ``pgid`` (zombies, already dead, excluded): /proc on Linux,
    a signal-0 probe of the group elsewhere."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, leader: subprocess.Popen | None = None, grace_s: float = GRACE_S) -> dict:
    """SIGTERM to process group ``pgid``, SIGKILL to what is left after ``grace_s``.

    Returns ``{"signals": [names sent], "left": [pids still alive after both]}`` (``left`` is non-empty only
    for a process that ignores even SIGKILL, e.g. one stuck in the GPU driver). ``leader`` is reaped on the way
    so that it does not linger as a zombie.
    """
    sent = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        sent.append(sig.name)
        end = time.monotonic() + grace_s
        while True:
            if leader is not None:
                leader.poll()
            if not group_members(pgid):
                return {"signals": sent, "left": []}
            if time.monotonic() > end:
                break
            time.sleep(0.05)
    if leader is not None:
        leader.poll()
    return {"signals": sent, "left": group_members(pgid)}


def run_part(cmd: list, log: Path, timeout_s: float, cwd=None, env=None, grace_s: float = GRACE_S) -> dict:
    """Run ``cmd`` (stdout and stderr into ``log``) in a session of its own; past ``timeout_s`` kill its group.

    Returns ``{"exit_code", "seconds", "timed_out"}`` and, for a killed part, ``"killed_group"`` (its process
    group id) with what :func:`kill_group` returned. Whatever the part left in its group after exiting on its own
    is killed as well. On :class:`Terminated` (or any exception) the group is killed before it propagates.
    """
    t0 = time.monotonic()
    proc = None
    try:
        _Spawn.active = True
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        _Spawn.active = False
        if _Spawn.pending:
            raise Terminated()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
    except BaseException as e:
        _Spawn.active = False
        if proc is not None:
            killed = kill_group(proc.pid, proc, grace_s)
            if isinstance(e, Terminated):
                e.killed = dict(killed_group=proc.pid, **killed)
        raise
    result = {"exit_code": code, "seconds": round(time.monotonic() - t0, 1), "timed_out": code is None}
    killed = kill_group(proc.pid, proc, grace_s)
    if code is None:
        result.update(killed_group=proc.pid, **killed)
    elif killed["signals"]:  # the part exited and left processes behind in its group
        result["left_behind_killed"] = killed
    return result


def write_json(path: Path, obj) -> None:
    """Write ``obj`` to ``path`` atomically: a reader (or a kill) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
