"""The suite's own machinery (tests/suite_support.py): a machine lock waits without the CPU slots."""

from __future__ import annotations

import fcntl
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import suite_support


@pytest.mark.timeout(60)
def test_a_test_waiting_for_a_machine_lock_gives_its_slots_back_meanwhile(tmp_path):
    """A whole-machine test that waits for a lock another suite run holds (the one local Slurm cluster)
    lets the rest of its run use the cores meanwhile, and holds every slot again once it has the lock."""
    slots = suite_support.CpuSlots()
    slots.folder, slots.total = tmp_path, 2
    slots.take_all()
    name = f"test-{uuid.uuid4().hex}"
    other = open(Path(tempfile.gettempdir()) / f"megatron-lol-test-{name}.lock", "a+")
    fcntl.flock(other, fcntl.LOCK_EX)  # the other suite run's holder
    inside = threading.Event()

    def waiter():
        with suite_support.machine_lock(name, slots):
            inside.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        neighbour = suite_support.CpuSlots()  # this run's other worker
        neighbour.folder, neighbour.total = tmp_path, 2
        deadline = time.monotonic() + 20
        while not slots.held == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slots.held == [] and not inside.is_set()
        neighbour.take_one()  # a core is free while the lock is held elsewhere
        neighbour.release()
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        other.close()
    thread.join(20)
    assert inside.is_set() and not thread.is_alive()
    assert len(slots.held) == 2 and slots.whole_machine  # every slot again, as before the wait
    slots.release()


@pytest.mark.timeout(60)
def test_a_whole_machine_wait_counts_the_seconds_its_held_cores_idle(tmp_path):
    """take_all holds slot 0 while slot 1 is busy: those seconds are counted (the run's 'held cores idle'
    figure), and a wait for slot 0 itself counts none (nothing held idles meanwhile)."""
    busy = suite_support.CpuSlots()  # the other worker, in a single-core test
    busy.folder, busy.total = tmp_path, 2
    busy.take_one()
    assert [Path(f.name).name for f in busy.held] == ["slot0"]
    waiting = suite_support.CpuSlots()
    waiting.folder, waiting.total = tmp_path, 2
    # slot 0 is busy first: nothing is held while waiting for it, so nothing idles
    releaser = threading.Timer(0.3, busy.release)
    releaser.start()
    waiting.take_all()
    releaser.join()  # release() unlocks before it empties busy.held: take_all can return in between
    assert waiting.whole_machine and waiting.stalled < 0.1, waiting.stalled
    waiting.release()
    # slot 1 busy: take_all holds slot 0 idle until it is free
    first = suite_support.CpuSlots()
    first.folder, first.total = tmp_path, 2
    first.take_one()
    busy.take_one()
    assert [Path(f.name).name for f in busy.held] == ["slot1"]
    first.release()
    threading.Timer(0.5, busy.release).start()
    waiting.take_all()
    assert waiting.whole_machine and 0.4 <= waiting.stalled < 30, waiting.stalled


def test_idle_table_orders_whole_machine_tests_by_idle_core_seconds():
    busy, total = suite_support.cpu_jiffies()
    assert 0 < busy < total  # this machine's /proc/stat
    lines = suite_support.idle_table({"a.py::long_busy": (100.0, 0.95), "b.py::short_idle": (20.0, 0.25)})
    cores = suite_support.slot_count()
    assert lines[1].split()[-1] == "b.py::short_idle" and float(lines[1].split()[2]) == pytest.approx(15.0 * cores)
    assert lines[2].split()[-1] == "a.py::long_busy" and float(lines[2].split()[2]) == pytest.approx(5.0 * cores)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("light", [False, True])
def test_a_second_live_process_takes_the_whole_machine_unless_the_test_mostly_waits(tmp_path, light):
    """LaunchWatch upgrades a one-slot test to the whole machine when it starts a second process while
    the first still runs; a test marked mostly_waiting keeps its one slot (the other core stays free)."""

    class Running:  # a started process that is still running (no real one: this test holds one slot)
        def is_alive(self):
            return True

    slots = suite_support.CpuSlots()
    slots.folder, slots.total = tmp_path, 2
    slots.light = light
    slots.take_one()
    watch = suite_support.LaunchWatch()
    watch.begin("tests/x.py::t", slots)
    watch.process(Running())
    assert len(slots.held) == 1  # one process: one slot either way
    watch.process(Running())
    watch.end()
    assert slots.whole_machine is not light and len(slots.held) == (1 if light else 2)
    assert watch.upgraded == ([] if light else ["tests/x.py::t"]) and watch.per_file["tests/x.py"] == 2
    slots.release()
