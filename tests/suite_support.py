"""How the test suite shares a small machine: CPU slots, process-launch accounting, file order.

``tools/run_tests.sh`` runs the suite on ``pytest-xdist`` workers (one per core), a whole test
file per worker at a time (``--dist loadfile``: module fixtures such as a shared training run
are built once). Three things keep that honest on a 2-core machine:

* **CPU slots.** A test takes one of the machine's cores for its whole run; a test marked
  ``multiprocess`` (it runs two or more busy processes at once: gloo ranks, ``torchrun``, a
  Slurm job) takes every core. Slots are file locks shared by the workers, taken around the
  test's setup, call and teardown (before any timeout's clock starts), behind a turnstile so
  a test waiting for the whole machine is not overtaken by single-core tests. Nothing runs oversubscribed, so the
  timing and heartbeat bounds of the fault tests see the machine they would see alone.
* **Launch accounting.** Every ``subprocess.Popen`` and ``multiprocessing`` start of a test is
  counted per file (the table at the end of the run). A test that starts a second process while
  its first still runs, or a ``torchrun`` with more than one process per node, or a Slurm
  command, without holding the whole machine takes it there and then (giving its one slot back
  first, so two such tests cannot wait for each other) and is listed at the end of the run: the
  ``multiprocess`` marker saves it that wait.
* **Longest files first.** ``tests/durations.json`` holds each file's test time from a full
  run (``tools/run_tests.sh --update-durations`` rewrites it); collection puts the files in
  descending order of it, and xdist hands them out in that order (``--no-loadscope-reorder``),
  so the last file to finish is a short one.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import multiprocessing.process
import os
import subprocess
import tempfile
import time
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
MARKER = "multiprocess"
#: a test whose processes mostly wait (a rank stopped on purpose, a Slurm job paused before a commit):
#: it holds one slot though it starts several processes (measured: the machine under half busy while
#: such a test held all of it; the run's "whole-machine tests that left cores idle" table)
LIGHT_MARKER = "mostly_waiting"


# ------------------------------------------------------------------ CPU slots
def slot_count() -> int:
    return max(1, int(os.environ.get("MEGATRON_LOL_TEST_SLOTS", os.cpu_count() or 1)))


#: the xdist run this process is a worker of (set by conftest's pytest_configure from the worker's
#: own ``workerinput``): a pytest that a test starts inherits the environment but is no worker,
#: so it takes no slot (its parent test holds one for it)
RUN_ID: str | None = None


def _lock_dir() -> Path | None:
    """The run's lock folder, shared by its xdist workers (None outside xdist: nothing to share)."""
    if not RUN_ID:
        return None
    path = Path(tempfile.gettempdir()) / f"megatron-lol-test-slots-{RUN_ID}"
    path.mkdir(exist_ok=True)
    return path


class CpuSlots:
    """The CPU slots a test holds: one, or all of them (:meth:`take_all` also upgrades from one)."""

    def __init__(self):
        self.folder = _lock_dir()
        self.total = slot_count()
        self.held: list = []
        self.light = False  # set for LIGHT_MARKER tests: LaunchWatch leaves them on one slot
        self.stalled = 0.0  # seconds a whole-machine wait held some cores idle (see take_all)

    @property
    def whole_machine(self) -> bool:
        return self.folder is None or len(self.held) == self.total

    def _turnstile(self):
        f = open(self.folder / "turnstile", "a+")
        fcntl.flock(f, fcntl.LOCK_EX)  # one acquirer at a time: a whole-machine wait is not overtaken
        return f

    def take_one(self) -> None:
        if self.folder is None:
            return
        turnstile = self._turnstile()
        try:
            while not self.held:
                for i in range(self.total):
                    f = open(self.folder / f"slot{i}", "a+")
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        f.close()
                        continue
                    self.held.append(f)
                    break
                else:
                    time.sleep(0.05)
        finally:
            turnstile.close()

    def take_all(self) -> None:
        """Every slot, in a fixed order (no two tests can hold each other's): a test that holds one
        gives it back first, so two tests upgrading at once cannot wait for each other."""
        if self.whole_machine:
            return
        self.release()
        turnstile = self._turnstile()
        try:
            for i in range(self.total):
                f = open(self.folder / f"slot{i}", "a+")
                asked = time.monotonic()
                fcntl.flock(f, fcntl.LOCK_EX)
                if i:  # holding slot 0 while the rest are busy: the cores this test holds do nothing
                    self.stalled += time.monotonic() - asked
                self.held.append(f)
        finally:
            turnstile.close()

    def release(self) -> None:
        for f in self.held:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
        self.held = []


# ------------------------------------------------------------------ launch accounting
class LaunchWatch:
    """Counts the processes each test starts; a test that starts a second busy process while the
    first still runs (or a multi-process ``torchrun`` / Slurm launch) without holding the whole
    machine takes it there and then (and is listed at the end of the run, to be marked)."""

    def __init__(self):
        self.current: str | None = None
        self.slots: CpuSlots | None = None
        self.per_file = collections.Counter()
        self.upgraded: list = []
        self.live: list = []

    def begin(self, nodeid: str, slots: CpuSlots) -> None:
        self.current, self.slots, self.live = nodeid, slots, []

    def end(self) -> None:
        self.current, self.slots, self.live = None, None, []

    def _note(self, handle, many: bool) -> None:
        if self.current is None:
            return
        self.per_file[self.current.split("::")[0]] += 1
        alive = [h for h in self.live if _alive(h)]
        if (many or alive) and self.slots is not None and not self.slots.whole_machine and not self.slots.light:
            self.upgraded.append(self.current)
            self.slots.take_all()
        self.live = alive + [handle]

    def popen(self, popen, args) -> None:
        argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        many = _torchrun_procs(argv) > 1 or (bool(argv) and Path(argv[0]).name in ("srun", "sbatch", "salloc"))
        self._note(popen, many)

    def process(self, proc) -> None:
        self._note(proc, False)


