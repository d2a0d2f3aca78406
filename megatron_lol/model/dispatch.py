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

Few passes over ``[T, h]`` (on CPU each costs about as much as a small GEMM):
the packed stream is one ``index_select`` whose backward is an ``index_select``
with the inverse permutation (no zero-filled gradient, no scatter), each block
reads a ``split`` view of it (one ``cat`` in the backward, not a zero-filled
full-size gradient per block), and :func:`run_grouped_gated` writes every
block's ``E(s) - s`` into one buffer and adds ``alpha`` times it back with one
``index_add`` (instead of concatenating the outputs, scattering into zeros and
multiply-adding). Values and gradients are those of the plain formulation bit
for bit (same operations on the same operands, summed in the same order).

On CPU, for float32 states and a plan covering every token, the gated combine
is one fused C loop each way instead (:mod:`megatron_lol.kernels.cpu`): the
blocks read their rows from one gather with a per-block output (whose
backward writes each block's rows in place: no ``cat``), and the combine writes ``s + alpha * (E(s) - s)`` straight into
token order and, backward, the block outputs' gradients, the direct gradient
of ``s`` and the gate's in one pass. Values are bit for bit the torch path's;
gradients equal it up to the summation order of the gate's dot products and
of the state's gradient contributions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.autograd.function import once_differentiable


@dataclass
class DispatchPlan:
    order: torch.Tensor  # [T'] flat token indices, grouped by block
    counts: list[int]  # tokens per block, len L
    segments: torch.Tensor  # [T'] window id of each packed token
    # [T] position of each flat token in ``order`` when the plan covers every token (a permutation)
    inverse: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
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
    inverse = None
    if idx is None:  # a permutation of all tokens: its inverse makes the gather's backward a gather too
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
    return DispatchPlan(order=order, counts=counts, segments=token_window.index_select(0, order),
                        inverse=inverse)


class _GatherRows(torch.autograd.Function):
    """``states.index_select(0, order)`` for unique ``order``, with a cheap backward.

    The backward puts each row's gradient back in place: with the inverse
    permutation (a plan covering every token) that is one ``index_select``;
    otherwise rows not gathered get zeros. (Autograd's own backward of a
    gather zero-fills ``[T, h]`` and scatter-adds into it.)
    """

    @staticmethod
    def forward(ctx, states, order, inverse):
        ctx.save_for_backward(order, inverse)
        ctx.num_rows = states.shape[0]
        return states.index_select(0, order)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        order, inverse = ctx.saved_tensors
        if inverse is not None:
            return grad.index_select(0, inverse), None, None
        out = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        return out.index_copy(0, order, grad), None, None


def gather_planned(plan: DispatchPlan, states: torch.Tensor) -> torch.Tensor:
    """The packed stream ``states[plan.order]`` (differentiable; see :class:`_GatherRows`)."""
    inverse = plan.inverse if plan.inverse is not None and plan.inverse.numel() == states.shape[0] else None
    if not (torch.is_grad_enabled() and states.requires_grad):
        return states.index_select(0, plan.order)
    return _GatherRows.apply(states, plan.order, inverse)


BlockCall = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _call_blocks(plan: DispatchPlan, packed: torch.Tensor, call_block: BlockCall) -> list:
    """Each block once on its slice of the packed stream; their outputs, in plan order."""
    # split views: their backward is one cat (slicing would zero-fill a full-size gradient per block)
    pieces = packed.split(plan.counts, dim=0)
    return _call_block_pieces(plan, [pieces[block] for block, _, _ in plan.slices()], call_block)


def _call_block_pieces(plan: DispatchPlan, pieces: list, call_block: BlockCall) -> list:
    """Block ``b`` of each used slice on ``pieces[i]`` (its rows, in plan order); their outputs."""
    outputs = []
    previous = current_slice()
    try:
        for (block, lo, hi), piece in zip(plan.slices(), pieces):
            _ACTIVE.slice = (plan, block, lo, hi)
            outputs.append(call_block(block, piece, plan.segments[lo:hi], plan.order[lo:hi]))
    finally:
        _ACTIVE.slice = previous
    return outputs


def run_grouped(plan: DispatchPlan, states: torch.Tensor, call_block: BlockCall) -> torch.Tensor:
    """Return the block updates ``E(s) - s`` of the planned tokens, in ``plan.order`` order.

    ``call_block(block, packed [T_m, h], segments [T_m], flat token indices [T_m])``
    runs block ``block`` on its packed windows and returns its output.
    """
    packed = gather_planned(plan, states)
    outputs = _call_blocks(plan, packed, call_block)
    if not outputs:
        return packed.new_zeros(packed.shape)
    # one subtraction for the whole depth (the slices tile ``packed``)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return out - packed


def scatter_updates(plan: DispatchPlan, updates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Put packed updates back in flat token order (zeros for tokens not in the plan)."""
    out = updates.new_zeros(num_tokens, updates.shape[-1])
    return out.index_copy(0, plan.order, updates)


def run_grouped_gated(plan: DispatchPlan, states: torch.Tensor, call_block: BlockCall,
                      window_gate: torch.Tensor) -> torch.Tensor:
    """The depth's new states: ``s + alpha * (E(s) - s)`` for the planned tokens, ``s`` elsewhere.

    The same values as ``apply_gated_updates(states, plan, run_grouped(plan, states, call_block),
    window_gate)``, bit for bit, gradients included; the block outputs are not
    concatenated first (each block's ``E(s) - s`` is written into one buffer).
    """
    kernels = _fused_kernels(plan, states, window_gate)
    if kernels is not None:
        return _run_fused(kernels, plan, states, call_block, window_gate)
    packed = gather_planned(plan, states)
    outputs = _call_blocks(plan, packed, call_block)
    if any(out.dtype != packed.dtype for out in outputs):  # not expected: blocks keep the dtype
        updates = (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)) - packed
        return apply_gated_updates(states, plan, updates, window_gate)
    return _GatedCombine.apply(plan, states, packed, window_gate, *outputs)


class _GatedCombine(torch.autograd.Function):
    """``states.index_add(0, order, alpha[segments] * (cat(outputs) - packed))`` without the ``cat``.

    Forward and backward are the operations autograd would run for that
    expression, in the same order (so the same values bit for bit): the
    backward gives ``states`` the incoming gradient, ``packed`` minus the
    outputs' gradient, each block output its slice of ``alpha *`` the gathered
    gradient, and the gate the per-token ``sum`` of gradient times update,
    summed per window.
    """

    @staticmethod
    def forward(ctx, plan, states, packed, window_gate, *outputs):
        gate = window_gate.index_select(0, plan.segments).unsqueeze(1).to(states.dtype)
        updates = torch.empty_like(packed)
        spans = [(lo, hi) for _, lo, hi in plan.slices()]
        for (lo, hi), out in zip(spans, outputs):
            torch.sub(out, packed[lo:hi], out=updates[lo:hi])
        ctx.save_for_backward(plan.order, plan.segments, gate, updates)
        ctx.spans = spans
        ctx.gate_dtype = window_gate.dtype
        ctx.num_windows = window_gate.shape[0]
        return states.index_add(0, plan.order, gate * updates)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        order, segments, gate, updates = ctx.saved_tensors
        grad_src = grad.index_select(0, order)
        grad_updates = grad_src * gate
        grad_gate = None
        if ctx.needs_input_grad[3]:
            per_token = (grad_src * updates).sum_to_size(gate.shape).to(ctx.gate_dtype).squeeze(1)
            grad_gate = per_token.new_zeros(ctx.num_windows).index_add_(0, segments, per_token)
        grad_packed = -grad_updates if ctx.needs_input_grad[2] else None
        grad_outputs = tuple(grad_updates[lo:hi] for lo, hi in ctx.spans)
        return (None, grad, grad_packed, grad_gate) + grad_outputs


def _fused_kernels(plan: DispatchPlan, states: torch.Tensor, window_gate: torch.Tensor):
    """The CPU kernels when they apply (float32 CPU states, a plan covering every token), else None."""
    if not (states.device.type == "cpu" and states.dtype == torch.float32 and states.dim() == 2
            and states.shape[0] > 0 and window_gate.dtype == torch.float32 and plan.inverse is not None
            and plan.inverse.numel() == states.shape[0]):
        return None
    from megatron_lol.kernels.cpu import routing_kernels

    return routing_kernels()


def _run_fused(kernels, plan: DispatchPlan, states: torch.Tensor, call_block: BlockCall,
               window_gate: torch.Tensor) -> torch.Tensor:
    counts = [hi - lo for _, lo, hi in plan.slices()]
    if torch.is_grad_enabled() and states.requires_grad:
        pieces = list(_GatherBlocks.apply(states, plan.order, counts))
    else:
        pieces = list(states.index_select(0, plan.order).split(counts, dim=0))
    outputs = [out.contiguous() for out in _call_block_pieces(plan, pieces, call_block)]
    if any(out.dtype != states.dtype for out in outputs):  # not expected: blocks keep the dtype
        updates = torch.cat(outputs, dim=0) - torch.cat(pieces, dim=0)
        return apply_gated_updates(states, plan, updates, window_gate)
    return _FusedGatedCombine.apply(kernels, plan, counts, states.contiguous(), window_gate.contiguous(), *outputs)


class _GatherBlocks(torch.autograd.Function):
    """``states[order]`` split into one output per block (``order`` a permutation of the rows).

    Forward is one ``index_select``; backward writes each block's gradient rows
    back in place (one ``index_copy_`` per block into an uninitialised buffer:
    every row is written once), with no ``cat`` of the blocks' gradients first.
    """

    @staticmethod
    def forward(ctx, states, order, counts):
        ctx.save_for_backward(order)
        ctx.counts = counts
        ctx.shape, ctx.dtype = states.shape, states.dtype
        return tuple(states.index_select(0, order).split(counts, dim=0))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        (order,) = ctx.saved_tensors
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=order.device)
        lo = 0
        for grad, n in zip(grads, ctx.counts):
            rows = order[lo:lo + n]
            if grad is None:
                out.index_fill_(0, rows, 0)
            else:
                out.index_copy_(0, rows, grad)
            lo += n
        return out, None, None


class _FusedGatedCombine(torch.autograd.Function):
    """``states.index_add(0, order, alpha[segments] * (cat(outputs) - states[order]))`` in one C pass.

    Same values as :class:`_GatedCombine` bit for bit (see ``routing_cpu.c``).
    Backward, also one pass: the outputs get ``alpha * g[order]``, the states
    ``g - alpha * g`` on the direct path (their rows' block-input gradients come
    through :class:`_GatherBlocks`), the gate the per-window sum of
    ``g . (E(s) - s)``.
    """

    @staticmethod
    def forward(ctx, kernels, plan, counts, states, window_gate, *outputs):
        gate = window_gate.detach()
        new = kernels.gated_combine_forward(states.detach(), [o.detach() for o in outputs], counts,
                                            plan.order, plan.segments, gate)
        ctx.kernels, ctx.counts = kernels, counts
        ctx.num_windows = window_gate.shape[0]
        ctx.save_for_backward(plan.order, plan.segments, states, gate, *outputs)
        return new

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        order, segments, states, gate, *outputs = ctx.saved_tensors
        grad_outs, grad_states, gate_token = ctx.kernels.gated_combine_backward(
            grad.contiguous(), states, outputs, ctx.counts, order, segments, gate)
        grad_gate = None
        if ctx.needs_input_grad[4]:
            grad_gate = gate_token.new_zeros(ctx.num_windows).index_add_(0, segments, gate_token)
        return (None, None, None, grad_states, grad_gate) + tuple(grad_outs)


def apply_gated_updates(states: torch.Tensor, plan: DispatchPlan, updates: torch.Tensor,
                        window_gate: torch.Tensor) -> torch.Tensor:
    """``s + alpha * (E(s) - s)`` for the planned tokens, ``s`` for the others.

    ``updates``: ``E(s) - s`` in ``plan.order`` order (from :func:`run_grouped`);
    ``window_gate``: ``alpha`` per window (indexed by ``plan.segments``). Each
    token gets one ``index_add`` of ``alpha * update`` (the same rounding as
    ``s + alpha * scatter(updates)``); the backward is the identity for
    ``states`` and one gather for ``updates`` and the gate.
    """
    gate = window_gate.index_select(0, plan.segments).unsqueeze(1).to(states.dtype)
    return states.index_add(0, plan.order, gate * updates)
