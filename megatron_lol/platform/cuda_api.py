"""Patches 1 and 2 (CPU only): the ``torch.cuda`` device, stream, event and RNG API.

See the package docstring for the list; each ``_patch_*`` says what it fixes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from typing import Any

import torch

from megatron_lol.platform._common import _mark, _require


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: records wall time, never blocks."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "_CpuEvent") -> float:
        """Milliseconds between this event and ``end_event`` (like CUDA)."""
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time: both events must be recorded")
        return (end_event._t - self._t) * 1000.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: everything on CPU is synchronous."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = torch.device("cpu")
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


_CPU_STREAM = _CpuStream()


def _cpu_device_properties(device: Any = None) -> types.SimpleNamespace:
    total = 0
    try:
        import psutil

        total = psutil.virtual_memory().total
    except Exception:  # pragma: no cover
        pass
    return types.SimpleNamespace(
        name="cpu",
        gcnArchName="cpu",  # read by torch.compile's inductor cache key when torch.version.cuda is None
        total_memory=total,
        major=0,
        minor=0,
        multi_processor_count=os.cpu_count() or 1,
        is_integrated=False,
        is_multi_gpu_board=False,
    )


def _patch_cuda_device_api() -> None:
    """Item 1: make ``torch.cuda`` device/stream/event calls no-ops on CPU.

    Fixes: ``torch.cuda.current_device()`` (RoPE, global memory buffer,
    ``torch.empty(..., device=current_device())`` everywhere),
    ``torch.cuda.synchronize`` (timers, batched p2p), ``Stream``/``Event``/
    ``current_stream``/``stream(...)`` (``filesystem_async.py`` checkpoint save,
    MoE dispatcher), ``set_device``, ``get_device_properties`` and NVTX ranges,
    all of which raise "Torch not compiled with CUDA enabled".
    ``current_device()`` returns 0; the device mode (item 5) maps that to CPU.
    """
    if not _mark("cuda_device_api"):
        return
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _CpuStream
    cuda.ExternalStream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    cuda.set_device = lambda device: None
    cuda.get_device_properties = _cpu_device_properties
    cuda.get_device_capability = lambda device=None: (0, 0)
    cuda.get_device_name = lambda device=None: "cpu"

    nvtx = cuda.nvtx
    nvtx.range_push = lambda msg: 0
    nvtx.range_pop = lambda: 0
    nvtx.mark = lambda msg: None
    nvtx.range = lambda msg, *a, **k: contextlib.nullcontext()

    orig_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, _CpuStream) or not self.is_cuda:
            return None
        return orig_record_stream(self, stream)

    torch.Tensor.record_stream = record_stream


# ---------------------------------------------------------------------------
# Item 2: RNG
# ---------------------------------------------------------------------------


def _patch_cuda_rng() -> None:
    """Item 2: route CUDA RNG state to the CPU default generator.

    Fixes: ``torch.cuda.get_rng_state`` raises on CPU, and, worse,
    ``torch.cuda.set_rng_state`` / megatron's
    ``tensor_parallel.random._set_cuda_rng_state`` are *queued silently* when
    CUDA is absent, so ``CudaRNGStatesTracker.fork()`` stops switching RNG
    streams with no error (dropout inside TP regions would use the default
    stream). After this patch the "CUDA" generator *is* the CPU generator:
    ``torch.cuda.manual_seed(s)`` seeds it, ``fork()`` swaps its state.
    """
    if not _mark("cuda_rng"):
        return
    from megatron.core.tensor_parallel import random as mrandom

    _require(mrandom, "_get_cuda_rng_state", "cuda_rng")
    _require(mrandom, "_set_cuda_rng_state", "cuda_rng")
    _require(mrandom, "CudaRNGStatesTracker", "cuda_rng")

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states are not available on CPU")
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.random.set_rng_state = set_rng_state
    torch.cuda.random.manual_seed = manual_seed
    torch.cuda.random.manual_seed_all = manual_seed
    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state

    # fork() compares the CPU RNG state before/after the forked region and
    # warns when it changed; with the CUDA generator *being* the CPU generator
    # that warning fires on every fork that draws random numbers. Drop it.
    class _DropForkWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())
