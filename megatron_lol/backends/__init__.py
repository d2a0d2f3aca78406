"""Device-specific fast paths, chosen at run time; the model's definition never depends on them.

``megatron_lol.model`` holds the computation. A backend offers faster
implementations of some of its steps and declines where they do not apply.
:func:`select_backend` gives the CPU backend for CPU tensors (unless
``MEGATRON_LOL_CPU_BACKEND=0``) and None otherwise: the CPU backend plugs into the
per-block executor (:class:`megatron_lol.model.executors.PerBlockCalls`: the
fused gated combine, the short layer halves); on a GPU the routed depths run on
the executor the model chose when it was built (``parallel.routed_core``: grouped
where the model allows) and the layers on megatron-core / Transformer Engine
kernels.
"""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "MEGATRON_LOL_CPU_BACKEND"

_CPU = None


def cpu_backend_enabled() -> bool:
    return os.environ.get(BACKEND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def select_backend(device: torch.device):
    """The backend for tensors on ``device``: the CPU backend on the CPU, else None."""
    global _CPU
    if device.type != "cpu" or not cpu_backend_enabled():
        return None
    if _CPU is None:
        from megatron_lol.backends.cpu import CpuBackend

        _CPU = CpuBackend()
    return _CPU


__all__ = ["BACKEND_ENV", "cpu_backend_enabled", "select_backend"]
