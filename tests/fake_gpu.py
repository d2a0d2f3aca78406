"""A fake GPU for CPU tests: run the model with every parameter and input on an accelerator device
whose tensors hold real CPU data, and fail on any operation that mixes them with CPU tensors.

Why not ``FakeTensorMode``: on a CPU-only torch build a fake ``cuda`` tensor that requires grad
aborts the process (autograd asks for the CUDA device guard, which is not linked in), and fake
tensors have no values, so routing (``nonzero``, ``bincount().tolist()``: data-dependent shapes)
cannot run. This harness keeps FakeTensor's device rule (an operation may not mix tensors of two
devices, except zero-dimensional CPU scalars) but computes real values:

* torch's PrivateUse1 backend is registered from Python under the name ``fakegpu``
  (``torch.utils.backend_registration``); it is the process's accelerator, so an integer device
  (``torch.cuda.current_device()`` on the CPU platform) means ``fakegpu:0``;
* :class:`FakeGpuTensor` is a wrapper subclass on ``fakegpu:0`` around a CPU tensor; its
  ``__torch_dispatch__`` checks the devices of every operation (forward *and* backward: the
  autograd engine dispatches through it) and raises :class:`CpuTensorOnGpuPath` on a mix; explicit
  transfers (``.to(device)``, ``copy_``) are allowed, as on a real GPU;
* inside :func:`fake_gpu`, the CPU platform's CUDA-to-CPU device mode is replaced by one that maps
  CUDA device names to ``fakegpu`` (what megatron-core creates on ``current_device()`` lands
  there), ``Tensor.cuda`` / ``Module.cuda`` move to it, and ``megatron_lol.platform.device()``
  (the device policy) answers ``fakegpu:0``.

A tensor the model creates on the CPU (no ``device=``, a CPU generator not moved, a Python list
turned into a tensor) and then combines with a GPU tensor fails the test that runs it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakegpu"
_aten = torch.ops.aten
#: operations that move data between devices on purpose (allowed to see both)
_TRANSFERS = {
    _aten._to_copy.default,
    _aten.copy_.default,
    _aten._copy_from.default,
    _aten._copy_from_and_resize.default,
}


class CpuTensorOnGpuPath(RuntimeError):
    """A CPU tensor (not a zero-dimensional scalar) met a GPU tensor in one operation."""


@functools.lru_cache(maxsize=None)
def fake_gpu_device() -> torch.device:
    """Register the ``fakegpu`` backend (once per process) and return ``fakegpu:0``."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=NAME)
    return torch.device(NAME, 0)


class FakeGpuTensor(torch.Tensor):
    """A tensor on ``fakegpu:0`` whose values live in the CPU tensor ``elem``."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        assert not isinstance(elem, FakeGpuTensor) and elem.device.type == "cpu"
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=fake_gpu_device(),
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self) -> str:
        return f"FakeGpuTensor({self.elem!r})"

    # as on a GPU, through a copy to the host (aten._to_copy): a dispatch mode sees the device read
    def tolist(self):
        return self.to("cpu").tolist()

    def numpy(self, *, force: bool = False):
        return self.to("cpu").numpy(force=force)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _where(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


def _run(func, args, kwargs):
    gpu, cpu = [], []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, FakeGpuTensor):
            gpu.append(t)
        elif isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0:
            cpu.append(t)
    if gpu and cpu and func not in _TRANSFERS:
        raise CpuTensorOnGpuPath(f"{func}: CPU tensor {_where(cpu[0])} mixed with GPU tensor {_where(gpu[0])}")
    on_gpu = bool(gpu)
    if kwargs.get("device") is not None:
        on_gpu = torch.device(kwargs["device"]).type == NAME
        kwargs = dict(kwargs, device=torch.device("cpu"))
    elif func is _aten.copy_.default:
        on_gpu = isinstance(args[0], FakeGpuTensor)
    inner_args, inner_kwargs = tree_map(lambda t: t.elem if isinstance(t, FakeGpuTensor) else t, (args, kwargs))
    out = func(*inner_args, **inner_kwargs)
    if on_gpu:
        out = tree_map(lambda t: FakeGpuTensor(t) if isinstance(t, torch.Tensor) else t, out)
        return return_and_correct_aliasing(func, args, kwargs, out)
    return out


class _FactoryMode(TorchDispatchMode):
    """Factory operations asked for ``fakegpu`` (no tensor argument to dispatch on) get a
    :class:`FakeGpuTensor`; everything else runs as it would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, FakeGpuTensor) for t in types):
            return NotImplemented  # the subclass handles it
        return _run(func, args, kwargs)


