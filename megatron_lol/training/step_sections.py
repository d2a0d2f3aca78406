"""What ``megatron-lol profile`` measures inside a step: section times and routing statistics.

:class:`SectionTimer` times the forward's parts with module hooks and the core's
named trace ranges (:mod:`megatron_lol.platform.trace_ranges`), synchronising
CUDA around each when asked; :class:`RoutingStats` records the core's routing
on every forward; :class:`TimedIterator` times the data loading.
"""

from __future__ import annotations

import time
from typing import Optional

from megatron_lol.platform.trace_ranges import add_listener, remove_listener


class SectionTimer:
    """Accumulates seconds per section from module hooks (synchronising CUDA when asked)."""

    def __init__(self, sync: bool):
        self.sync = sync
        self.totals: dict = {}
        self.handles: list = []
        self.enabled = True
        self._open: dict = {}
        self._stack: list = []  # open trace ranges: (name, start)

    def now(self) -> float:
        if self.sync:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, key: str, seconds: float) -> None:
        if self.enabled:
            self.totals[key] = self.totals.get(key, 0.0) + seconds

    def hook_module(self, module, key: str) -> None:
        def pre(mod, args):
            self._open[id(mod)] = self.now()

        def post(mod, args, out):
            t0 = self._open.pop(id(mod), None)
            if t0 is not None:
                self.add(key, self.now() - t0)

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def wrap(self, owner, name: str, key: str) -> None:
        """Time calls of the bound method ``owner.name`` (the optimizer's step) on this instance only."""
        original = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            t0 = timer.now()
            try:
                return original(*args, **kwargs)
            finally:
                timer.add(key, timer.now() - t0)

        setattr(owner, name, timed)
        self.handles.append(_Restore(owner, name, original))

    def listen_to_ranges(self) -> None:
        """Time the core's named ranges (platform/trace_ranges.py): ``dispatch``, and the block calls
        made inside it, so that dispatch overhead = dispatch range - its block calls."""
        add_listener(self)
        self.handles.append(_StopListening(self))

    def enter(self, name: str) -> None:
        self._stack.append((name, self.now() if name == "dispatch" or name.startswith("block ") else 0.0))

    def exit(self, name: str) -> None:
        opened, t0 = self._stack.pop()
        assert opened == name, f"trace ranges closed out of order: {opened!r} then {name!r}"
        if name == "dispatch":
            self.add("core.dispatch_range", self.now() - t0)
        elif name.startswith("block ") and any(n == "dispatch" for n, _ in self._stack):
            self.add("core.blocks_in_dispatch", self.now() - t0)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _Restore:
    def __init__(self, owner, name, original):
        self.owner, self.name, self.original = owner, name, original

    def remove(self):
        setattr(self.owner, self.name, self.original)


class _StopListening:
    def __init__(self, timer):
        self.timer = timer

    def remove(self):
        remove_listener(self.timer)


def module_list(container) -> list:
    """The modules of a ModuleDict / ModuleList / list (none for None)."""
    if container is None:
        return []
    if hasattr(container, "values") and callable(container.values):
        return list(container.values())
    return list(container)


class RoutingStats:
    """Records the core's routing on every forward (``record=True``) and summarises it."""

    def __init__(self, core, window_size: int, window_shift: int, num_blocks: int):
        self.core, self.W, self.S, self.L = core, window_size, window_shift, num_blocks
        self.enabled = False
        self.windows = None  # [depth, L] windows per block
        self.distinct_sum = 0.0
        self.tokens = 0
        self.depth = 0
        self.handles = [
            core.register_forward_pre_hook(self._pre, with_kwargs=True),
            core.register_forward_hook(self._post, with_kwargs=True),
        ]
        self._docs = None

    def _pre(self, module, args, kwargs):
        if not self.enabled:
            return None
        kwargs = dict(kwargs)
        kwargs["record"] = True
        self._docs = args[1] if len(args) > 1 else kwargs.get("docs")
        return args, kwargs

    def _post(self, module, args, kwargs, out):
        if not self.enabled or not getattr(out, "records", None) or self._docs is None:
            return None
        import torch

        from megatron_lol.model.windows import WindowLayout

        choices = []
        counts = []
        for rec in out.records:
            layout = WindowLayout.build(self._docs, rec.depth, self.W, self.S)
            choice = rec.choice.to(layout.token_window.device)
            counts.append(torch.bincount(choice, minlength=self.L).double().cpu())
            choices.append(choice[layout.token_window])
        per_depth = torch.stack(counts)
        if self.windows is None:
            self.windows = per_depth
        elif self.windows.shape == per_depth.shape:
            self.windows += per_depth
        paths = torch.sort(torch.stack(choices), dim=0).values  # [D, T]
        distinct = 1 + (paths[1:] != paths[:-1]).sum(0) if paths.shape[0] > 1 else torch.ones(paths.shape[1])
        self.distinct_sum += float(distinct.double().sum())
        self.tokens += int(paths.shape[1])
        self.depth = max(self.depth, paths.shape[0])
        return None

    def summary(self) -> Optional[dict]:
        if self.windows is None:
            return None
        util = self.windows / self.windows.sum(1, keepdim=True).clamp(min=1)
        D, L = self.depth, self.L
        return {
            "block_utilisation": [[round(float(x), 4) for x in row] for row in util],
            "windows_per_block": [[int(x) for x in row] for row in self.windows],
            "distinct_blocks_per_path": self.distinct_sum / max(1, self.tokens),
            "distinct_blocks_uniform_expectation": L * (1 - (1 - 1 / L) ** D) if D else 0.0,
        }

    def remove(self):
        for h in self.handles:
            h.remove()


class TimedIterator:
    def __init__(self, it, timer: SectionTimer):
        self.it, self.timer = it, timer

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.timer.add("data", time.perf_counter() - t0)
