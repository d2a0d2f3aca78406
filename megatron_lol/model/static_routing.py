"""A routed depth's routing, the one implementation every device and layout runs.

Summaries, decision, grouping, combine and balancing of a routed depth
(docs/model.md, "Router", "Windows are packed sequences", "Load balancing"),
on the :class:`~.host_layout.DepthWindows` of the micro-batch's host-built
layout. How the blocks then run on the grouped rows is an executor's business
(:mod:`.executors`). Nothing here reads a value back to the host (no
``.item()``, ``.tolist()``, ``nonzero``, ``bincount``, boolean-mask indexing,
``one_hot``'s range check): every shape is the layout's (tokens ``T``, window
capacity ``C``, blocks ``L``), so a GPU step stays queued ahead of the device
and the functions compile with ``torch.compile(fullgraph=True)``.

Reductions that decide routes, or produce gradients that replicated ranks
must agree on, are ordered: segment sums over contiguous runs
(``torch.segment_reduce``, one sequential sum per segment) and gathers, never
``index_add_`` / ``scatter_add_`` with repeated indices, whose floating-point
result depends on the order of atomic adds on CUDA. Window sums are a padded
layout summed along its rows (:func:`~.windows.segment_means`), the
per-document prefix over windows a doubling scan that restarts at each
document (:func:`~.windows.document_prefix_means`), and the router-only term
a segmented scan too (:func:`router_only_prefix_means`): no
floating-point ``cumsum`` (tests/test_routing_determinism.py checks this path).
Every sum over rows accumulates in FP32 whatever the dtype of the rows
(:func:`segment_sum`).

Padding windows (``window_valid`` false) hold no token; their choice is
never used, and they count in no load or loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megatron_lol.model.host_layout import DepthWindows
from megatron_lol.model.router import RoutingDecision, choose_blocks
from megatron_lol.model.windows import document_prefix_means, segment_means, segmented_inclusive_sum


def segment_sum(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sums of the rows ``x[offsets[i]:offsets[i+1]]`` in row order (``len(offsets) - 1`` rows; empty
    segments are 0), accumulated in FP32 and returned in ``x``'s dtype.

    ``torch.segment_reduce`` accumulates in its input's dtype on CPU and CUDA alike: a
    segment of 4,096 BF16 gradients of 0.008 sums to 4.0 instead of 32.75, and a block
    sees thousands of rows per depth. So the rows are widened to FP32 first (one FP32
    copy of ``x``) and only the ``len(offsets) - 1`` sums are rounded back.
    ``unsafe``: the offsets are not checked, which would read them back.
    """
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return torch.segment_reduce(wide, "sum", offsets=offsets, axis=0, unsafe=True).to(x.dtype)


