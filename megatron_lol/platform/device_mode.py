"""CPU emulation (:mod:`.cpu_patches`): ``.cuda()`` as the identity, and hard-coded CUDA devices and type
strings rewritten by a TorchFunctionMode."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from megatron_lol.platform._common import PlatformPatchError, _mark

_GLOBAL_MODE: "Any" = None
_GLOBAL_MODE_THREAD: int | None = None

_CPU = torch.device("cpu")


def _to_target_device(d: Any, target: torch.device) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``,
    or an int ordinal) to ``target``; anything else is returned unchanged."""
    if isinstance(d, torch.device):
        return target if d.type == "cuda" else d
    if isinstance(d, str):
        return target if d.startswith("cuda") else d
    if isinstance(d, int) and not isinstance(d, bool):
        return target
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

    Thread-local, like every TorchFunctionMode. ``target`` is the device CUDA
    names are rewritten to (a test may subclass the mode with another one).
    """

    target = _CPU

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            new = _to_target_device(kwargs["device"], self.target)
            if new is not kwargs["device"]:
                kwargs = dict(kwargs)
                kwargs["device"] = new
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        if func in _TO_FUNCS and len(args) > 1:
            first = args[1]
            if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
                args = (args[0], _to_target_device(first, self.target)) + tuple(args[2:])
        elif func in _TYPE_FUNCS and len(args) == 1 and not kwargs:
            name = func(*args)
            if isinstance(name, str) and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
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
    is the TorchFunctionMode that :func:`_enter_global_cpu_mode` enters
    (both installed by :func:`megatron_lol.platform.cpu_patches.install_cpu_patches`).
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
                    f"(torch {torch.__version__}); update megatron_lol/platform/"
                )

        def tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, memory_format: Any = None):
            return self

        def module_cuda(self: torch.nn.Module, device: Any = None):
            return self

        torch.Tensor.cuda = tensor_cuda
        torch.nn.Module.cuda = module_cuda
