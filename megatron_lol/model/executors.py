"""How a routed depth's blocks run on its grouped rows: chosen once, when the core is built.

Every routed depth routes the same way, on every device and layout
(:mod:`.static_routing` on the micro-batch's host-built windows: summaries,
decision, loads, then the tokens grouped by block and the gated combine, both
in :func:`routed_update`). The one thing that differs is how the stored
blocks run on the rows grouped by block, and that is an executor:

* :class:`PerBlockCalls`: each block called once on its rows through
  :meth:`~.core.Core.call` (Transformer Engine layers, MoE blocks, full
  recomputation, per-pass parts, the CPU backend's fast paths). The calls need
  the group sizes on the host: one device-to-host read per depth.
* :class:`GroupedGEMMs`: every block at once (:func:`~.grouped_blocks.grouped_blocks`:
  ``torch._grouped_mm`` per projection, one attention call), no host read.

Expert parallelism wraps either: the grouped rows travel to their blocks'
ranks in one exchange (:func:`~.grouped_exchange.exchange_rows`, whose split
sizes are the depth's one host read), the rank's executor runs what arrived,
the outputs travel back. ``Core`` picks its executor when it is built
(:func:`~.grouped_core.routes_grouped` and :func:`~.grouped_core.grouped_core_support`
decide between the two).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lol.model.attention import SegmentMask, chunk_bias, uses_flex, window_mask
from megatron_lol.model.grouped_blocks import RowRope, for_depth, grouped_blocks, part_rows, stack_library
from megatron_lol.model.grouped_exchange import exchange_rows
from megatron_lol.model.library import segment_offsets
from megatron_lol.model.static_routing import (
    TokenGrouping,
    gated_combine,
    group_tokens,
    permute_rows,
    token_gates,
    truncation_keep,
)
from megatron_lol.plan.windows import windows_of


def truncation_mode(truncated: bool, first_window_full_backprop: bool) -> Optional[str]:
    """None (full backprop), ``"first"`` (only window-0 tokens keep gradients) or ``"frozen"`` (none do)."""
    if not truncated:
        return None
    return "first" if first_window_full_backprop else "frozen"


def _cached(ctx, key, make):
    if key not in ctx.cache:
        ctx.cache[key] = make()
    return ctx.cache[key]


@dataclass
class HostGroups:
    """A grouping whose block sizes are known on the host (what per-block calls need): the tokens
    ``order``, each grouped row's window ``segments``, and ``counts`` rows per block."""

    order: torch.Tensor
    segments: torch.Tensor
    counts: list
    covers_all: bool = True  # ``order`` is a permutation of every token of the depth

    def slices(self):
        """``(block, lo, hi)`` for every block with rows."""
        start = 0
        for block, count in enumerate(self.counts):
            if count:
                yield block, start, start + count
            start += count


def group_sizes(grouping: TokenGrouping) -> list:
    """Rows per block on the host: the per-block executor's one device-to-host read per depth."""
    return (grouping.group_offsets[1:] - grouping.group_offsets[:-1]).tolist()


class PerBlockCalls:
    """Each block once on its rows: :meth:`~.core.Core.call` with a segment mask of the block's windows."""

    grouped = False

    def run_block_fn(self, core, step, ctx, segments_all, counts, first_block: int = 0, own_windows: bool = True):
        """``run_block(block, rows, segments, positions)`` for this depth (``positions``: the rows' RoPE
        positions; ``counts[m]`` rows of block ``first_block + m``). On the CPU (chunked attention) the
        masks of all blocks' windows are built at once. Packed, each call's THD offsets are found on
        the device (:func:`~.library.segment_offsets`, no read) with room for ``min(rows, the
        layout's window capacity)`` windows, or as many as rows where the rows are not the depth's
        ``own_windows`` (expert parallelism: their window ids come from several senders)."""
        W = windows_of(core.cfg).size
        biases = {}
        if not core.packed and not uses_flex(segments_all):
            spans, lo = [], 0
            for block, count in enumerate(counts):
                if count:
                    spans.append((block, lo, count))
                lo += count
            bias = chunk_bias(segments_all, W, [lo for _, lo, _ in spans], [n for _, _, n in spans])
            at = 0
            for block, _, n in spans:
                k = -(-n // W)
                biases[first_block + block] = bias[at : at + k]
                at += k

        def run_block(block, rows, segments, positions):
            cu_seqlens = None
            if core.packed:  # THD attention: the table, each row's position in its window, the windows' offsets
                rope, mask_positions = ctx.rope, positions.view(1, -1)
                n = segments.shape[0]
                cu_seqlens = segment_offsets(segments, min(n, ctx.layout.capacity) if own_windows else n)
            else:
                rope = ctx.rope.index_select(0, positions) if ctx.rope is not None else None
                mask_positions = None
            mask = SegmentMask(
                segments=segments.view(1, -1),
                chunk=W,
                bias=biases.get(block),
                positions=mask_positions,
                cu_seqlens=cu_seqlens,
            )
            return core.call(step, block, rows.unsqueeze(1), mask, rope, ctx, pad_to=core.row_multiple).squeeze(1)

        return run_block

    def run(self, core, step, ctx, rows, grouping: TokenGrouping, positions, *, first_block: int = 0, counts=None):
        """``E_m(rows)`` of the grouped rows ``[R, h]`` (blocks ``first_block + m``), in their order.
        ``counts`` given (expert parallelism: the exchange's split table) or read here, once."""
        own_windows = counts is None  # else the rows arrived from the expert-parallel exchange
        if own_windows:
            counts = group_sizes(grouping)
        run_block = self.run_block_fn(core, step, ctx, grouping.segments, counts, first_block, own_windows)
        pieces = rows.split(counts, dim=0)  # views; their backward is one cat
        outputs = []
        lo = 0
        for m, n in enumerate(counts):
            if n:
                segments, rope_positions = grouping.segments[lo : lo + n], positions[lo : lo + n]
                outputs.append(run_block(first_block + m, pieces[m], segments, rope_positions))
            lo += n
        if not outputs:
            return rows * 0  # nothing here: the (empty) outputs keep the rows' graph
        return torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0]

    def fused_update(self, core, step, ctx, flat, grouping: TokenGrouping, decision, token_positions):
        """The whole update by the backend's fused combine (CPU), or None where it declines."""
        backend = ctx.backend
        if backend is None:
            return None
        counts = group_sizes(grouping)
        groups = HostGroups(order=grouping.order, segments=grouping.segments, counts=counts)
        run_block = self.run_block_fn(core, step, ctx, grouping.segments, counts)
        return backend.gated_update(
            flat,
            groups,
            decision.gate,
            lambda block, rows, segments, index: run_block(
                block, rows, segments, token_positions.index_select(0, index)
            ),
        )


