"""The routed core of a LoL model shaped for GPUs: no host reads, one grouped computation per depth.

For every routed step this computes what :meth:`~.core.Core.forward` computes
(docs/model.md, "The routed core"): input injection, the router's summaries,
choice and gate (or a forced path), the balancing loads and losses, and the
gated update ``s_I <- s_I + alpha (E_rho(s_I) - s_I)``, with truncated
backprop through depth. It reads the windows from a host-built
:class:`~.host_layout.HostLayout` (already on the device), routes with
:mod:`.static_routing` and runs all blocks of a depth as one computation
(:mod:`.grouped_blocks`): no device-to-host read anywhere in the forward or
backward, and a number of operations per depth that does not grow with ``L``.

:func:`grouped_core_support` says when it applies (a LoL plan whose blocks
:func:`~.grouped_blocks.grouped_support` accepts, without expert parallelism);
elsewhere the reference core runs. The per-block reference stays the
definition: the tests compare this against it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_lol.model.attention import chunk_bias
from megatron_lol.model.core import CoreOutput, DepthRecord, ForcedPath
from megatron_lol.model.grouped_blocks import RowRope, grouped_blocks, grouped_support, stack_library
from megatron_lol.model.host_layout import HostLayout
from megatron_lol.model.precision import fp8_disabled
from megatron_lol.model.static_routing import (
    TokenGrouping,
    decide,
    gated_combine,
    global_aux_loss,
    group_tokens,
    permute_rows,
    record_loads,
    router_summaries,
    sequence_aux_loss,
    token_gates,
    truncation_keep,
    window_loads,
)


def grouped_core_support(core) -> Optional[str]:
    """Why ``core`` cannot run grouped (one line), or None when it can."""
    from megatron_lol.model.core import _expert_parallel

    plan = core.plan
    if not plan.routed or any(not step.routed for step in plan.steps()):
        return f"plan {plan.name!r} has fixed steps (only routed LoL depths run grouped)"
    if _expert_parallel()[0] > 1:
        return "expert parallelism (windows travel to their block's rank: the reference dispatch)"
    if core.cfg.router_only_tokens:
        return "router_only_tokens (the grouped depth has no router-only term)"
    if core.cfg.router_input != "windows":
        return f"router_input: {core.cfg.router_input} (the grouped depth runs the window router)"
    ids = core.local_block_ids()
    if ids != list(range(plan.num_stored_blocks)):
        return "this rank holds only part of the library"
    return grouped_support([core.block(i) for i in ids])


def _forced_on(forced: Optional[ForcedPath], device) -> Optional[ForcedPath]:
    if forced is None:
        return None
    return ForcedPath(ids=forced.ids.to(device, non_blocking=True), gates=forced.gates.to(device, non_blocking=True))


def grouped_core_forward(
    core,
    states: torch.Tensor,
    layout: HostLayout,
    rope: Optional[torch.Tensor],
    steps: Sequence,
    *,
    depth: int,
    forced: Optional[ForcedPath] = None,
    record: bool = False,
    backprop_depth: Optional[int] = None,
    first_window_full_backprop: bool = True,
    routing_check=None,
) -> CoreOutput:
    """:meth:`Core.forward <megatron_lol.model.core.Core.forward>` of the routed ``steps`` of ``core``.

    ``states``: ``[s, b, h]`` (local layout) or the packed stream ``[b*s, 1, h]``;
    ``layout``: the micro-batch's :class:`HostLayout` on the states' device
    (router noise from its seeds; without them a training forward draws the
    noise from the global RNG); ``rope``: megatron's RoPE angles ``[s, 1, 1, c]``.
    RoPE positions are row positions on the local layout and positions inside
    the window on the packed one, as the reference's attention applies them.
    ``routing_check(depth, decision)``: the tensor-parallel agreement check, before the blocks run.
    """
    from megatron_lol.backends import select_backend

    backend = select_backend(states.device)
    context = backend.core_context(core) if backend is not None else contextlib.nullcontext()
    with context:
        return _forward(
            core,
            states,
            layout,
            rope,
            steps,
            depth=depth,
            forced=_forced_on(forced, states.device),
            record=record,
            backprop_depth=backprop_depth,
            first_window_full=first_window_full_backprop,
            routing_check=routing_check,
        )


def _forward(
    core, states, layout, rope, steps, *, depth, forced, record, backprop_depth, first_window_full, routing_check=None
) -> CoreOutput:
    cfg, plan = core.cfg, core.plan
    num_blocks, window = plan.num_stored_blocks, cfg.window_size
    s_len, b, h = states.shape
    flat = states.transpose(0, 1).reshape(b * s_len, h)
    injected_from = flat
    library = stack_library([core.block(i) for i in range(num_blocks)])  # once per micro-batch
    # RoPE positions: inside the window on the packed layout (THD restarts them), row positions otherwise
    row_positions = None if core.packed else torch.arange(flat.shape[0], device=flat.device) % layout.row_length
    out = CoreOutput(states=states)
    aux_terms, loads = [], []
    for step in steps:
        if not step.routed:
            raise ValueError(f"grouped_core_forward: step {step} is not routed (see grouped_core_support)")
        if cfg.input_injection:
            mix = torch.sigmoid(core.injection_logit)
            flat = mix * flat + (1 - mix) * injected_from
        truncated = (
            backprop_depth is not None
            and core.training
            and torch.is_grad_enabled()
            and step.depth <= depth - backprop_depth
        )
        windows = layout.for_depth(step.depth)
        positions = windows.token_position if core.packed else row_positions
        # [2, h] per depth, [L, 2, h] per (depth, block)
        film = None if cfg.film == "off" else (core.film_gamma[step.depth - 1], core.film_beta[step.depth - 1])
        router = core.router_for(step.depth)
        summaries = router_summaries(windows, flat, core.depth_vectors[step.depth - 1])
        eps = layout.noise.get(step.depth) if core.training and router.noise else None
        bias = core.balancer.for_depth(step.depth) if core.balancer is not None else None
        with fp8_disabled(core.tconfig):  # the router stays FP32 (it is no TE module either)
            decision = decide(router, summaries, eps, bias, forced, step.depth, windows)
        if routing_check is not None:
            routing_check(step.depth, decision)
        counts = window_loads(windows, decision.choice.detach(), num_blocks)
        if core.training:
            if core.balancer is not None:
                record_loads(core.balancer, step.depth, counts)
            if cfg.balancing == "loss_free" and cfg.seq_aux_loss_coeff > 0:
                aux_terms.append(
                    cfg.seq_aux_loss_coeff * sequence_aux_loss(windows, decision) / layout.doc_count.clamp(min=1)
                )
            elif cfg.balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
                aux_terms.append(cfg.aux_loss_coeff * global_aux_loss(windows, decision))
        loads.append((step.depth, counts))
        if record:
            n = windows.num_windows
            out.records.append(
                DepthRecord(
                    step.depth,
                    decision.choice.detach()[:n],
                    decision.gate.detach()[:n],
                    decision.probs.detach()[:n],
                    windows.window_doc[:n],
                    windows.window_ordinal[:n],
                )
            )

        flat = apply_routed_update(
            flat,
            windows,
            decision,
            library,
            rope,
            positions,
            film=film,
            window_size=window,
            truncation=truncation_mode(truncated, first_window_full),
        )
    out.states = flat.view(b, s_len, h).transpose(0, 1).contiguous()
    if aux_terms:
        out.aux_loss = torch.stack(aux_terms).sum()
    out.block_loads = torch.zeros(plan.depth, num_blocks, dtype=torch.long, device=flat.device)
    for l, row in loads:
        out.block_loads[l - 1] = row
    return out


def truncation_mode(truncated: bool, first_window_full_backprop: bool) -> Optional[str]:
    """None (full backprop), ``"first"`` (only window-0 tokens keep gradients) or ``"frozen"`` (none do)."""
    if not truncated:
        return None
    return "first" if first_window_full_backprop else "frozen"


@dataclass
class GroupedDepth:
    """A depth's tokens in grouped order, with what the grouped blocks and the combine need."""

    grouping: TokenGrouping
    rows: torch.Tensor  # [T, h] the depth's input in grouped order
    rope: Optional[RowRope]  # cos / sin of every grouped row
    attention_bias: torch.Tensor  # the chunked algorithm's mask of the grouped stream
    gate: torch.Tensor  # [T] every token's window gate (token order)


