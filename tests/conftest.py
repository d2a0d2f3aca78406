"""Shared fixtures: one megatron-core process state per test session, tiny LoL models; how the
suite shares the machine (CPU slots, launch accounting, file order: tests/suite_support.py)."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest
import suite_support
import torch

suite_support.install_launch_watch()
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # a worker owns one core (suite_support.cpu_slots)

SEED = 1234
VOCAB = 97
EOD = 0


def ensure_megatron(seed: int = SEED) -> None:
    """setup_platform + world-size-1 process group + TP=PP=1 parallel state (idempotent)."""
    from megatron_lol.platform import init_distributed, setup_platform

    setup_platform()
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@pytest.fixture(scope="session")
def _megatron_session():
    # tiny models: one intra-op thread is ~10x faster than OpenMP on a shared 2-core box
    torch.set_num_threads(1)
    ensure_megatron()
    yield


@pytest.fixture
def megatron_env(_megatron_session):
    """The world-size-1 megatron-core state, set up again when a test before this one in the same process
    tore it down (an in-process CLI run or trainer replaces the parallel state with its own layout)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._DATA_PARALLEL_GROUP_WITH_CP is None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        ensure_megatron()
    yield


def tiny_config(**model):
    """A tiny LoL ``ModelConfig``; keyword arguments override ``model.*`` keys."""
    from megatron_lol.config import config_from_dict

    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_blocks=3,
        routed_depth=4,
        window_size=8,
        window_shift=4,
        n_prelude=1,
        n_coda=1,
    )
    base.update(model)
    return config_from_dict({"model": base}).model


@pytest.fixture
def make_model(megatron_env):
    """Factory ``make_model(seed=..., router_std=..., **model_keys) -> LoLGPTModel`` (eval mode).

    ``router_std`` > 0 replaces the zero-initialised router weights by N(0, std) so that
    routing is not a tie everywhere; the same seed gives the same weights.
    """

    def build(seed: int = SEED, router_std: float = 0.0, vocab: int = VOCAB, eod: int = EOD, **model):
        from megatron_lol.model.lol_model import LoLGPTModel

        ensure_megatron(seed)
        torch.manual_seed(seed)
        net = LoLGPTModel(tiny_config(**model), vocab, eod, init_seed=seed)
        if router_std > 0 and hasattr(net.core, "routers"):
            gen = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for router in net.core.routers:
                    router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen) * router_std)
                    router.logits.bias.zero_()
        return net.eval()

    return build


def pytest_collection_modifyitems(config, items):
    """Longest files first (suite_support.order_by_duration). Tests marked ``gpu`` need CUDA: skipped
    without it (CI is a CPU machine); bench/gpu/run_all.sh runs them."""
    suite_support.order_by_duration(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run by bench/gpu/run_all.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ sharing the machine
def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker (not a pytest some test started)
        suite_support.RUN_ID = workerinput.get("testrunuid")


_FILE_TIME: collections.Counter = collections.Counter()
_FILE_TESTS: collections.Counter = collections.Counter()
_LAUNCHES: collections.Counter = collections.Counter()
_UPGRADED: list = []
_WHOLE: collections.Counter = collections.Counter()  # per file: seconds its tests held every core
_WAITED: collections.Counter = collections.Counter()  # per file: seconds its tests waited for their slots
_STALLED: collections.Counter = collections.Counter()  # per file: seconds held cores idled in take_all
_IDLE: dict = {}  # per whole-machine test: (seconds held, share of the machine busy meanwhile)
_STARTED = time.monotonic()
_STARTED_JIFFIES = suite_support.cpu_jiffies()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the test's CPU slots around its setup, call and teardown (module fixtures included),
    outside any timeout's clock; note what it launches (suite_support.LaunchWatch)."""
    slots = suite_support.CpuSlots()
    f = item.nodeid.split("::")[0]
    asked = time.monotonic()
    if item.get_closest_marker(suite_support.LIGHT_MARKER) is not None:  # before a module's multiprocess
        slots.light = True
        slots.take_one()
    elif item.get_closest_marker(suite_support.MARKER) is not None:
        slots.take_all()
    else:
        slots.take_one()
    began = time.monotonic()
    jiffies = suite_support.cpu_jiffies()
    _WAITED[f] += began - asked
    suite_support.WATCH.begin(item.nodeid, slots)
    try:
        yield
    finally:
        suite_support.WATCH.end()
        _STALLED[f] += slots.stalled  # the first take_all and any upgrade mid-test
        if slots.whole_machine and slots.folder is not None:
            held = time.monotonic() - began
            _WHOLE[f] += held
            busy, total = (b - a for b, a in zip(suite_support.cpu_jiffies(), jiffies))
            if total > 0:  # a test that upgraded mid-way counts from its start: an upper bound of its idle
                _IDLE[item.nodeid] = (held, busy / total)
        slots.release()


def pytest_runtest_logreport(report):
    f = report.nodeid.split("::")[0]
    _FILE_TIME[f] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _FILE_TESTS[f] += 1


def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: hand its counts to the controller
        config.workeroutput["launches"] = dict(suite_support.WATCH.per_file)
        config.workeroutput["upgraded"] = list(suite_support.WATCH.upgraded)
        config.workeroutput["whole"] = dict(_WHOLE)
        config.workeroutput["waited"] = dict(_WAITED)
        config.workeroutput["idle"] = dict(_IDLE)
        config.workeroutput["stalled"] = dict(_STALLED)
    else:
        _LAUNCHES.update(suite_support.WATCH.per_file)
        _UPGRADED.extend(suite_support.WATCH.upgraded)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    _LAUNCHES.update(output.get("launches", {}))
    _UPGRADED.extend(output.get("upgraded", []))
    _WHOLE.update(output.get("whole", {}))
    _WAITED.update(output.get("waited", {}))
    _IDLE.update({k: tuple(v) for k, v in output.get("idle", {}).items()})
    _STALLED.update(output.get("stalled", {}))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not _FILE_TIME:
        return
    tr = terminalreporter
    tr.write_sep("=", "test time and process launches per file")
    for line in suite_support.file_table(_FILE_TIME, _FILE_TESTS, _LAUNCHES, _WHOLE, _WAITED):
        tr.write_line(line)
    tr.write_line(f"wall time of the session: {time.monotonic() - _STARTED:.0f} s")
    busy, total = (b - a for b, a in zip(suite_support.cpu_jiffies(), _STARTED_JIFFIES))
    if total > 0:
        tr.write_line(
            f"machine busy over the session: {busy / total:.0%}; a test waiting for the whole machine held "
            f"cores idle for {sum(_STALLED.values()):.0f} s"
        )
    if _IDLE:
        tr.write_sep("=", "whole-machine tests that left cores idle")
        for line in suite_support.idle_table(_IDLE):
            tr.write_line(line)
    if _UPGRADED:
        tr.write_line(
            f"{len(_UPGRADED)} tests took the whole machine only when they started a second process "
            f"(mark them @pytest.mark.{suite_support.MARKER}):"
        )
        for nodeid in sorted(set(_UPGRADED)):
            tr.write_line(f"  {nodeid}")
    if os.environ.get("MEGATRON_LOL_UPDATE_DURATIONS") == "1":
        rounded = {f: round(t, 1) for f, t in sorted(_FILE_TIME.items())}
        suite_support.DURATIONS.write_text(json.dumps(rounded, indent=1) + "\n")
        tr.write_line(f"wrote {suite_support.DURATIONS}")