class _GatherSegmentRows(torch.autograd.Function):
    """``table[rows]`` where ``rows`` is sorted into the segments ``offsets``: the backward sums each
    segment's gradient rows in order (a segment sum, not an ``index_add_`` of repeated indices)."""

    @staticmethod
    def forward(ctx, table, rows, offsets):
        ctx.save_for_backward(offsets)
        return table.index_select(0, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return segment_sum(grad.contiguous(), offsets), None, None


def gather_segment_rows(table: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``table[rows]`` with an ordered backward; ``rows[offsets[i]:offsets[i+1]]`` must all be ``i``."""
    return _GatherSegmentRows.apply(table, rows, offsets)


class _Permute(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` whose inverse is known: the backward is a gather too."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[order]`` (``inverse[order[i]] = i``), gradient by ``grad[inverse]``: no scatter either way."""
    return _Permute.apply(x, order, inverse)


# ------------------------------------------------------------------ router inputs
class _WindowInputs(torch.autograd.Function):
    """``(window means, first-token rows)`` of ``states``, both fp32 ``[C, h]``.

    Forward: ordered window sums (a padded ``[C, max_length, h]``
    layout summed along its rows, :func:`~.windows.segment_means`). Backward: the
    means' gradient divided by the lengths, gathered to the tokens, plus the
    first rows' gradient at first tokens (a gather as well): one dense buffer.
    """

    @staticmethod
    def forward(ctx, states, window_length, first_token, token_window, token_is_first, max_length):
        lengths = window_length.clamp(min=1).unsqueeze(1).to(torch.float32)
        ctx.save_for_backward(lengths, token_window, token_is_first)
        ctx.dtype = states.dtype
        # ordered sums (windows.segment_means): the same bits on every rank, so the same routes
        means = segment_means(states, first_token, window_length, max_length)
        means = torch.where(window_length.unsqueeze(1) > 0, means, torch.zeros_like(means))  # padding: 0, not 0/0
        return means, states.index_select(0, first_token).float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_means, grad_first):
        lengths, token_window, token_is_first = ctx.saved_tensors
        grad = (grad_means / lengths).index_select(0, token_window)
        if grad_first is not None:
            first = grad_first.index_select(0, token_window)
            grad = grad + torch.where(token_is_first.unsqueeze(1), first, torch.zeros_like(first))
        return grad.to(ctx.dtype), None, None, None, None, None


def window_inputs(windows: DepthWindows, states: torch.Tensor) -> tuple:
    """Window means ``mu_j`` and first-token rows of the depth's input ``states`` ``[T, h]``, fp32 ``[C, h]``."""
    return _WindowInputs.apply(
        states,
        windows.window_length,
        windows.window_first_token,
        windows.token_window,
        windows.token_is_first,
        windows.max_length,
    )


def prefix_means(windows: DepthWindows, means: torch.Tensor) -> torch.Tensor:
    """``r_k`` of every window (fp32 ``[C, h]``): :func:`~.windows.document_prefix_means`, the one
    implementation every layout uses (padding windows have ordinal 0 and mean 0: their prefix is 0)."""
    return document_prefix_means(means, windows.window_ordinal, windows.ordinal_bound)


def router_summaries(windows: DepthWindows, states: torch.Tensor, depth_vector: torch.Tensor) -> torch.Tensor:
    """``r_k`` for every window (``r_0 = (e^(l) + s_first) / 2``), fp32 ``[C, h]``, from the depth's input."""
    means, first = window_inputs(windows, states)
    summaries = prefix_means(windows, means)
    r0 = 0.5 * (depth_vector.float().unsqueeze(0) + first)
    return torch.where((windows.window_ordinal == 0).unsqueeze(1), r0, summaries)


def depth_only_summaries(windows: DepthWindows, depth_vector: torch.Tensor) -> torch.Tensor:
    """``r = e^(l)`` for every window (``router_input: depth``), fp32 ``[C, h]``.

    The route then depends on the depth alone (plus training noise): the same library, masks,
    FiLM and growth schedule on a learned route that does not read the input, the control that
    tells input adaptivity apart from the rest of the architecture.
    """
    return depth_vector.float().unsqueeze(0).expand(windows.capacity, -1)


def router_only_prefix_means(
    embeddings: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, bound: int
) -> torch.Tensor:
    """Per token ``t`` of a row-major stream: the mean router embedding of the router-only tokens of
    ``t``'s document at positions up to and including ``t`` (zero where there is none), fp32 ``[T, h]``.

    ``index`` [T]: each token's row of ``embeddings`` ``[n, h]``, -1 for an ordinary token;
    ``positions`` [T]: position in the document; ``bound``: an upper bound of a position + 1 (the
    row length). Sums and counts are one running sum per document that restarts at position 0
    (:func:`~.windows.segmented_inclusive_sum`), and the embeddings' gradient is an ordered sum per
    embedding (:func:`gather_rows`): a fixed order, no atomics and no floating-point ``cumsum``, the
    same bits on every rank and device.
    """
    is_ro = index >= 0
    rows = gather_rows(embeddings.float(), index.clamp(min=0), embeddings.shape[0])
    rows = torch.where(is_ro.unsqueeze(1), rows, 0.0)
    both = segmented_inclusive_sum(torch.cat([rows, is_ro.to(torch.float32).unsqueeze(1)], dim=1), positions, bound)
    sums, counts = both[:, :-1], both[:, -1:]
    return sums / counts.clamp(min=1.0)


def gather_rows(table: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``table[index]`` whose backward sums each table row's gradients in order: the indices sorted
    (stably), the gathered gradients summed per row (:func:`gather_segment_rows`), not an
    ``index_add_`` of repeated indices. ``num_rows``: ``table``'s rows (a shape, no read)."""
    sorted_index, order = torch.sort(index, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    offsets = torch.searchsorted(sorted_index, torch.arange(num_rows + 1, device=index.device))
    return permute_rows(gather_segment_rows(table, sorted_index, offsets), inverse, order)


class _GatherBackward(torch.autograd.Function):
    """A function of one differentiable input (and three tensors that are not) whose backward is a
    gather: input row ``i`` takes the output gradient's row ``index[i]`` where ``keep[i]``, else 0.
    A subclass's ``forward`` saves ``(index, keep)``. Each input row takes one output row: no sum,
    so no ordering to keep."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        index, keep = ctx.saved_tensors
        rows = grad.index_select(0, index)
        return torch.where(keep.unsqueeze(1), rows, torch.zeros_like(rows)), None, None, None


class _FirstTokenRows(_GatherBackward):
    """``per_token[first_token]`` ``[C, h]``; backward: each window's first token takes its window's
    gradient (real windows' first tokens are distinct; padding windows get none)."""

    @staticmethod
    def forward(ctx, per_token, first_token, token_window, token_is_first):
        ctx.save_for_backward(token_window, token_is_first)
        return per_token.index_select(0, first_token)


def with_router_only(windows: DepthWindows, summaries: torch.Tensor, router_only: Optional[torch.Tensor]):
    """The summaries plus the router-only term (:func:`router_only_prefix_means`, per token ``[T, h]``)
    read at each window's first token; ``router_only`` None: the summaries."""
    if router_only is None:
        return summaries
    term = _FirstTokenRows.apply(router_only, windows.window_first_token, windows.token_window, windows.token_is_first)
    return summaries + term


# ------------------------------------------------------------------ decision
def decide(
    router,
    summaries: torch.Tensor,
    eps: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    forced=None,
    depth: Optional[int] = None,
    windows: Optional[DepthWindows] = None,
) -> RoutingDecision:
    """Probabilities, top-1 choice and gate (:func:`~.router.choose_blocks`), then a forced path.

    ``eps`` ``[C, L]``: the layout's noise (None: the router draws it, training only).
    ``forced``: a :class:`~.core.ForcedPath` already on the device.
    """
    probs = router.probabilities(summaries, eps)
    choice, gate = choose_blocks(probs, bias)
    if forced is not None:
        is_forced, ids, gates = forced.lookup(depth, windows)
        choice = torch.where(is_forced, ids, choice)
        gate = torch.where(is_forced, gates.to(gate.dtype), gate)
    return RoutingDecision(probs=probs, choice=choice, gate=gate)


# ------------------------------------------------------------------ grouping
@dataclass
class TokenGrouping:
    """Tokens of a depth sorted by their window's block (stably: windows stay whole and in order).

    ``group_ends`` ``[L]`` int32 are ``torch._grouped_mm``'s offsets (rows of
    blocks ``0..m``); ``group_offsets`` ``[L + 1]`` start with 0 (segment sums).
    """

    order: torch.Tensor  # [T] long: token index of each grouped row
    inverse: torch.Tensor  # [T] long: grouped row of each token
    block_of_row: torch.Tensor  # [T] long
    segments: torch.Tensor  # [T] long: window of each grouped row
    group_ends: torch.Tensor  # [L] int32
    group_offsets: torch.Tensor  # [L + 1] long


def group_tokens(token_choice: torch.Tensor, token_window: torch.Tensor, num_blocks: int) -> TokenGrouping:
    """Stable sort of the tokens by block; group boundaries by ``searchsorted`` on the device."""
    block_of_row, order = torch.sort(token_choice, stable=True)
    t = order.shape[0]
    rows = torch.arange(t, device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, rows)  # a permutation: every slot written once
    ends = torch.searchsorted(block_of_row, torch.arange(num_blocks, device=order.device), right=True)
    return TokenGrouping(
        order=order,
        inverse=inverse,
        block_of_row=block_of_row,
        segments=token_window.index_select(0, order),
        group_ends=ends.to(torch.int32),
        group_offsets=torch.cat([ends.new_zeros(1), ends]),
    )


# ------------------------------------------------------------------ combine
class _ExpandWindows(torch.autograd.Function):
    """``window_values[token_window]`` (``[C]`` -> ``[T]``); backward: each window's ordered token sum."""

    @staticmethod
    def forward(ctx, values, token_window, cu_seqlens):
        ctx.save_for_backward(cu_seqlens)
        return values.index_select(0, token_window)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (cu_seqlens,) = ctx.saved_tensors
        return segment_sum(grad.contiguous(), cu_seqlens), None, None


def token_gates(windows: DepthWindows, window_gate: torch.Tensor) -> torch.Tensor:
    """``alpha`` of every token's window, ``[T]``, with an ordered gradient sum per window."""
    return _ExpandWindows.apply(window_gate, windows.token_window, windows.cu_seqlens)


def gated_combine(
    states: torch.Tensor, block_out: torch.Tensor, gate: torch.Tensor, keep: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``s + alpha (E(s) - s)`` in token order (``block_out`` = ``E(s)`` ``[T, h]``, ``gate`` ``[T]``).

    ``keep`` ``[T]`` bool (truncated backprop): elsewhere the update and the
    gate are constants for autograd, so those tokens keep only the identity
    path (the update computed under ``no_grad`` with a detached gate).
    """
    update = block_out - states
    gate = gate.to(states.dtype)
    if keep is not None:
        update = torch.where(keep.unsqueeze(1), update, update.detach())
        gate = torch.where(keep, gate, gate.detach())
    return states + gate.unsqueeze(1) * update


def truncation_keep(windows: DepthWindows, first_window_full_backprop: bool) -> Optional[torch.Tensor]:
    """Tokens of a truncated depth that keep their gradient: window-0 tokens, or none (None)."""
    if not first_window_full_backprop:
        return None
    return (windows.window_ordinal == 0).index_select(0, windows.token_window)


# ------------------------------------------------------------------ balancing
def window_loads(windows: DepthWindows, choice: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Windows per block ``[L]`` (long), each real window once: a comparison with ``arange(L)`` and a sum."""
    hits = choice.unsqueeze(1) == torch.arange(num_blocks, device=choice.device)
    return (hits & windows.window_valid.unsqueeze(1)).sum(dim=0)


class _DocumentSums(_GatherBackward):
    """Ordered sums of the windows of each document, ``[C, L]`` (documents padded to ``C``);
    backward: each window gets its document's gradient (padding windows: none)."""

    @staticmethod
    def forward(ctx, values, doc_offsets, window_doc, window_valid):
        ctx.save_for_backward(window_doc, window_valid)
        return segment_sum(values, doc_offsets)


def sequence_aux_loss(windows: DepthWindows, decision: RoutingDecision) -> torch.Tensor:
    """Per document ``L * sum_m f_m * abar_m``, summed over documents (the caller averages).

    As :func:`~.balancing.sequence_aux_loss`, with per-document ordered sums
    over each document's contiguous windows instead of ``index_add_``.
    """
    num_blocks = decision.probs.shape[1]
    offsets = windows.doc_window_offsets
    hits = (decision.choice.unsqueeze(1) == torch.arange(num_blocks, device=offsets.device)).to(torch.float32)
    chosen = segment_sum(hits, offsets)
    prob_sum = _DocumentSums.apply(decision.probs.float(), offsets, windows.window_doc, windows.window_valid)
    counts = (offsets[1:] - offsets[:-1]).clamp(min=1).unsqueeze(1).to(torch.float32)
    return num_blocks * ((chosen / counts) * (prob_sum / counts)).sum()


def global_aux_loss(windows: DepthWindows, decision: RoutingDecision) -> torch.Tensor:
    """``L * sum_m f_m * abar_m`` over the real windows of the micro-batch at one depth."""
    num_blocks = decision.probs.shape[1]
    valid = windows.window_valid.unsqueeze(1)
    n = windows.window_valid.sum().to(torch.float32)
    f = window_loads(windows, decision.choice, num_blocks).to(torch.float32) / n
    abar = torch.where(valid, decision.probs.float(), torch.zeros_like(decision.probs, dtype=torch.float32)).sum(0) / n
    return num_blocks * (f * abar).sum()