class GroupedGEMMs:
    """Every block of the depth at once: the library stacked once per forward, one grouped computation."""

    grouped = True

    def run(self, core, step, ctx, rows, grouping: TokenGrouping, positions, *, first_block: int = 0, counts=None):
        # stacked once per forward and grad mode (a frozen depth's stacks carry no graph to the blocks)
        library = for_depth(
            _cached(
                ctx,
                ("library", torch.is_grad_enabled()),
                lambda: stack_library([core.block(i) for i in core.local_block_ids()]),
            )
        )
        hooks = ()
        if core.step_parts[step.depth - 1]:  # the step's per-pass parts of this rank's blocks, per row
            per_block = [
                tuple(item for item in core.step_hooks(step, b) if item[0].hook != "input")
                for b in range(first_block, first_block + library.qkv.shape[0])
            ]
            if per_block[0]:
                hooks = part_rows(per_block, grouping, core.cfg)
        rope = RowRope.from_table(ctx.rope, positions, rows.dtype) if ctx.rope is not None else None
        W = windows_of(core.cfg).size
        return grouped_blocks(library, rows, grouping, rope, window_mask(grouping.segments, W), W, hooks)

    def fused_update(self, *args, **kwargs):
        return None


def routed_update(core, step, flat: torch.Tensor, windows, decision, ctx) -> torch.Tensor:
    """``s_I <- s_I + alpha (E_rho(s_I) - s_I)`` for every window ``I`` of one routed depth.

    The tokens are grouped by their window's block (a stable sort: windows stay whole and in order),
    ``core.executor`` runs the blocks on the grouped rows (under expert parallelism on the ranks
    holding them), and the outputs are combined in token order with each window's gate (ordered
    gradient sums: :func:`~.static_routing.token_gates`, :func:`~.static_routing.permute_rows`).
    Truncated backprop through depth (:func:`truncation_mode`): ``"frozen"`` makes the whole update a
    constant, ``"first"`` keeps the gradients of window-0 tokens only.
    """
    executor = core.executor
    truncation = truncation_mode(ctx.truncated(step), ctx.first_window_full_backprop)
    if core.packed:  # THD attention restarts RoPE positions per window
        token_positions = windows.token_position
    else:
        token_positions = _cached(
            ctx, "row_positions", lambda: torch.arange(flat.shape[0], device=flat.device) % ctx.row_length
        )
    L = core.plan.num_stored_blocks
    group = core.expert_group()
    with torch.no_grad() if truncation == "frozen" else contextlib.nullcontext():
        grouping = group_tokens(decision.choice.index_select(0, windows.token_window), windows.token_window, L)
        if truncation is None and group is None:
            new = executor.fused_update(core, step, ctx, flat, grouping, decision, token_positions)
            if new is not None:
                return new
        gate = token_gates(windows, decision.gate)
        rows = permute_rows(flat, grouping.order, grouping.inverse)
        positions = token_positions.index_select(0, grouping.order)
        if group is None:
            grouped_out = executor.run(core, step, ctx, rows, grouping, positions)
        else:
            received = exchange_rows(rows, grouping, positions, L, group)
            if received.rows.shape[0] == 0:  # nothing routed here: the (empty) rows keep the exchange's graph
                grouped_out = received.send_back(received.rows)
            else:
                per_rank = L // torch.distributed.get_world_size(group)
                first = torch.distributed.get_rank(group) * per_rank
                arrived, arrived_groups = received.rows, received.grouping
                out = executor.run(
                    core,
                    step,
                    ctx,
                    arrived,
                    arrived_groups,
                    received.positions,
                    first_block=first,
                    counts=received.counts,
                )
                grouped_out = received.send_back(out)
    block_out = permute_rows(grouped_out, grouping.inverse, grouping.order)
    if truncation == "frozen":
        with torch.no_grad():
            update = gate.to(flat.dtype).unsqueeze(1) * (block_out - flat)
        return flat + update  # outside no_grad: the states keep their identity path
    keep = truncation_keep(windows, True) if truncation == "first" else None
    return gated_combine(flat, block_out, gate, keep)
