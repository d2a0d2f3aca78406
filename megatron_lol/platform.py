"""One platform module: lets megatron-core run on CPU with gloo, and does
nothing (beyond item 6 below) when CUDA is present.

Public API
----------
``setup_platform() -> str``
    Idempotent. Returns ``"cuda"`` or ``"cpu"``. Without CUDA it applies the
    run-time patches listed below (see ``/work/shared/notes/megatron-core-on-cpu.md``
    for the measurements behind them). Patches for missing Transformer Engine /
    apex (item 6) are applied whenever those are absent, even with CUDA.
``init_distributed(backend=None) -> None``
    Initialise ``torch.distributed`` from torchrun-style environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``);
    a single process on a free localhost port when they are absent. Idempotent.
``device() -> torch.device``
    ``cuda:LOCAL_RANK`` or ``cpu``.
``has_transformer_engine() -> bool``
    Whether Transformer Engine imports (always False without CUDA).
``cpu_device_mode()``
    The TorchFunctionMode that rewrites CUDA devices to CPU (item 5). It is
    thread-local: ``setup_platform()`` enters one for the *calling* thread for
    the rest of the process (call it from the main thread); other threads that
    run megatron-core code must wrap their work in ``with cpu_device_mode():``.

Patches (CPU only unless noted); each is a function ``_patch_*`` below:

1. ``_patch_cuda_device_api``: ``torch.cuda.current_device/synchronize/Stream/
   Event/current_stream/stream/set_device/nvtx/...`` raise on a CPU build
   (RoPE, global memory buffer, timers, checkpoint save, MoE dispatcher).
2. ``_patch_cuda_rng``: ``torch.cuda.get_rng_state/set_rng_state/manual_seed``
   and megatron's private ``_get_cuda_rng_state/_set_cuda_rng_state`` are routed
   to the CPU generator. Without this the RNG tracker's ``fork()`` *silently*
   stops switching streams (torch queues CUDA RNG sets when CUDA is absent).
3. ``_patch_moe_split_sizes``: ``moe_utils.maybe_move_tensor_to_cpu`` converts
   split sizes to numpy only for CUDA tensors; gloo ``all_to_all_single`` then
   raises TypeError in the alltoall dispatcher.
4. ``_patch_gloo_batched_p2p``: gloo's ``batch_isend_irecv`` with 2 pipeline
   stages cross-matches the interleaved schedule's exchanges *silently*; batched
   p2p is routed through the unbatched even/odd ``_p2p_ops`` on gloo groups.
5. ``_patch_cuda_tensors``: hard-coded ``device='cuda'`` / ``current_device()``
   and ``param.type() == 'torch.cuda.FloatTensor'`` checks (optimizers,
   clip_grads, schedules, causal mask, broadcast_data); ``Tensor.cuda``,
   ``Module.cuda``, ``Tensor.pin_memory`` and ``Tensor.record_stream`` become
   CPU no-ops.
6. (whenever TE/apex are absent) ``_patch_te_general_gemm``: MoE router reads
   ``moe_utils.te_general_gemm`` which is only defined when TE imports
   (NameError); ``_patch_distrib_optimizer_torch_adam_step``: loading a
   distributed-optimizer checkpoint with the torch AdamW fallback fails on
   ``assert len(steps) == 1`` and then resumes Adam's step counter at 0.

Patches touch private megatron-core names (pinned ``megatron-core==0.16.1``);
when one has moved, :class:`PlatformPatchError` names it.

Importing this module is cheap: megatron-core is imported only inside
``setup_platform()``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import socket
import threading
import time
import types
from typing import Any, Callable

import torch

__all__ = [
    "PlatformPatchError",
    "setup_platform",
    "init_distributed",
    "device",
    "has_transformer_engine",
    "has_apex",
    "cuda_available",
    "cpu_device_mode",
    "applied_patches",
    "MEGATRON_CORE_PIN",
]

MEGATRON_CORE_PIN = "0.16.1"

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_PLATFORM: str | None = None
_APPLIED: list[str] = []
_GLOBAL_MODE: "Any" = None
_GLOBAL_MODE_THREAD: int | None = None


class PlatformPatchError(RuntimeError):
    """A private megatron-core name that a platform patch relies on has moved."""


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def cuda_available() -> bool:
    """True when torch sees at least one usable CUDA device."""
    return torch.cuda.is_available()


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


def _require(module: types.ModuleType, name: str, patch: str) -> Any:
    """Return ``module.name`` or fail loudly naming the moved private name."""
    if not hasattr(module, name):
        raise PlatformPatchError(
            f"platform patch {patch!r} needs {module.__name__}.{name}, which does not "
            f"exist in the installed megatron-core {_megatron_version()} "
            f"(patches are written for megatron-core=={MEGATRON_CORE_PIN}); "
            f"the name has moved: update megatron_lol/platform.py"
        )
    return getattr(module, name)


def _require_source(func: Callable, snippet: str, patch: str) -> None:
    """Fail loudly when the code a patch works around no longer looks as expected."""
    import inspect

    try:
        src = inspect.getsource(func)
    except (OSError, TypeError):  # pragma: no cover - source not shipped
        return
    if snippet not in src:
        raise PlatformPatchError(
            f"platform patch {patch!r}: {func.__module__}.{func.__qualname__} no longer "
            f"contains {snippet!r} (installed megatron-core {_megatron_version()}, "
            f"patches are written for {MEGATRON_CORE_PIN}); update megatron_lol/platform.py"
        )


def _mark(name: str) -> bool:
    """Record a patch as applied; False if it already was (idempotence)."""
    if name in _APPLIED:
        return False
    _APPLIED.append(name)
    return True


def applied_patches() -> list[str]:
    """Names of the patches applied so far in this process."""
    return list(_APPLIED)


@functools.lru_cache(maxsize=None)
def has_transformer_engine() -> bool:
    """True when Transformer Engine is importable and CUDA is present.

    A broken TE install (e.g. the PyPI meta package on a CPU machine) raises
    RuntimeError on import; that counts as absent.
    """
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def has_apex() -> bool:
    """True when NVIDIA apex (not PyPI's unrelated ``apex``) is importable."""
    try:
        import apex  # noqa: F401
        from apex.optimizers import FusedAdam  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


# ---------------------------------------------------------------------------
# Item 1: CUDA device / stream / event API
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Item 3: MoE split sizes
# ---------------------------------------------------------------------------


def _patch_moe_split_sizes() -> None:
    """Item 3: ``moe_utils.maybe_move_tensor_to_cpu`` on CPU tensors.

    Fixes: the alltoall token dispatcher asks for split sizes ``as_numpy=True``
    but the original converts only CUDA tensors, so on CPU a tensor reaches
    ``all_to_all_single(output_split_sizes=...)``, which raises TypeError.
    Patched in ``moe_utils`` and in ``token_dispatcher`` (imported by name).
    """
    if not _mark("moe_split_sizes"):
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = _require(moe_utils, "maybe_move_tensor_to_cpu", "moe_split_sizes")
    _require(token_dispatcher, "maybe_move_tensor_to_cpu", "moe_split_sizes")

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------
# Item 4: gloo batched p2p with 2 pipeline stages
# ---------------------------------------------------------------------------


def _patch_gloo_batched_p2p() -> None:
    """Item 4: route batched pipeline p2p through the unbatched even/odd path on gloo.

    Fixes: gloo's ``batch_isend_irecv`` is a loop of isend/irecv on one
    communicator; with PP=2 (previous == next rank) the interleaved schedule's
    exchanges match the wrong tensors *silently* (wrong loss and grad norm).
    ``p2p_communication._p2p_ops`` orders sends/receives by even/odd rank and
    uses two communicators, which is correct. Non-gloo groups are untouched.
    """
    if not _mark("gloo_batched_p2p"):
        return
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    orig_batched = _require(p2p, "_batched_p2p_ops", "gloo_batched_p2p")
    unbatched = _require(p2p, "_p2p_ops", "gloo_batched_p2p")
    _require_source(p2p.P2PCommunicator._communicate, "_batched_p2p_ops", "gloo_batched_p2p")

    @functools.wraps(orig_batched)
    def _batched_p2p_ops(*, group: Any, **kwargs: Any) -> list:
        if torch.distributed.get_backend(group) == "gloo":
            reqs = unbatched(group=group, **kwargs)
            return list(reqs.values())
        return orig_batched(group=group, **kwargs)

    p2p._batched_p2p_ops = _batched_p2p_ops


# ---------------------------------------------------------------------------
# Item 5: hard-coded cuda devices and type strings
# ---------------------------------------------------------------------------

_CPU = torch.device("cpu")


def _to_cpu_device(d: Any) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``,
    or an int ordinal) to ``cpu``; anything else is returned unchanged."""
    if isinstance(d, torch.device):
        return _CPU if d.type == "cuda" else d
    if isinstance(d, str):
        return _CPU if d.startswith("cuda") else d
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU
    return d


def _run_backward_in_mode(
    mode: "_CudaToCpuMode",
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` with the CUDA->CPU mode active in the engine.

    A TorchFunctionMode is popped while its handler runs, and
    ``torch.autograd.backward`` is itself overridable: intercepted, the whole
    backward pass (megatron's custom autograd Functions, e.g. the tensor
    parallel linear's ``torch.empty(..., device=current_device())``) would run
    without the mode. So re-enter the mode and run the body of
    ``torch.autograd.backward`` after its torch-function check.
    """
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if grad_tensors is None:
        grad_tensors = grad_variables
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        tensors = (tensors,)
    tensors = tuple(tensors)
    if inputs is None:
        inputs_tuple: tuple = ()
    elif isinstance(inputs, torch.Tensor):
        inputs_tuple = (inputs,)
    elif isinstance(inputs, dict):
        inputs_tuple = tuple(inputs.values())
    else:
        inputs_tuple = tuple(inputs)
    with mode:
        grads = _tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
        grads = _make_grads(tensors, grads, is_grads_batched=False)
        if retain_graph is None:
            retain_graph = create_graph
        _engine_run_backward(
            tensors, grads, retain_graph, create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True
        )


