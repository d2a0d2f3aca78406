"""The kind of device a config is resolved for: the machine it runs on, unless a command names another.

``model.precision.params_dtype: auto`` means BF16 where CUDA is present and FP32 on CPUs,
decided by the machine that validates the config. That is right for a run, and
wrong for a command that plans a run elsewhere: ``megatron-lol memory`` on a CPU
login node estimates the GPU job that will be submitted, so it resolves the
config under :func:`device_target` ``("gpu")`` (its ``--target``).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Optional

TARGETS = ("gpu", "cpu")
_TARGET: ContextVar[Optional[str]] = ContextVar("megatron_lol_device_target", default=None)


@contextlib.contextmanager
def device_target(kind: Optional[str]) -> Iterator[None]:
    """Resolve configs inside for a ``gpu`` or ``cpu`` target (None: this machine)."""
    if kind is not None and kind not in TARGETS:
        raise ValueError(f"device target must be one of {TARGETS}, got {kind!r}")
    token = _TARGET.set(kind)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_has_cuda() -> bool:
    """Whether the device the config is resolved for is a CUDA GPU."""
    kind = _TARGET.get()
    if kind is not None:
        return kind == "gpu"
    from megatron_lol.platform import cuda_available

    return cuda_available()
