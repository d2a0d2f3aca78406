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
