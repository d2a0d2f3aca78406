"""Build, cache and call the fused CPU kernels in ``routing_cpu.c``.

Why a C file: a routed depth's gated combine ``s + alpha (E(s) - s)`` scattered
back to token order is four torch passes over ``[T, h]`` forward and about as
many backward, and on CPU each pass costs about as much as a small GEMM. No
library offers this fused operation for CPUs (Transformer Engine's fused MoE
permute/unpermute kernels are CUDA-only), so it is one C loop each way here.
(The measured effect is in docs/performance.md.)

The source is compiled once per machine and compiler with the C compiler
(``$CC``, else ``cc`` or ``gcc``) into a cache directory
(``$MEGATRON_LOL_KERNEL_DIR``, else ``$XDG_CACHE_HOME/megatron-lol/kernels`` or
``~/.cache/megatron-lol/kernels``; the file name carries a hash of the source,
the flags and the compiler's version, and is written atomically, so concurrent
processes are safe). Flags: ``-O3 -ffp-contract=off`` and no ``-march``: no
fused multiply-add (so the forward rounds exactly as torch's separate
operations) and a library that runs on every CPU of the architecture (a cache
in a home directory may be shared by different nodes).

Without a compiler, or with ``MEGATRON_LOL_CPU_KERNELS=0``, :func:`routing_kernels`
returns None once with a warning (or silently when disabled) and callers use
torch operations instead, with the same values.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("routing_cpu.c")
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
ENABLE_ENV = "MEGATRON_LOL_CPU_KERNELS"
DIR_ENV = "MEGATRON_LOL_KERNEL_DIR"

_LOCK = threading.Lock()
_LOADED: dict = {}  # "routing" -> RoutingKernels or None (tried and failed / disabled)


class KernelBuildError(RuntimeError):
    """The C compiler could not build the kernels (the message names the compiler and its error)."""


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-lol" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install cc/gcc)")
    return cc


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} --version: {e}") from e
    if out.returncode != 0:
        raise KernelBuildError(f"{cc} --version exited with {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


def build(source: Path = SOURCE, directory: Optional[Path] = None) -> Path:
    """Compile ``source`` into the cache (if not there yet) and return the library's path."""
    cc = _compiler()
    text = source.read_bytes()
    key = hashlib.sha256(
        b"\0".join([text, " ".join(FLAGS).encode(), _compiler_version(cc).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    directory = cache_dir() if directory is None else directory
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelBuildError(f"cannot create kernel cache directory {directory}: {e} (set {DIR_ENV})") from e
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        out = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            first = (out.stderr.strip().splitlines() or ["(no output)"])[0]
            raise KernelBuildError(f"{cc} failed to compile {source.name}: {first}")
        os.replace(tmp, target)  # atomic: another process sees the whole library or none
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} on {source.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_P = ctypes.c_void_p
_I = ctypes.c_int64


def _pointers(tensors: Sequence[torch.Tensor]):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


class RoutingKernels:
    """ctypes bindings of ``routing_cpu.c`` (see there for the exact arithmetic)."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._forward = lib.lol_gated_combine_forward
        self._forward.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _I]
        self._forward.restype = None
        self._backward = lib.lol_gated_combine_backward
        self._backward.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I]
        self._backward.restype = None

    @staticmethod
    def _check(states, outs, counts, order, segments, window_gate):
        assert states.dtype == torch.float32 and states.dim() == 2 and states.is_contiguous()
        assert window_gate.dtype == torch.float32 and window_gate.is_contiguous()
        assert order.dtype == torch.int64 and segments.dtype == torch.int64
        assert order.is_contiguous() and segments.is_contiguous()
        assert sum(counts) == order.numel() == segments.numel() == states.shape[0]
        for out, n in zip(outs, counts):
            assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (n, states.shape[1])

    def gated_combine_forward(
        self,
        states: torch.Tensor,
        outs: Sequence[torch.Tensor],
        counts: Sequence[int],
        order: torch.Tensor,
        segments: torch.Tensor,
        window_gate: torch.Tensor,
    ) -> torch.Tensor:
        """``new[order[r]] = s + gate[segments[r]] * (outs[r] - s)`` over every row (``order`` a permutation)."""
        self._check(states, outs, counts, order, segments, window_gate)
        dst = torch.empty_like(states)
        n = torch.tensor(list(counts), dtype=torch.int64)
        self._forward(
            len(outs),
            n.data_ptr(),
            _pointers(outs),
            states.data_ptr(),
            order.data_ptr(),
            segments.data_ptr(),
            window_gate.data_ptr(),
            dst.data_ptr(),
            states.shape[1],
        )
        return dst

    def gated_combine_backward(
        self,
        grad: torch.Tensor,
        states: torch.Tensor,
        outs: Sequence[torch.Tensor],
        counts: Sequence[int],
        order: torch.Tensor,
        segments: torch.Tensor,
        window_gate: torch.Tensor,
    ):
        """``(grad_outs, grad_states_direct, gate_per_token)`` of :meth:`gated_combine_forward`.

        The arguments are the ones the forward checked (saved for backward); only ``grad`` is checked here.
        """
        assert grad.shape == states.shape and grad.dtype == torch.float32 and grad.is_contiguous()
        grad_outs = [torch.empty_like(o) for o in outs]
        grad_states = torch.empty_like(states)
        gate_token = torch.empty(order.numel(), dtype=torch.float32)
        n = torch.tensor(list(counts), dtype=torch.int64)
        self._backward(
            len(outs),
            n.data_ptr(),
            _pointers(outs),
            states.data_ptr(),
            order.data_ptr(),
            segments.data_ptr(),
            window_gate.data_ptr(),
            grad.data_ptr(),
            _pointers(grad_outs),
            grad_states.data_ptr(),
            gate_token.data_ptr(),
            states.shape[1],
        )
        return grad_outs, grad_states, gate_token


def routing_kernels() -> Optional[RoutingKernels]:
    """The loaded kernels, or None (disabled, or they could not be built: warned once)."""
    if "routing" in _LOADED:
        return _LOADED["routing"]
    with _LOCK:
        if "routing" not in _LOADED:
            kernels = None
            if enabled():
                try:
                    kernels = RoutingKernels(build())
                except (KernelBuildError, OSError) as e:
                    logger.warning(
                        "megatron-lol: fused CPU routing kernels unavailable (%s); "
                        "using torch operations (same values, slower on CPU)",
                        e,
                    )
            _LOADED["routing"] = kernels
    return _LOADED["routing"]


def reset() -> None:
    """Forget the loaded kernels (tests: re-read the environment on the next call)."""
    with _LOCK:
        _LOADED.clear()
