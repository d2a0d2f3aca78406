"""The routed depth's gated update with the combine as one fused C loop each way.

Same result as the per-block executor's update (:func:`megatron_lol.model.executors.routed_update`:
per-block calls, then the gated combine in token order): values bit for bit
(the C loop rounds as torch's separate operations do), gradients equal up to
the summation order of the gate's dot products. It applies to float32 states
on the CPU when the grouping covers every token of the depth (so every row is
written exactly once); otherwise :func:`fused_gated_update` returns None and
the caller runs the generic update.

Forward: the blocks read their rows from one gather with an output per block
(:class:`_GatherBlocks`, whose backward writes each block's gradient rows in
place: no ``cat``), and :class:`_FusedGatedCombine` writes ``s + alpha *
(E(s) - s)`` straight into token order. Backward, one C pass gives the block
outputs' gradients, the direct gradient of ``s`` and the gate's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megatron_lol.backends.cpu.kernels import routing_kernels


def fused_gated_update(states: torch.Tensor, grouping, window_gate: torch.Tensor, run_block) -> Optional[torch.Tensor]:
    """``s + alpha (E(s) - s)`` through the C kernels, or None where they do not apply.

    ``grouping``: a :class:`~megatron_lol.model.executors.HostGroups` (token ``order``, window
    ``segments``, host ``counts`` per block); ``run_block(block, rows, segments, token_index)``."""
    if not (
        states.device.type == "cpu"
        and states.dtype == torch.float32
        and states.dim() == 2
        and states.shape[0] > 0
        and window_gate.dtype == torch.float32
        and grouping.covers_all
        and grouping.order.numel() == states.shape[0]
    ):
        return None
    kernels = routing_kernels()
    if kernels is None:
        return None
    spans = list(grouping.slices())
    counts = [hi - lo for _, lo, hi in spans]
    if torch.is_grad_enabled() and states.requires_grad:
        pieces = list(_GatherBlocks.apply(states, grouping.order, counts))
    else:
        pieces = list(states.index_select(0, grouping.order).split(counts, dim=0))
    outputs = [
        run_block(block, piece, grouping.segments[lo:hi], grouping.order[lo:hi]).contiguous()
        for (block, lo, hi), piece in zip(spans, pieces)
    ]
    if any(out.dtype != states.dtype for out in outputs):
        return None  # not expected: blocks keep the dtype (the caller then runs the reference)
    return _FusedGatedCombine.apply(kernels, grouping, counts, states.contiguous(), window_gate.contiguous(), *outputs)


class _GatherBlocks(torch.autograd.Function):
    """``states[order]`` split into one output per block (``order`` a permutation of the rows).

    Forward is one ``index_select``; backward writes each block's gradient rows
    back in place (one ``index_copy_`` per block into an uninitialised buffer:
    every row is written once).
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
            rows = order[lo : lo + n]
            if grad is None:
                out.index_fill_(0, rows, 0)
            else:
                out.index_copy_(0, rows, grad)
            lo += n
        return out, None, None


class _FusedGatedCombine(torch.autograd.Function):
    """``states.index_add(0, order, alpha[segments] * (cat(outputs) - states[order]))`` in one C pass.

    Backward, also one pass: the outputs get ``alpha * g[order]``, the states
    ``g - alpha * g`` on the direct path (their rows' block-input gradients come
    through :class:`_GatherBlocks`), the gate the per-window sum of
    ``g . (E(s) - s)``.
    """

    @staticmethod
    def forward(ctx, kernels, grouping, counts, states, window_gate, *outputs):
        gate = window_gate.detach()
        new = kernels.gated_combine_forward(
            states.detach(), [o.detach() for o in outputs], counts, grouping.order, grouping.segments, gate
        )
        ctx.kernels, ctx.counts = kernels, counts
        ctx.num_windows = window_gate.shape[0]
        ctx.save_for_backward(grouping.order, grouping.segments, states, gate, *outputs)
        return new

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        order, segments, states, gate, *outputs = ctx.saved_tensors
        grad_outs, grad_states, gate_token = ctx.kernels.gated_combine_backward(
            grad.contiguous(), states, outputs, ctx.counts, order, segments, gate
        )
        grad_gate = None
        if ctx.needs_input_grad[4]:
            grad_gate = gate_token.new_zeros(ctx.num_windows).index_add_(0, segments, gate_token)
        return (None, None, None, grad_states, grad_gate) + tuple(grad_outs)
