"""Grouped dispatch of a routed depth: windows that chose the same block run as one packed batch.

:func:`group_by_block` orders the tokens of a depth by their window's block
(stably, so every window stays contiguous); each block then runs once on its
slice, a variable-length batch of whole windows (see docs/model.md, "Windows
are packed sequences"). :func:`gated_update` is the routed depth's update
written as its definition,

    s_I <- s_I + alpha_I * (E_rho(I)(s_I) - s_I)       for every window I,

and is what the tests define the model against. Faster implementations of the
same update (``megatron_lol.backends``) are checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

#: ``run_block(block, rows [n, h], segments [n], token_index [n]) -> block output [n, h]``: run one
#: stored block on its packed windows (``segments``: window ids; ``token_index``: flat token indices)
BlockRunner = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class WindowGrouping:
    """Tokens of one depth grouped by the block their window chose.

    ``order``: flat token indices, block by block; ``counts``: tokens per block
    (``num_blocks`` entries); ``segments``: window id of each grouped token.
    """

    order: torch.Tensor
    counts: list
    segments: torch.Tensor
    covers_all: bool = False  # ``order`` is a permutation of every token of the depth
    _biases: dict = field(default_factory=dict, repr=False, compare=False)

    def slices(self):
        """``(block, lo, hi)`` for every block with tokens."""
        start = 0
        for block, count in enumerate(self.counts):
            if count:
                yield block, start, start + count
            start += count

    def chunk_biases(self, chunk: int) -> dict:
        """``block -> additive attention mask`` of every block's packed windows, built at once
        (see :func:`megatron_lol.model.attention.chunk_bias`)."""
        if chunk not in self._biases:
            from megatron_lol.model.attention import chunk_bias

            spans = list(self.slices())
            bias = chunk_bias(self.segments, chunk, [lo for _, lo, _ in spans], [hi - lo for _, lo, hi in spans])
            out, at = {}, 0
            for block, lo, hi in spans:
                n = -(-(hi - lo) // chunk)
                out[block] = bias[at : at + n]
                at += n
            self._biases[chunk] = out
        return self._biases[chunk]


def group_by_block(
    token_choice: torch.Tensor, token_window: torch.Tensor, num_blocks: int, subset: Optional[torch.Tensor] = None
) -> WindowGrouping:
    """Group the tokens (all, or the flat indices in ``subset``) by their chosen block."""
    choice = token_choice if subset is None else token_choice[subset]
    sorted_choice, perm = torch.sort(choice, stable=True)
    order = perm if subset is None else subset[perm]
    counts = torch.bincount(sorted_choice, minlength=num_blocks).tolist()
    return WindowGrouping(
        order=order, counts=counts, segments=token_window.index_select(0, order), covers_all=subset is None
    )


def block_updates(grouping: WindowGrouping, states: torch.Tensor, run_block: BlockRunner) -> torch.Tensor:
    """``E(s) - s`` of every grouped token, in ``grouping.order`` order; each block runs once."""
    packed = states.index_select(0, grouping.order)
    pieces = packed.split(grouping.counts, dim=0)  # views; their backward is one cat
    outputs = [
        run_block(block, pieces[block], grouping.segments[lo:hi], grouping.order[lo:hi])
        for block, lo, hi in grouping.slices()
    ]
    if not outputs:
        return torch.zeros_like(packed)
    return torch.cat(outputs, dim=0) - packed


def apply_gated_updates(
    states: torch.Tensor, grouping: WindowGrouping, updates: torch.Tensor, window_gate: torch.Tensor
) -> torch.Tensor:
    """``s + alpha * update`` for the grouped tokens (``alpha`` of their window), ``s`` elsewhere."""
    gate = window_gate.index_select(0, grouping.segments).unsqueeze(1).to(states.dtype)
    return states.index_add(0, grouping.order, gate * updates)


def gated_update(
    states: torch.Tensor, grouping: WindowGrouping, window_gate: torch.Tensor, run_block: BlockRunner
) -> torch.Tensor:
    """The routed depth's new states ``s + alpha (E(s) - s)`` for the grouped tokens (the reference)."""
    return apply_gated_updates(states, grouping, block_updates(grouping, states, run_block), window_gate)