_TO_FUNCS = {torch.Tensor.to, torch._C.TensorBase.to}
_TYPE_FUNCS = {torch.Tensor.type, torch._C.TensorBase.type}
_PIN_FUNCS = {torch.Tensor.pin_memory, torch._C.TensorBase.pin_memory}


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """TorchFunctionMode that makes CUDA-targeted megatron-core code run on CPU.

    * ``device=`` keyword arguments that name CUDA (str, torch.device or int
      ordinal, as from ``torch.cuda.current_device()``) become ``cpu``;
      ``pin_memory=True`` becomes False.
    * ``Tensor.to('cuda')`` / ``Tensor.to(0)`` positional devices become ``cpu``.
    * ``Tensor.type()`` reports ``torch.cuda.*`` type strings, so checks like
      ``param.type() == 'torch.cuda.FloatTensor'`` (clip_grads, FP32/Float16/
      Distributed optimizers) pass.
    * ``Tensor.pin_memory()`` is the identity.
    * ``Tensor.backward`` / ``torch.autograd.backward`` run the autograd engine
      with the mode active (see :func:`_run_backward_in_mode`), so Python
      backward code of custom autograd Functions is covered too.
      (``torch.autograd.grad`` is not re-entered: backward code it runs sees no mode.)

    Thread-local, like every TorchFunctionMode.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            new = _to_cpu_device(kwargs["device"])
            if new is not kwargs["device"]:
                kwargs = dict(kwargs)
                kwargs["device"] = new
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        if func in _TO_FUNCS and len(args) > 1:
            first = args[1]
            if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
                args = (args[0], _to_cpu_device(first)) + tuple(args[2:])
        elif func in _TYPE_FUNCS and len(args) == 1 and not kwargs:
            name = func(*args)
            if isinstance(name, str) and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        elif func in _PIN_FUNCS:
            return args[0]
        elif func is torch.autograd.backward:
            return _run_backward_in_mode(self, *args, **kwargs)
        elif func is torch.Tensor.backward:
            self_t, *rest = args
            names = ("gradient", "retain_graph", "create_graph", "inputs")
            kw = dict(zip(names, rest))
            kw.update(kwargs)
            return _run_backward_in_mode(
                self,
                self_t,
                kw.get("gradient"),
                kw.get("retain_graph"),
                kw.get("create_graph", False),
                inputs=kw.get("inputs"),
            )
        return func(*args, **kwargs)


def cpu_device_mode() -> _CudaToCpuMode:
    """A fresh CUDA->CPU TorchFunctionMode, for ``with cpu_device_mode(): ...``.

    Use it in threads other than the one that called ``setup_platform()``
    (TorchFunctionModes are thread-local). Harmless to nest.
    """
    return _CudaToCpuMode()


@contextlib.contextmanager
def device_mode_suspended():
    """Run the body without this thread's CUDA->CPU mode(s); a no-op when none is active.

    Every torch call under the mode pays a Python ``__torch_function__`` round
    trip (about 10 us on the 2-core CPU machine): a LoL block call makes ~160
    of them forward, and the routed core makes L block calls per depth where a
    fixed path makes one. Code known to create no CUDA tensors (the routed
    core on one TP/EP rank: our dispatch code and megatron's local layer with
    no collectives) runs faster outside it. Safe by failure: on a CPU-only
    build any CUDA device use raises "Torch not compiled with CUDA enabled"
    instead of running somewhere else. The modes are popped only when every
    TorchFunctionMode on the stack is ours (another mode, e.g. a user's, stays
    in force and so do ours), and pushed back on exit, exceptions included.
    """
    depth = torch._C._len_torch_function_stack()
    if depth == 0:
        yield
        return
    stack = [torch._C._get_function_stack_at(i) for i in range(depth)]
    if not all(isinstance(m, _CudaToCpuMode) for m in stack):
        yield
        return
    for _ in range(depth):
        torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


def _enter_global_cpu_mode() -> None:
    """Enter one ``_CudaToCpuMode`` in the calling thread, never exited.

    This covers the thread that called ``setup_platform()`` (normally the main
    thread, which is also where CPU autograd runs backward) for the rest of the
    process. Other threads need ``with cpu_device_mode():``.
    """
    global _GLOBAL_MODE, _GLOBAL_MODE_THREAD
    tid = threading.get_ident()
    if _GLOBAL_MODE is not None and _GLOBAL_MODE_THREAD == tid:
        return
    mode = _CudaToCpuMode()
    mode.__enter__()
    if _GLOBAL_MODE is None:
        _GLOBAL_MODE, _GLOBAL_MODE_THREAD = mode, tid


def _patch_cuda_tensors() -> None:
    """Item 5: hard-coded ``device='cuda'`` and ``torch.cuda.FloatTensor`` checks.

    Fixes: ``device='cuda'`` / ``device=torch.cuda.current_device()`` in the
    causal mask, optimizer, clip_grads, pipeline schedules, ``broadcast_data``
    and tied embeddings with PP ("Torch not compiled with CUDA enabled"), and
    ``param.type() == 'torch.cuda.FloatTensor'`` asserts in clip_grads and the
    FP32 / Float16 / Distributed optimizers. ``Tensor.cuda`` and
    ``nn.Module.cuda`` become the identity (process-wide); the device rewrite
    is a TorchFunctionMode entered once in the calling thread (see
    :func:`cpu_device_mode`).
    """
    if _mark("cuda_tensors"):
        import torch.autograd.graph

        for mod, name in (
            (torch.autograd, "_make_grads"),
            (torch.autograd, "_tensor_or_tensors_to_tuple"),
            (torch.autograd.graph, "_engine_run_backward"),
        ):
            if not hasattr(mod, name):
                raise PlatformPatchError(
                    f"platform patch 'cuda_tensors' needs torch private {mod.__name__}.{name} "
                    f"(torch {torch.__version__}); update megatron_lol/platform.py"
                )

        def tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, memory_format: Any = None):
            return self

        def module_cuda(self: torch.nn.Module, device: Any = None):
            return self

        torch.Tensor.cuda = tensor_cuda
        torch.nn.Module.cuda = module_cuda
    _enter_global_cpu_mode()


# ---------------------------------------------------------------------------
# Item 6: Transformer Engine / apex absent (also with CUDA)
# ---------------------------------------------------------------------------


def _patch_te_general_gemm() -> None:
    """Item 6a: define ``moe_utils.te_general_gemm = None`` when TE is absent.

    Fixes: the MoE router's ``RouterGatingLinearFunction`` reads the module
    global ``te_general_gemm``, which ``moe_utils`` only imports when TE
    imports: NameError without TE. ``None`` selects the torch matmul path.
    """
    if not _mark("te_general_gemm"):
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _require_source(moe_utils.RouterGatingLinearFunction.forward, "te_general_gemm", "te_general_gemm")
        moe_utils.te_general_gemm = None


def _patch_distrib_optimizer_torch_adam_step() -> None:
    """Item 6b: distributed-optimizer checkpoints with the torch Adam(W) fallback.

    Without TE/apex (``distrib_optimizer.HAVE_APEX_OR_TE`` False) the inner
    optimizer is ``torch.optim.Adam(W)``, which keeps a per-parameter ``step``:

    * ``DistributedOptimizer.state_dict()`` does ``assert len(steps) == 1``
      over the per-parameter steps; a freshly built optimizer has none, and
      ``sharded_state_dict(is_loading=True)`` calls it before loading, so every
      checkpoint load fails. Now: no state -> the step of the param groups, or 0.
    * ``_set_main_param_and_optimizer_states`` copies every key of the inner
      state, including ``step``, from the loaded parameter state, which has no
      ``step`` (the loaders skip it): KeyError. Now ``step`` is left alone there,
      and the copy runs under ``no_grad`` (the ``dp_reshardable`` loader lacks
      it: "a view of a leaf Variable ... in-place" with fp32 params).
    * Adam then resumes at the wrong step (wrong bias correction): with
      ``dp_reshardable`` the per-parameter ``step`` stays 0; with
      ``fully_reshardable`` every parameter shares *one* step tensor, which
      torch Adam increments in place once per parameter. Now the step saved in
      the checkpoint's param groups is re-applied after ``load_state_dict`` as
      one fresh tensor per parameter.
    """
    if not _mark("distrib_optimizer_torch_adam_step"):
        return
    from megatron.core.optimizer import distrib_optimizer as dopt

    name = "distrib_optimizer_torch_adam_step"
    if _require(dopt, "HAVE_APEX_OR_TE", name):
        return
    cls = _require(dopt, "DistributedOptimizer", name)
    orig_state_dict = _require(cls, "state_dict", name)
    orig_load_state_dict = _require(cls, "load_state_dict", name)
    orig_set_states = _require(cls, "_set_main_param_and_optimizer_states", name)
    _require_source(orig_state_dict, "assert len(steps) == 1", name)
    _require_source(orig_load_state_dict, 'param_groups"]]))', name)
    _require_source(orig_set_states, "dst_tensors[key].copy_(tensors[key])", name)

    def _as_float(v: Any) -> float:
        return float(v.item() if torch.is_tensor(v) else v)

    @functools.wraps(orig_state_dict)
    def state_dict(self):
        if getattr(self.ddp_config, "use_megatron_fsdp", False) or isinstance(
            self.optimizer, getattr(dopt, "HybridDeviceOptimizer", ())
        ):
            return orig_state_dict(self)
        inner = self.optimizer
        steps = {_as_float(s["step"]) for s in inner.state.values() if "step" in s}
        if len(steps) == 1 and all("step" in s for s in inner.state.values()):
            return orig_state_dict(self)
        if len(steps) > 1:
            raise RuntimeError(f"DistributedOptimizer: Adam steps differ across parameters: {sorted(steps)}")
        group_steps = {_as_float(g["step"]) for g in inner.param_groups if g.get("step") is not None}
        step = next(iter(group_steps)) if len(group_steps) == 1 else 0.0
        orig_inner_state_dict = inner.state_dict

        def inner_state_dict_with_step():
            sd = orig_inner_state_dict()
            sd["state"] = {k: {**v, "step": torch.tensor(step)} for k, v in sd["state"].items()} or {
                0: {"step": torch.tensor(step)}
            }
            return sd

        inner.state_dict = inner_state_dict_with_step
        try:
            return orig_state_dict(self)
        finally:
            del inner.state_dict

    @functools.wraps(orig_set_states)
    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # no_grad: load_parameter_state_from_dp_reshardable (unlike the other
        # loaders) is not decorated with it, and copying into an fp32 model
        # param's shard view (a view of a leaf requiring grad) then raises.
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig_set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst_tensors = {"param": main_param, **self.optimizer.state[main_param]}
        for key, dst in dst_tensors.items():
            if key == "step":
                continue  # torch Adam's step is restored from the param groups
            dst.copy_(tensors[key])

    @functools.wraps(orig_load_state_dict)
    def load_state_dict(self, state_dict):
        result = orig_load_state_dict(self, state_dict)
        if getattr(self.ddp_config, "use_megatron_fsdp", False) or "optimizer" not in state_dict:
            return result
        steps = {_as_float(g["step"]) for g in state_dict["optimizer"].get("param_groups", []) if g.get("step") is not None}
        if len(steps) == 1:
            step = next(iter(steps))
            for st in self.optimizer.state.values():
                if "step" in st:
                    old = st["step"]
                    st["step"] = torch.tensor(step, dtype=old.dtype if torch.is_tensor(old) else torch.float32)
        return result

    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def setup_platform() -> str:
    """Prepare megatron-core for this machine; return ``"cuda"`` or ``"cpu"``.

    Idempotent and cheap after the first call. Without CUDA applies patches
    1-5 (module docstring) and enters the CUDA->CPU TorchFunctionMode in the
    calling thread for the rest of the process; call it from the main thread
    (other threads: ``with cpu_device_mode():``). Whenever TE/apex are absent,
    applies patch 6, even with CUDA. Raises :class:`PlatformPatchError` when a
    private megatron-core name a patch needs has moved.
    """
    global _PLATFORM
    with _LOCK:
        if _PLATFORM is not None:
            if _PLATFORM == "cpu":
                _enter_global_cpu_mode()  # no-op in the thread that set up
            return _PLATFORM
        platform = "cuda" if cuda_available() else "cpu"
        if platform == "cpu":
            _patch_cuda_device_api()
            _patch_cuda_rng()
            _patch_moe_split_sizes()
            _patch_gloo_batched_p2p()
            _patch_cuda_tensors()
        if not has_transformer_engine():
            _patch_te_general_gemm()
        if not (has_transformer_engine() or has_apex()):
            _patch_distrib_optimizer_torch_adam_step()
        _PLATFORM = platform
        logger.debug("megatron_lol platform: %s, patches: %s", platform, _APPLIED)
        return platform


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present, else ``cpu``."""
    if cuda_available():
        return torch.device("cuda", _local_rank())
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Initialise ``torch.distributed`` from torchrun-style environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``LOCAL_RANK``. When ``WORLD_SIZE`` is absent (or 1) and no address is set,
    runs a single process on a free localhost port. ``backend`` defaults to
    ``"nccl"`` with CUDA and ``"gloo"`` without; with CUDA the current device
    is set to ``LOCAL_RANK``. Idempotent: returns at once if already initialised.
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
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    if backend is None:
        backend = "nccl" if cuda_available() else "gloo"
    if cuda_available():
        torch.cuda.set_device(_local_rank())
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if lone:
        # a lone process needs no rendezvous: an in-memory store cannot lose a port race
        # with other processes on the machine (the free port probed above may be taken
        # by the time TCPStore binds it)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
