"""A rank that stops answering ends the job in bounded time, named in one line on every other rank.

A rank stopped by ``SIGSTOP``, a hung NFS mount or a wedged GPU leaves every
other rank inside a collective; torch's collective timeout ends them only
after ``--distributed-timeout-minutes`` and says nothing about who stopped.
Here every rank runs a daemon thread that, every ``heartbeat_interval``
seconds, increments its own counter in the rendezvous store
(``torch.distributed``'s TCPStore, which every launcher already provides) and
reads the counter of one neighbour (rank ``r - 1``, so every rank is watched
by exactly one other and the store sees O(world) operations per period, not
O(world^2)). The thread runs while the main thread waits in a collective: the
collectives and the kernels release the GIL.

When the neighbour's counter has not moved for ``heartbeat_timeout`` seconds,
the watcher writes one line naming the rank, host and pid (each rank registers
them at start) under one shared key; every rank's thread reads that key each
period, prints the same line, counts itself in the store as having read it,
and ends its process with status :data:`STALL_EXIT` once every other rank has
(so that none dies first of another's exit) -- ``os._exit``, because the main
thread is blocked inside a collective that Python cannot interrupt. The store itself not answering for
``heartbeat_timeout`` seconds (its host stopped: rank 0 when ranks are
launched one process each, as ``srun`` does) is reported the same way.

Counters instead of timestamps: a watcher measures "not moved" on its own
monotonic clock, so clock skew between hosts cannot fake a stall. A rank that
finishes adds :data:`DONE` to its counter, so its watcher stops watching
instead of reporting the finished rank. Keys carry torchrun's restart count,
so an earlier attempt's values never count for a relaunch.

Megatron-LM's straggler detector and torchtitan's flight recorder are the
models; this keeps only what is needed to name the culprit without a second
daemon per node.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time
from typing import Optional

import torch

from megatron_lol.training.runtime import STALL_EXIT, record_exit  # noqa: F401 - STALL_EXIT: defined there (no torch)

DONE = 1 << 40  # added to a rank's counter when it finishes normally


def _prefix() -> str:
    return f"megatron_lol/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class Heartbeat:
    """One rank's heartbeat: :meth:`start` on every rank together (it ends in a barrier), :meth:`stop` when
    the rank finishes. ``on_stall(line)`` runs in the thread when a stall is found; by default the thread
    prints the line, records it for the Slurm scripts, waits until every other rank read it (:meth:`_await_others`)
    and ends the process with :data:`STALL_EXIT`."""

    def __init__(self, interval: float, timeout: float, on_stall=None):
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.on_stall = on_stall  # None: print the line, record it, wait for the others to read it, exit
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        self.neighbour = (self.rank - 1) % self.world
        self.store = None
        self.infos: dict = {}
        self.line: Optional[str] = None  # the stall found, if any
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._judge: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._done = False
        self._last_contact = time.monotonic()

    # ------------------------------------------------------------- setup
    def _connect(self):
        """A client of the rendezvous store of its own, with a short timeout: a store op on a stopped
        store host fails after about one period instead of the process group's minutes."""
        return torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=max(1.0, min(self.interval, self.timeout / 2))),
            wait_for_workers=False,
        )

    def start(self) -> "Heartbeat":
        """Register this rank (host, pid, counter), wait for every rank to have done so, start the thread."""
        p = _prefix()
        self.store = self._connect()
        self.store.set(f"{p}info/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self.store.add(f"{p}beat/{self.rank}", 1)
        torch.distributed.barrier()
        for r in {self.neighbour, 0}:  # 0: the store's host when ranks are launched one process each
            host, _, pid = self.store.get(f"{p}info/{r}").decode().partition(" ")
            self.infos[r] = (host, pid)
        self._last_contact = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="megatron-lol-heartbeat", daemon=True)
        self._judge = threading.Thread(target=self._judge_store, name="megatron-lol-heartbeat-store", daemon=True)
        self._thread.start()
        self._judge.start()
        atexit.register(self.stop, done=False)
        return self

    def stop(self, done: bool = True) -> None:
        """This rank finished (``done``: its watcher stops watching it); the threads end. Also run at
        exit without ``done``: a rank that exits on an error of its own is then named by its watcher,
        and no thread is left inside the store client while the interpreter shuts down."""
        if self._thread is None:
            return
        self._done = done
        self._stop.set()
        self._judge.join(timeout=self.interval + 5)
        # the thread tells the store on its way out; a store that does not answer must not hold this rank
        self._thread.join(timeout=self.interval + 5)
        self._thread = self._judge = None

    # ------------------------------------------------------------ thread
    def describe(self, rank: int) -> str:
        host, pid = self.infos.get(rank, ("?", "?"))
        return f"rank {rank} (host {host}, pid {pid})"

    def _run(self) -> None:
        p = _prefix()
        mine, theirs, stalled = f"{p}beat/{self.rank}", f"{p}beat/{self.neighbour}", f"{p}stalled"
        last_value, last_change = None, time.monotonic()
        watching = self.neighbour != self.rank
        while not self._stop.wait(self.interval):
            try:
                self.store.add(mine, 1)
                if self.store.check([stalled]):
                    return self._found(self.store.get(stalled).decode())
                value = self.store.add(theirs, 0) if watching else None
            except Exception:  # noqa: BLE001 - a store that does not answer is judged by _judge_store
                continue
            now = self._last_contact = time.monotonic()
            if not watching:
                continue
            if value >= DONE:
                watching = False  # finished normally
            elif value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self.timeout:
                line = (
                    f"{self.describe(self.neighbour)} stopped answering: no heartbeat for "
                    f"{now - last_change:.0f} s (heartbeat timeout {self.timeout:g} s)"
                )
                try:
                    self.store.set(stalled, line)  # every other rank reads it at its next period
                except Exception:  # noqa: BLE001 - this rank stops anyway
                    pass
                return self._found(line)
        if not self._done:
            return
        try:
            self.store.add(mine, DONE)  # finished: the watcher stops watching this rank
        except Exception:  # noqa: BLE001 - the store's host may have finished first: nothing to tell
            pass

    def _judge_store(self) -> None:
        """The store's host stopped: a TCPStore ``add`` or ``check`` then blocks for ever (only ``get``
        honours the client's timeout), so a second thread judges the first one's last answered round."""
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._last_contact
            if silent > self.timeout:
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                host = (
                    ""
                    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                    else f", served by {self.describe(0)},"
                )
                return self._found(
                    f"the rendezvous store at {where}{host} stopped answering: no reply for "
                    f"{silent:.0f} s (heartbeat timeout {self.timeout:g} s)",
                    store_answers=False,
                )

    def _found(self, line: str, store_answers: bool = True) -> None:
        with self._lock:  # the first finding wins; the other thread's would be the same stall
            if self.line is not None:
                return
            self.line = line
        message = f"megatron-lol train: error: {line}; rank {self.rank} stops (status {STALL_EXIT})"
        if self.on_stall is not None:
            return self.on_stall(message)
        print(message, file=sys.stderr, flush=True)
        record_exit(STALL_EXIT, message)
        if store_answers:
            self._await_others()
        sys.stdout.flush()
        os._exit(STALL_EXIT)

    def _await_others(self) -> None:
        """Count this rank as having read the verdict, and wait (at most ``min(timeout, 10 s)``) until every
        rank but the stalled one has: a rank that left earlier would close its connections under ranks still
        waiting in a collective with it, and they would die of that, with a traceback instead of the line;
        rank 0 (the store's host under srun) leaving would take the verdict with it."""
        key = f"{_prefix()}read"
        deadline = time.monotonic() + max(2 * self.interval, min(self.timeout, 10.0))
        try:
            self.store.add(key, 1)
            while time.monotonic() < deadline and self.store.add(key, 0) < self.world - 1:
                time.sleep(min(self.interval, 0.1))
        except Exception:  # noqa: BLE001 - the store's host left: nobody is left to wait for
            pass

    def lost_ranks(self) -> Optional[str]:
        """After a collective failed because a peer closed its connection (a rank died: gloo reports it at once,
        long before the heartbeat timeout): which ranks' counters stand still over 2.5 periods, named in one
        line; None when every rank still beats (then the failure was something else). One read of every
        rank's counter, twice: this runs once, at the end."""
        p = _prefix()
        try:
            store = self._connect()  # the thread's client is the thread's
            keys = [f"{p}beat/{r}" for r in range(self.world)]
            before = [store.add(k, 0) for k in keys]
            time.sleep(2.5 * self.interval)
            after = [store.add(k, 0) for k in keys]
            lost = [r for r in range(self.world) if r != self.rank and after[r] == before[r] and after[r] < DONE]
            for r in lost:
                if r not in self.infos:
                    host, _, pid = store.get(f"{p}info/{r}").decode().partition(" ")
                    self.infos[r] = (host, pid)
        except Exception:  # noqa: BLE001 - the store's host is the one that died
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return None
            return f"{self.describe(0)}, which serves the rendezvous store, stopped answering"
        if not lost:
            return None
        names = ", ".join(self.describe(r) for r in lost)
        return f"{names} stopped answering: {'its' if len(lost) == 1 else 'their'} heartbeat stopped"


def start_heartbeat(interval: float, timeout: float) -> Optional[Heartbeat]:
    """The heartbeat of this rank (every rank calls this together), or None: one process, or ``interval`` 0."""
    if (
        not interval
        or not torch.distributed.is_initialized()
        or torch.distributed.get_world_size() < 2
        or "MASTER_PORT" not in os.environ
    ):
        return None
    return Heartbeat(interval, timeout).start()
