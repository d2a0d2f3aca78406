"""Grouped dispatch: every block runs all of its windows as one packed batch.

Per routed depth the bookkeeping is computed once: a stable sort of the tokens
by chosen block (tokens of a window stay contiguous and in order, because the
flat token order is row-major), the number of tokens per block (one host sync
per depth), and the segment ids of the packed stream. Each block is then called
once on ``[T_m, 1, h]`` with a window mask; nothing loops over windows and no
window is padded (each block's stream is padded once, to a multiple of the
attention chunk).

The window mask is built once per depth too: while :func:`run_grouped` calls a
block on its slice, :func:`current_slice` tells the chunked attention which
slice of which plan it is running, and :meth:`DispatchPlan.chunk_bias` builds
the additive masks of all blocks of the depth in one go on first use (cached on
the plan). Calls from elsewhere (recomputation, the expert-parallel path)
build their own mask; the result is the same.

The expert-parallel variant (blocks sharded over ranks, windows sent whole to
their block's rank) replaces :func:`run_grouped` and keeps :class:`DispatchPlan`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class DispatchPlan:
    order: torch.Tensor  # [T'] flat token indices, grouped by block
    counts: list[int]  # tokens per block, len L
    segments: torch.Tensor  # [T'] window id of each packed token
    _bias: dict = field(default_factory=dict, repr=False, compare=False)  # chunk -> (bias, chunk offsets)

    def slices(self):
        start = 0
        for block, count in enumerate(self.counts):
            if count:
                yield block, start, start + count
            start += count

    def chunk_bias(self, chunk: int, block: int) -> torch.Tensor:
        """Additive attention mask of ``block``'s packed stream (all blocks built at once)."""
        if chunk not in self._bias:
            from megatron_lol.model.attention import chunk_bias

            spans = list(self.slices())
            bias = chunk_bias(self.segments, chunk, [lo for _, lo, _ in spans], [hi - lo for _, lo, hi in spans])
            offsets, at = {}, 0
            for b, lo, hi in spans:
                n = -(-(hi - lo) // chunk)
                offsets[b] = (at, at + n)
                at += n
            self._bias[chunk] = (bias, offsets)
        bias, offsets = self._bias[chunk]
        lo, hi = offsets[block]
        return bias[lo:hi]


_ACTIVE = threading.local()


def current_slice():
    """``(plan, block, lo, hi)`` of the block call :func:`run_grouped` is making, else None."""
    return getattr(_ACTIVE, "slice", None)


def plan_dispatch(token_choice: torch.Tensor, token_window: torch.Tensor, num_blocks: int,
                  subset: Optional[torch.Tensor] = None) -> DispatchPlan:
    """Group tokens (all, or the flat indices in ``subset``) by their chosen block."""
    if subset is None:
        choice = token_choice
        idx = None
    else:
        choice = token_choice[subset]
        idx = subset
    sorted_choice, perm = torch.sort(choice, stable=True)
    order = perm if idx is None else idx[perm]
    counts = torch.bincount(sorted_choice, minlength=num_blocks).tolist()
    return DispatchPlan(order=order, counts=counts, segments=token_window[order])


BlockCall = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_grouped(plan: DispatchPlan, states: torch.Tensor, call_block: BlockCall) -> torch.Tensor:
    """Return the block updates ``E(s) - s`` of the planned tokens, in ``plan.order`` order.

    ``call_block(block, packed [T_m, h], segments [T_m], flat token indices [T_m])``
    runs block ``block`` on its packed windows and returns its output.
    """
    packed = states[plan.order]
    outputs = []
    previous = current_slice()
    try:
        for block, lo, hi in plan.slices():
            _ACTIVE.slice = (plan, block, lo, hi)
            outputs.append(call_block(block, packed[lo:hi], plan.segments[lo:hi], plan.order[lo:hi]))
    finally:
        _ACTIVE.slice = previous
    if not outputs:
        return packed.new_zeros(packed.shape)
    # one subtraction for the whole depth (the slices tile ``packed``)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return out - packed


def scatter_updates(plan: DispatchPlan, updates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Put packed updates back in flat token order (zeros for tokens not in the plan)."""
    out = updates.new_zeros(num_tokens, updates.shape[-1])
    return out.index_copy(0, plan.order, updates)