def _cuda_to_fake_mode():
    from megatron_lol.platform.device_mode import _CudaToCpuMode

    class _CudaToFakeGpu(_CudaToCpuMode):
        """The CPU platform's device mode, with CUDA device names going to the fake GPU.

        ``torch.tensor(data, device=...)`` and ``Tensor.new_tensor(data)`` build their tensor below
        the Python dispatch key (no mode or subclass sees it): here they are built on the CPU and
        moved, which is what they do on a real GPU.
        """

        target = fake_gpu_device()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in _FROM_DATA:
                # data given as GPU tensors is read to the host (as on a GPU: one sync per element)
                args = tree_map(lambda t: t.elem if isinstance(t, FakeGpuTensor) else t, args)
                device = kwargs.get("device")
                if device is not None and torch.device(self._remap(device)).type == NAME:
                    kwargs.pop("device")
                    return func(*args, **kwargs).to(self.target)
            elif (
                func in (torch.Tensor.type, torch._C.TensorBase.type)
                and len(args) == 1
                and not kwargs
                and isinstance(args[0], FakeGpuTensor)
            ):
                return "torch.cuda." + args[0].elem.type()[len("torch.") :]  # what a CUDA tensor reports
            elif func is torch.Tensor.new_tensor and isinstance(args[0], FakeGpuTensor):
                kwargs.setdefault("dtype", args[0].dtype)
                kwargs.pop("device", None)
                return torch.tensor(*args[1:], **kwargs).to(self.target)
            return super().__torch_function__(func, types, args, kwargs)

        def _remap(self, device):
            from megatron_lol.platform.device_mode import _to_target_device

            return _to_target_device(device, self.target)

    return _CudaToFakeGpu()


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


@contextlib.contextmanager
def fake_gpu():
    """Run the body as if on a GPU: see the module docstring. Call ``setup_platform()`` first."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import megatron_lol.platform as platform

    dev = fake_gpu_device()
    saved = (torch.Tensor.cuda, nn.Module.cuda, platform.device, MoEAuxLossAutoScaler.main_loss_backward_scale)
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self.to(dev, non_blocking=non_blocking)
    nn.Module.cuda = lambda self, device=None: self.to(dev)
    platform.device = lambda: dev
    # megatron-core keeps the MoE aux-loss scale in a class attribute made on the first run's device:
    # an earlier CPU run of this process would leave a CPU tensor a real GPU process never has
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        with platform.device_mode_suspended(), _cuda_to_fake_mode(), _FactoryMode():
            yield dev
    finally:
        torch.Tensor.cuda, nn.Module.cuda, platform.device, MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def to_fake_gpu(module: nn.Module) -> nn.Module:
    """Move every parameter and buffer of ``module`` to the fake GPU, in place (tied parameters stay
    tied; attributes megatron-core sets on parameters are kept)."""
    moved: dict = {}

    def move(t):
        if id(t) in moved:
            return moved[id(t)]
        new = FakeGpuTensor(t.detach().clone())
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
            new.__dict__.update({k: v for k, v in t.__dict__.items() if k != "_is_param"})
        moved[id(t)] = new
        return new

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = move(p)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = move(b)
    return module


def on_fake_gpu(t: Any) -> bool:
    return isinstance(t, FakeGpuTensor)
