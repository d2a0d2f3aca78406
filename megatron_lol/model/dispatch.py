"""Grouped dispatch: every block runs all of its windows as one packed batch.

Per routed depth the bookkeeping is computed once: a stable sort of the tokens
by chosen block (tokens of a window stay contiguous and in order, because the
flat token order is row-major), the number of tokens per block (one host sync
per depth), and the segment ids of the packed stream. Each block is then called
once on ``[T_m, 1, h]`` with a window mask; nothing loops over windows and no
window is padded.

The expert-parallel variant (blocks sharded over ranks, windows sent whole to
their block's rank) replaces :func:`run_grouped` and keeps :class:`DispatchPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class DispatchPlan:
    order: torch.Tensor  # [T'] flat token indices, grouped by block
    counts: list[int]  # tokens per block, len L
    segments: torch.Tensor  # [T'] window id of each packed token

    def slices(self):
        start = 0
        for block, count in enumerate(self.counts):
            if count:
                yield block, start, start + count
            start += count


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
    for block, lo, hi in plan.slices():
        x = packed[lo:hi]
        outputs.append(call_block(block, x, plan.segments[lo:hi], plan.order[lo:hi]) - x)
    if not outputs:
        return packed.new_zeros(packed.shape)
    return torch.cat(outputs, dim=0)


def scatter_updates(plan: DispatchPlan, updates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Put packed updates back in flat token order (zeros for tokens not in the plan)."""
    out = updates.new_zeros(num_tokens, updates.shape[-1])
    return out.index_copy(0, plan.order, updates)
