"""The kind of device a config is resolved for: the machine it runs on, unless a command names another.

``model.precision.params_dtype: auto`` means BF16 where CUDA is present and FP32 on CPUs,
decided by the machine that validates the config. That is right for a run, and
wrong for a command that plans a run elsewhere: ``megatron-lol memory`` on a CPU
login node estimates the GPU job that will be submitted, so it resolves the
config under :func:`device_target` ``("gpu")`` (its ``--target``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from contextvars import ContextVar
from pathlib import Path
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
    return machine_has_cuda()


def machine_has_cuda() -> bool:
    """``platform.cuda_available()``, without importing torch when the installed build has no GPU support."""
    if "torch" not in sys.modules and installed_torch_lacks_gpu_libraries():
        return False
    from megatron_lol.platform import cuda_available

    return cuda_available()


#: libraries that a CUDA or ROCm build of torch ships in ``torch/lib`` and a CPU build does not
GPU_LIBRARY_PATTERNS = ("*c10_cuda.*", "*torch_cuda.*", "*c10_hip.*", "*torch_hip.*")


def installed_torch_lacks_gpu_libraries(torch_dir: Optional[Path] = None) -> bool:
    """True when the installed torch is a CPU build: no CUDA or ROCm library in ``torch/lib``.

    ``torch.cuda.is_available()`` is then False whatever the machine has, so the
    answer needs no ``import torch`` (about 1.2 s of CPU): a command that only
    validates a config (``train --dry-run``, ``plan-layout``, the dry runs of
    ``slurm/submit_pipeline.sh``) stays as fast as its reading of YAML. False
    whenever in doubt (such a library present, or torch not found where expected):
    then torch is asked.
    """
    if torch_dir is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        torch_dir = Path(list(spec.submodule_search_locations)[0])
    lib = torch_dir / "lib"
    if not (lib / "libtorch_cpu.so").exists() and not any(lib.glob("*torch_cpu.*")):
        return False
    return not any(next(lib.glob(pattern), None) for pattern in GPU_LIBRARY_PATTERNS)
