"""Count, on the CPU, what a forward and backward would cost a GPU in launches and host synchronisations.

A GPU step is fast when the CPU queues kernels ahead of the device. Every ATen
operation is roughly one kernel launch (CPU time whatever its work), and some
operations force the host to wait for the device: they read a value back
(``.item()`` / ``int(t)`` / ``float(t)``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``torch.equal``, a blocking copy to the CPU) or produce a shape that depends on values
(``nonzero``, ``bincount``, ``unique``, ``masked_select``, indexing with a
boolean mask (but ``x[mask] = python_number``, which ATen runs as
``masked_fill_``), ``repeat_interleave`` with tensor repeats and no
``output_size``). Both can be counted on the CPU:
:class:`OpCounter` is a ``TorchDispatchMode`` (every ATen operation, forward
and backward, as the autograd engine dispatches it) plus a
``TorchFunctionMode`` for the reads that never reach ATen on the CPU
(``.tolist()``, ``.cpu()``, ``.numpy()``, and ``torch.tensor(list)`` of
tensors, which reads each element below the dispatcher: one read per tensor).

    with OpCounter() as count:
        loss = model(x).sum()
    print(count.ops, count.syncs, count.sync_names)

What is no device read on a GPU is not counted as one (``host_reads`` instead):
with ``device`` an accelerator, a read of a CPU tensor; on the CPU, where every
tensor is a CPU tensor, the tensors named in ``host_tensors`` (state a GPU run
keeps on the host too, e.g. ``torch.optim``'s ``step`` counters) and whatever
runs inside :meth:`OpCounter.host_side` (the data loader's host work).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: ATen packets that always read a value back or size their output from values
SYNC_PACKETS = frozenset(
    {
        _aten._local_scalar_dense,
        _aten.nonzero,
        _aten.bincount,
        _aten.masked_select,
        _aten.equal,
        _aten._unique,
        _aten._unique2,
        _aten.unique_consecutive,
        _aten.unique_dim,
        _aten.unique_dim_consecutive,
    }
)

#: Python-level reads that do not dispatch an ATen operation on the CPU
SYNC_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}

#: tensors built from Python data: a list holding tensors is read element by element
FROM_DATA = {torch.tensor: "tensor (from tensors)", torch.as_tensor: "as_tensor (from tensors)"}

_INDEX_PACKETS = frozenset({_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_})


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return any(t is not None and torch.is_tensor(t) and t.dtype in (torch.bool, torch.uint8) for t in (indices or ()))


def _is_scalar_mask_fill(func, args) -> bool:
    """``x[mask] = python_number``: ATen's ``index_put_`` runs it as ``masked_fill_`` when the value is a
    one-element CPU tensor and the only index a boolean mask (``canDispatchToMaskedFill``,
    aten/src/ATen/native/TensorAdvancedIndexing.cpp), and Python's ``__setitem__`` makes a Python number
    a CPU scalar even for a CUDA tensor: nothing is read back."""
    indices = [t for t in (args[1] if len(args) > 1 else None) or () if t is not None]
    return (
        func.overloadpacket in (_aten.index_put_, _aten._index_put_impl_)
        and len(indices) == 1
        and len(args) > 2
        and torch.is_tensor(args[2])
        and args[2].numel() == 1
        and not (len(args) > 3 and args[3])  # accumulate
    )


def _copy_to_host(func, args, kwargs) -> bool:
    """A blocking copy from an accelerator to the CPU (``t.to("cpu")``, ``cpu_tensor.copy_(t)``)."""
    if kwargs.get("non_blocking") or (func.overloadpacket is _aten.copy_ and len(args) > 2 and args[2]):
        return False  # into page-locked memory: the host goes on
    if func.overloadpacket is _aten._to_copy:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu"
    if func.overloadpacket is _aten.copy_:
        return args[0].device.type == "cpu" and torch.is_tensor(args[1]) and args[1].device.type != "cpu"
    return False


def sync_name(func, args, kwargs, python_scalar_value: bool = False) -> Optional[str]:
    """The name under which ``func(*args, **kwargs)`` counts as a host synchronisation, or None.
    ``python_scalar_value``: the operation is ``Tensor.__setitem__`` with a Python number as the value."""
    packet = func.overloadpacket
    if packet in SYNC_PACKETS:
        return packet.__name__
    if packet in (_aten._to_copy, _aten.copy_) and _copy_to_host(func, args, kwargs):
        return f"{packet.__name__} (to host)"
    if packet in _INDEX_PACKETS and _has_bool_index(args):
        if python_scalar_value and _is_scalar_mask_fill(func, args):
            return None
        return f"{packet.__name__} (boolean mask)"
    if (
        func in (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor)
        and kwargs.get("output_size") is None
    ):
        return "repeat_interleave (no output_size)"
    return None


def _tensors_in(data) -> list:
    """The tensors inside nested lists / tuples (not a tensor given as the data itself: that is a copy)."""
    if not isinstance(data, (list, tuple)):
        return []
    out = []
    for item in data:
        if torch.is_tensor(item):
            out.append(item)
        else:
            out.extend(_tensors_in(item))
    return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "OpCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.owner._op(func, args, kwargs)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: "OpCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = SYNC_METHODS.get(func)
        if name is not None:
            self.owner._sync(name, args[0] if args else None)
            self.owner._method_read += 1  # its own copy to the host is this read, not another
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.owner._method_read -= 1
        elif func in FROM_DATA and args:
            for t in _tensors_in(args[0]):
                self.owner._sync(FROM_DATA[func], t)
        elif func is torch.Tensor.__setitem__ and len(args) > 2 and isinstance(args[2], (bool, int, float)):
            self.owner._scalar_setitem += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.owner._scalar_setitem -= 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """ATen operations and host synchronisations inside a ``with`` block (this thread and the autograd
    engine's, which runs CPU backward on the calling thread).

    ``device``: where the step's tensors live; on an accelerator a read of a CPU tensor is a host read,
    not a synchronisation. ``host_tensors``: tensors that live on the host in a GPU run too (their reads
    are host reads wherever this counts)."""

    def __init__(self, device=None, host_tensors: Iterable[torch.Tensor] = ()):
        self.ops = 0
        self.syncs = 0
        self.host_reads = 0
        self.op_names: Counter = Counter()
        self.sync_names: Counter = Counter()
        self._modes = None
        self._device_type = None if device is None else torch.device(device).type
        self._host_ids = {id(t) for t in host_tensors}
        self._paused = 0
        self._scalar_setitem = 0  # inside ``x[index] = python_number``
        self._method_read = 0  # inside ``.tolist()`` / ``.cpu()`` / ``.numpy()``, already counted

    def _op(self, func, args, kwargs) -> None:
        if self._paused:
            return
        self.ops += 1
        self.op_names[func.overloadpacket.__name__] += 1
        name = sync_name(func, args, kwargs, python_scalar_value=self._scalar_setitem > 0)
        if name is not None and not (self._method_read and name.endswith("(to host)")):
            self._sync(name, args[0] if args else None)

    def _on_host(self, tensor) -> bool:
        """Whether reading ``tensor`` is no device synchronisation in the run this counts."""
        if not torch.is_tensor(tensor):
            return False
        if id(tensor) in self._host_ids:
            return True
        return self._device_type not in (None, "cpu") and tensor.device.type == "cpu"

    def _sync(self, name: str, tensor=None) -> None:
        if self._paused:
            return
        if self._on_host(tensor):
            self.host_reads += 1
            return
        self.syncs += 1
        self.sync_names[name] += 1

    @contextlib.contextmanager
    def host_side(self):
        """Nothing inside is counted: work that runs on the host by construction (the data loader
        building a batch from CPU tensors before it is moved to the device)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> "OpCounter":
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
