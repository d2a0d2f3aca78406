"""Named ranges in the forward for profiler traces: ``record_function`` plus NVTX on CUDA.

The model marks ``prelude``, ``depth {l}``, ``router``, ``dispatch``,
``block {b}`` and ``coda`` with :func:`trace_range`; the ``--profile`` window
(:mod:`megatron_lol.training.tracing`) switches them on with
:func:`enable_ranges`. They are ``torch.profiler.record_function`` ranges (in
the Chrome trace) and, on CUDA, NVTX ranges (in nsys). Outside a profiled
window, and with no listener, :func:`trace_range` is a shared no-op context, so
unprofiled steps pay nothing. Listeners (:func:`add_listener`: objects with
``enter(name)`` / ``exit(name)``) see every range as it opens and closes;
``megatron-lol profile`` times the core's sections this way, through the same
named points the traces show. This sits below the model so the model can mark its ranges without
depending on the training loop.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

_NULL = contextlib.nullcontext()
_STATE = {"ranges": False, "nvtx": False}
_LISTENERS: list = []


class _Range:
    """``record_function(name)`` plus an NVTX range on CUDA (``_STATE["nvtx"]``)."""

    __slots__ = ("name", "record")

    def __init__(self, name: str):
        self.name = name
        self.record = None

    def __enter__(self):
        import torch

        if _STATE["ranges"]:
            self.record = torch.profiler.record_function(self.name)
            self.record.__enter__()
            if _STATE["nvtx"]:
                torch.cuda.nvtx.range_push(self.name)
        for listener in _LISTENERS:
            listener.enter(self.name)
        return self

    def __exit__(self, *exc):
        import torch

        for listener in reversed(_LISTENERS):
            listener.exit(self.name)
        if self.record is not None:
            if _STATE["nvtx"]:
                torch.cuda.nvtx.range_pop()
            self.record.__exit__(*exc)
        return False


def trace_range(name: str):
    """A named range in the profiler trace (and nsys, on CUDA) while a profile window is open; else a no-op."""
    return _Range(name) if _STATE["ranges"] or _LISTENERS else _NULL


def trace_steps(steps: Iterable, name=lambda step: f"depth {step.depth}") -> Iterator:
    """``steps``, each one's loop body inside the range ``name(step)`` (a one-line change to a ``for``)."""
    for step in steps:
        with trace_range(name(step)):
            yield step


def enable_ranges(on: bool, nvtx: bool = False) -> None:
    _STATE["ranges"], _STATE["nvtx"] = on, on and nvtx


def add_listener(listener) -> None:
    """Call ``listener.enter(name)`` / ``listener.exit(name)`` at every range from now on."""
    _LISTENERS.append(listener)


def remove_listener(listener) -> None:
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)