def _alive(handle) -> bool:
    if isinstance(handle, subprocess.Popen):
        return handle.poll() is None
    try:
        return handle.is_alive()
    except (AssertionError, ValueError):  # not started by this process any more, or closed
        return False


def _torchrun_procs(argv: list) -> int:
    """Processes per node of a ``torchrun`` / ``python -m torch.distributed.run`` command (0: not one)."""
    if not any(a.endswith("torchrun") or a == "torch.distributed.run" for a in argv):
        return 0
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if a == flag and i + 1 < len(argv):
                return int(argv[i + 1]) if argv[i + 1].isdigit() else 2
            if a.startswith(flag + "="):
                value = a.split("=", 1)[1]
                return int(value) if value.isdigit() else 2
    return 1


WATCH = LaunchWatch()
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _watched_popen_init(self, args, *a, **kw):
    _popen_init(self, args, *a, **kw)
    WATCH.popen(self, args)


def _watched_start(self):
    _process_start(self)
    WATCH.process(self)


def install_launch_watch() -> None:
    subprocess.Popen.__init__ = _watched_popen_init
    multiprocessing.process.BaseProcess.start = _watched_start


# ------------------------------------------------------------------ idle cores
def cpu_jiffies() -> tuple:
    """(busy, total) clock ticks of every core since boot (``/proc/stat``; (0, 0) where it is absent).
    Read around a whole-machine test, whose run holds every slot, they say how much of the machine it
    used: an idle core there is time the other worker could have run single-core tests."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def idle_table(idle: dict, limit: int = 12) -> list:
    """The whole-machine tests that left the most core-seconds idle: ``idle`` maps a test to
    (seconds held, share of the machine busy)."""
    rows = sorted(idle.items(), key=lambda kv: -kv[1][0] * (1 - kv[1][1]))[:limit]
    lines = [f"{'held s':>7} {'busy':>5} {'idle core-s':>11}  test"]
    cores = slot_count()
    for nodeid, (held, busy) in rows:
        lines.append(f"{held:7.1f} {busy:5.0%} {held * (1 - busy) * cores:11.1f}  {nodeid}")
    return lines


# ------------------------------------------------------------------ file order and report
def load_durations() -> dict:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def order_by_duration(items: list) -> None:
    """Sort ``items`` in place: files by descending recorded time (unknown files first), tests
    within a file in their collected order."""
    durations = load_durations()
    first_index = {}
    for i, item in enumerate(items):
        first_index.setdefault(item.nodeid.split("::")[0], i)

    def key(item):
        f = item.nodeid.split("::")[0]
        return (-durations.get(f, float("inf")), first_index[f])

    items.sort(key=key)  # stable: a file's tests keep their order


def file_table(times: dict, tests: dict, launches: dict, whole: dict, waited: dict) -> list:
    """Per file: its test time, the part of it that held every core (``whole``: the rest of the
    machine idle or waiting for it), the time its tests waited for their CPU slots, tests, launches.
    The session's wall time is about the whole-machine total plus half the rest (two workers)."""
    lines = [f"{'seconds':>8} {'whole':>7} {'waited':>7} {'tests':>6} {'launches':>8}  file"]
    for f, t in sorted(times.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"{t:8.1f} {whole.get(f, 0):7.1f} {waited.get(f, 0):7.1f} {tests[f]:6d} {launches.get(f, 0):8d}  {f}"
        )
    lines.append(
        f"{sum(times.values()):8.1f} {sum(whole.values()):7.1f} {sum(waited.values()):7.1f} "
        f"{sum(tests.values()):6d} {sum(launches.values()):8d}  total"
    )
    return lines


# ------------------------------------------------------------------ timing bounds
def load_factor() -> float:
    """Runnable processes per core over the last minute, at least 1: how much longer than on an idle
    machine a process may wait for a core right now (the kernel's own measure, taken in the same run)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def scheduling_slack(seconds: float) -> float:
    """``seconds`` of slack for noticing and reporting (measured idle), grown with the machine's load."""
    return seconds * load_factor()


@contextlib.contextmanager
def machine_lock(name: str, slots: "CpuSlots | None" = None):
    """Hold an exclusive lock named ``name`` for this machine: tests on different workers that write
    the same path outside their tmp_path (the repository's data/quickstart), or two suite runs side by
    side that use the one local Slurm cluster, take turns.

    While another holder has it, the waiting test gives back its CPU slots (``slots``, default the
    running test's), so the rest of its run goes on meanwhile, and takes them again once it has the
    lock: a whole-machine test waiting here would otherwise stop its whole run."""
    path = Path(tempfile.gettempdir()) / f"megatron-lol-test-{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            slots = slots if slots is not None else WATCH.slots
            held = len(slots.held) if slots is not None else 0
            if held:
                slots.release()
            fcntl.flock(f, fcntl.LOCK_EX)
            if held and held == slots.total:
                slots.take_all()
            elif held:
                slots.take_one()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
