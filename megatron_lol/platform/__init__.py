"""The platform: one device policy for every process, and the run-time patches
that let megatron-core run on CPU with gloo (with CUDA present only items 6-8
below are applied: 6 when Transformer Engine / apex are absent, 7 and 8 always).

Public API
----------
``setup_platform() -> str``
    Idempotent. Returns ``"cuda"`` or ``"cpu"``. Without CUDA it installs the
    CPU emulation (items 1-5) through :func:`.cpu_patches.install_cpu_patches`.
    Patches for missing Transformer Engine / apex (item 6) are applied whenever
    those are absent, even with CUDA.
``init_distributed(backend=None) -> None``
    Initialise ``torch.distributed`` from torchrun-style environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``);
    a single process on a free localhost port when they are absent. Idempotent.
``device() -> torch.device``
    The device policy: ``cuda:LOCAL_RANK`` with CUDA (and NCCL), ``cpu``
    without (and gloo). Every model chunk, batch, layout, reduction buffer and
    loaded checkpoint of the process lives there; model code follows the
    device of its inputs and parameters and never names a device itself.
``to_device(obj, device=None)``
    Move the tensors of a batch (nested dicts / lists / tuples) to the policy
    device; the same objects on CPU.
``has_transformer_engine() -> bool``
    Whether Transformer Engine imports (always False without CUDA).
``cpu_device_mode()``
    The TorchFunctionMode that rewrites CUDA devices to CPU (item 5). It is
    thread-local: ``setup_platform()`` enters one for the *calling* thread for
    the rest of the process (call it from the main thread); other threads that
    run megatron-core code must wrap their work in ``with cpu_device_mode():``.

Patches (CPU only unless noted); each is a function ``_patch_*`` in
the submodule named:

1-5. The CPU emulation, installed in one place and only without CUDA:
   :func:`.cpu_patches.install_cpu_patches`; :data:`.cpu_patches.CPU_PATCHES`
   and that module's docstring list each (``torch.cuda`` device / stream / RNG
   calls, gloo's MoE split sizes and batched p2p, ``.cuda()`` as the identity,
   the CUDA-to-CPU TorchFunctionMode) with why it exists.
6. (whenever TE/apex are absent) ``no_te._patch_te_general_gemm``: MoE router reads
   ``moe_utils.te_general_gemm`` which is only defined when TE imports
   (NameError); ``_patch_distrib_optimizer_torch_adam_step``: loading a
   distributed-optimizer checkpoint with the torch AdamW fallback fails on
   ``assert len(steps) == 1`` and then resumes Adam's step counter at 0;
   ``_patch_wgrad_accumulation_fusion`` (whenever apex's
   ``fused_weight_gradient_mlp_cuda`` is absent): megatron-core refuses
   ``gradient_accumulation_fusion`` without it; a torch version of its two
   functions takes its place (FP32 weight-gradient accumulation of the local spec);
   ``_patch_grad_norm_without_host_reads`` (whenever megatron-core's gradient clipping
   falls back to its local multi-tensor norm): a ``torch._foreach_norm`` version that
   reads nothing back per parameter (``no_te.foreach_l2_norm``).
7. (always) ``megatron_fixes._patch_moe_aux_loss_scale_shape``: a MoE backward outside
   megatron's schedules leaves a 0-dim aux-loss scale that every later schedule-driven
   step fails to ``copy_`` its ``[1]`` scale into.
8. (always) ``megatron_fixes._patch_float16_optimizer_fp32_params`` and
   ``_patch_distributed_optimizer_fp32_params``: megatron-core's optimizers assume a
   bf16 model holds only bf16 parameters when they map optimizer state to parameters
   for checkpoints; this package keeps its routing parameters in FP32, and saving a
   bf16 run failed with either optimizer.

Patches touch private megatron-core names (pinned ``megatron-core==0.16.1``);
when one has moved, :class:`PlatformPatchError` names it.

Importing this module is cheap: megatron-core is imported only inside
``setup_platform()``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import threading
from typing import Any

import torch

from megatron_lol.platform._common import (
    MEGATRON_CORE_PIN,
    PlatformPatchError,
    _require,  # noqa: F401  (tests/test_platform.py calls plat._require)
    applied_patches,
)
from megatron_lol.platform.device_mode import _enter_global_cpu_mode, cpu_device_mode, device_mode_suspended

__all__ = [
    "PlatformPatchError",
    "setup_platform",
    "init_distributed",
    "device",
    "to_device",
    "has_transformer_engine",
    "has_apex",
    "cuda_available",
    "cpu_device_mode",
    "device_mode_suspended",
    "applied_patches",
    "MEGATRON_CORE_PIN",
]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_PLATFORM: str | None = None


def cuda_available() -> bool:
    """True when torch sees at least one usable CUDA device."""
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def has_transformer_engine() -> bool:
    """True when Transformer Engine is importable and CUDA is present.

    A broken TE install (e.g. the PyPI meta package on a CPU machine) raises
    RuntimeError on import; that counts as absent.
    """
    if not cuda_available():
        return False
    try:
        # imported only to probe that TE loads
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def has_apex() -> bool:
    """True when NVIDIA apex (not PyPI's unrelated ``apex``) is importable."""
    try:
        # imported only to probe that NVIDIA apex loads
        import apex  # noqa: F401
        from apex.optimizers import FusedAdam  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def setup_platform() -> str:
    """Prepare megatron-core for this machine; return ``"cuda"`` or ``"cpu"``.

    Idempotent and cheap after the first call. Without CUDA installs the CPU
    emulation (:func:`.cpu_patches.install_cpu_patches`: patches 1-5 and the
    CUDA->CPU TorchFunctionMode, entered in the calling thread for the rest of
    the process); call it from the main thread
    (other threads: ``with cpu_device_mode():``). Whenever TE/apex are absent,
    applies patch 6, even with CUDA; patches 7 and 8 (fixes of megatron-core itself)
    always. Raises :class:`PlatformPatchError` when a
    private megatron-core name a patch needs has moved.
    """
    from megatron_lol.platform import megatron_fixes, no_te
    from megatron_lol.platform._common import _APPLIED
    from megatron_lol.platform.cpu_patches import install_cpu_patches

    global _PLATFORM
    with _LOCK:
        if _PLATFORM is not None:
            if _PLATFORM == "cpu":
                _enter_global_cpu_mode()  # no-op in the thread that set up
            return _PLATFORM
        platform = "cuda" if cuda_available() else "cpu"
        if platform == "cpu":
            install_cpu_patches()  # the CPU emulation, never with CUDA
        if not has_transformer_engine():
            no_te._patch_te_general_gemm()
        if not (has_transformer_engine() or has_apex()):
            no_te._patch_distrib_optimizer_torch_adam_step()
        no_te._patch_wgrad_accumulation_fusion()  # a no-op where apex's extension imports
        no_te._patch_grad_norm_without_host_reads()  # a no-op where TE's or apex's kernels are used
        megatron_fixes._patch_moe_aux_loss_scale_shape()
        megatron_fixes._patch_float16_optimizer_fp32_params()
        megatron_fixes._patch_distributed_optimizer_fp32_params()
        _PLATFORM = platform
        logger.debug("megatron_lol platform: %s, patches: %s", platform, _APPLIED)
        return platform


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank() -> int:
    """``LOCAL_RANK``: the process's index on its node, which picks its GPU. Required under a launcher
    (``RANK`` set): falling back to the global rank would put rank 8 of a two-node job on ``cuda:8``
    of a node with eight GPUs, or two ranks on one GPU."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        if "RANK" in os.environ:
            from megatron_lol.errors import CliError

            raise CliError(
                f"LOCAL_RANK is not set, but RANK={os.environ['RANK']} is: launch with torchrun, or srun "
                f"through slurm/launch_task.sh (which exports it); it picks the process's GPU"
            )
        return 0
    return int(value)


def device() -> torch.device:
    """The process's device: ``cuda:LOCAL_RANK`` when CUDA is present, else ``cpu``.

    The one place the device is decided (a function of the environment, so
    the same answer on every call of a process). NCCL needs every tensor of a
    collective on this device; megatron-core's DDP puts its gradient buffers on
    ``torch.cuda.current_device()``, which :func:`init_distributed` sets to it.
    """
    if cuda_available():
        return torch.device("cuda", _local_rank())
    return torch.device("cpu")


def to_device(obj: Any, dev: torch.device | None = None) -> Any:
    """``obj`` with every tensor in it (nested dicts, lists, tuples) on ``dev`` (default :func:`device`).

    Host-to-device copies are ``non_blocking`` (they overlap with queued GPU
    work when the batch sits in pinned memory); on CPU every tensor is returned
    as it is, not copied.
    """
    dev = device() if dev is None else dev
    if torch.is_tensor(obj):
        return obj.to(dev, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, dev) for v in obj)
    return obj


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Initialise ``torch.distributed`` from torchrun-style environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``LOCAL_RANK``. When ``WORLD_SIZE`` is absent (or 1) and no rank or port is set,
    runs a single process on an in-memory store, leaving the environment as it was. ``backend`` defaults to
    ``"nccl"`` with CUDA and ``"gloo"`` without; with CUDA the current device
    is set to ``LOCAL_RANK`` and NCCL process groups are bound to it
    (``device_id``). ``LOCAL_RANK`` is required when ``RANK`` is set (a
    launcher): one-line :class:`~megatron_lol.errors.CliError` otherwise.
    Idempotent: returns at once if already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    lone = world_size == 1 and "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    if world_size > 1 and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise RuntimeError(
            f"init_distributed: WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set "
            "(launch with torchrun or set them)"
        )
    local_rank = _local_rank()  # one-line error under a launcher that did not set it
    if backend is None:
        backend = "nccl" if cuda_available() else "gloo"
    kwargs: dict[str, Any] = {}
    if cuda_available():
        torch.cuda.set_device(device())
        if backend == "nccl":
            # NCCL binds its communicator to this GPU at once (Megatron-LM's initialize does the same)
            # instead of guessing it at the first collective, and may create sub-groups eagerly
            kwargs["device_id"] = device()
    if timeout is not None:
        kwargs["timeout"] = timeout
    if lone:
        # a lone process needs no rendezvous: an in-memory store cannot lose a port race
        # with other processes on the machine. Nor does it write RANK / MASTER_PORT into its
        # environment: a process it starts (a CLI run from a test, an evaluation) would inherit
        # them, take itself for a rank of a launch and bind that stale port
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
