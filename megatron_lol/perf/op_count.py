"""Count, on the CPU, what a forward and backward would cost a GPU in launches and host synchronisations.

A GPU step is fast when the CPU queues kernels ahead of the device. Every ATen
operation is roughly one kernel launch (CPU time whatever its work), and some
operations force the host to wait for the device: they read a value back
(``.item()`` / ``int(t)`` / ``float(t)``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``torch.equal``) or produce a shape that depends on values
(``nonzero``, ``bincount``, ``unique``, ``masked_select``, indexing with a
boolean mask, ``repeat_interleave`` with tensor repeats and no
``output_size``). Both can be counted on the CPU:
:class:`OpCounter` is a ``TorchDispatchMode`` (every ATen operation, forward
and backward, as the autograd engine dispatches it) plus a
``TorchFunctionMode`` for the reads that never reach ATen on the CPU
(``.tolist()``, ``.cpu()``, ``.numpy()``).

    with OpCounter() as count:
        loss = model(x).sum()
    print(count.ops, count.syncs, count.sync_names)
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

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

_INDEX_PACKETS = frozenset({_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_})


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return any(t is not None and torch.is_tensor(t) and t.dtype in (torch.bool, torch.uint8) for t in (indices or ()))


def sync_name(func, args, kwargs) -> Optional[str]:
    """The name under which ``func(*args, **kwargs)`` counts as a host synchronisation, or None."""
    packet = func.overloadpacket
    if packet in SYNC_PACKETS:
        return packet.__name__
    if packet in _INDEX_PACKETS and _has_bool_index(args):
        return f"{packet.__name__} (boolean mask)"
    if (
        func in (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor)
        and kwargs.get("output_size") is None
    ):
        return "repeat_interleave (no output_size)"
    return None


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
            self.owner._sync(name)
        return func(*args, **(kwargs or {}))


class OpCounter:
    """ATen operations and host synchronisations inside a ``with`` block (this thread and the autograd
    engine's, which runs CPU backward on the calling thread)."""

    def __init__(self):
        self.ops = 0
        self.syncs = 0
        self.op_names: Counter = Counter()
        self.sync_names: Counter = Counter()
        self._modes = None

    def _op(self, func, args, kwargs) -> None:
        self.ops += 1
        self.op_names[func.overloadpacket.__name__] += 1
        name = sync_name(func, args, kwargs)
        if name is not None:
            self._sync(name)

    def _sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_names[name] += 1

    def __enter__(self) -> "OpCounter":
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