def group_depth(
    flat: torch.Tensor,
    windows,
    decision,
    num_blocks: int,
    rope: Optional[torch.Tensor],
    positions: torch.Tensor,
    window_size: int,
) -> GroupedDepth:
    """Group the tokens by the block their window chose (stable sort, offsets on the device)."""
    grouping = group_tokens(decision.choice.index_select(0, windows.token_window), windows.token_window, num_blocks)
    row_rope = (
        RowRope.from_table(rope, positions.index_select(0, grouping.order), flat.dtype) if rope is not None else None
    )
    return GroupedDepth(
        grouping=grouping,
        rows=permute_rows(flat, grouping.order, grouping.inverse),
        rope=row_rope,
        attention_bias=chunk_bias(grouping.segments, window_size, [0], [flat.shape[0]]),
        gate=token_gates(windows, decision.gate),
    )


def combine_depth(
    flat: torch.Tensor, grouped_out: torch.Tensor, depth: GroupedDepth, windows, truncation: Optional[str] = None
) -> torch.Tensor:
    """``s + alpha (E(s) - s)`` in token order from the blocks' grouped outputs ``E(s)``; with
    ``truncation="first"`` only window-0 tokens keep their gradients, with ``"frozen"`` none does
    (the update is a constant added to the states: :func:`truncation_mode`)."""
    block_out = permute_rows(grouped_out, depth.grouping.inverse, depth.grouping.order)
    if truncation == "frozen":
        with torch.no_grad():
            update = depth.gate.to(flat.dtype).unsqueeze(1) * (block_out - flat)
        return flat + update  # outside no_grad: the states keep their identity path
    keep = truncation_keep(windows, True) if truncation == "first" else None
    return gated_combine(flat, block_out, depth.gate, keep)


def apply_routed_update(
    flat: torch.Tensor,
    windows,
    decision,
    library,
    rope: Optional[torch.Tensor],
    positions: torch.Tensor,
    *,
    film: Optional[tuple],
    window_size: int,
    truncation: Optional[str] = None,
) -> torch.Tensor:
    """``s + alpha (E_rho(s) - s)`` of one depth: :func:`group_depth`, every block at once
    (:func:`~.grouped_blocks.grouped_blocks`), :func:`combine_depth`. Static shapes, no host read.

    ``flat`` ``[T, h]``: the depth's input; ``positions`` ``[T]``: RoPE positions per token;
    ``truncation``: see :func:`truncation_mode` (``"frozen"``: the whole update is a constant).
    """
    with torch.no_grad() if truncation == "frozen" else contextlib.nullcontext():
        depth = group_depth(flat, windows, decision, library.qkv.shape[0], rope, positions, window_size)
        grouped_out = grouped_blocks(
            library, depth.rows, depth.grouping, depth.rope, depth.attention_bias, window_size, film
        )
    return combine_depth(flat, grouped_out, depth, windows, truncation)
