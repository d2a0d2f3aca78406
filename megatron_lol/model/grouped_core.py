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
from typing import Optional, Sequence

import torch

from megatron_lol.model.attention import chunk_bias
from megatron_lol.model.core import CoreOutput, DepthRecord, ForcedPath
from megatron_lol.model.grouped_blocks import RowRope, grouped_blocks, grouped_support, stack_library
from megatron_lol.model.host_layout import HostLayout
from megatron_lol.model.precision import fp8_disabled
from megatron_lol.model.static_routing import (decide, gated_combine, global_aux_loss, group_tokens, permute_rows,
                                               record_loads, router_summaries, sequence_aux_loss, token_gates,
                                               truncation_keep, window_loads)


def grouped_core_support(core) -> Optional[str]:
    """Why ``core`` cannot run grouped (one line), or None when it can."""
    from megatron_lol.model.core import _expert_parallel

    plan = core.plan
    if not plan.routed or any(not step.routed for step in plan.steps()):
        return f"plan {plan.name!r} has fixed steps (only routed LoL depths run grouped)"
    if _expert_parallel()[0] > 1:
        return "expert parallelism (windows travel to their block's rank: the reference dispatch)"
    ids = core.local_block_ids()
    if ids != list(range(plan.num_stored_blocks)):
        return "this rank holds only part of the library"
    return grouped_support([core.block(i) for i in ids])


def _forced_on(forced: Optional[ForcedPath], device) -> Optional[ForcedPath]:
    if forced is None:
        return None
    return ForcedPath(ids=forced.ids.to(device, non_blocking=True), gates=forced.gates.to(device, non_blocking=True))


def grouped_core_forward(core, states: torch.Tensor, layout: HostLayout, rope: Optional[torch.Tensor],
                         steps: Sequence, *, depth: int, forced: Optional[ForcedPath] = None, record: bool = False,
                         backprop_depth: Optional[int] = None, first_window_full_backprop: bool = True) -> CoreOutput:
    """:meth:`Core.forward <megatron_lol.model.core.Core.forward>` of the routed ``steps`` of ``core``.

    ``states``: ``[s, b, h]`` (local layout) or the packed stream ``[b*s, 1, h]``;
    ``layout``: the micro-batch's :class:`HostLayout` on the states' device
    (router noise from its seeds; without them a training forward draws the
    noise from the global RNG); ``rope``: megatron's RoPE angles ``[s, 1, 1, c]``.
    RoPE positions are row positions on the local layout and positions inside
    the window on the packed one, as the reference's attention applies them.
    """
    from megatron_lol.backends import select_backend

    backend = select_backend(states.device)
    context = backend.core_context(core._needs_device_mode()) if backend is not None else contextlib.nullcontext()
    with context:
        return _forward(core, states, layout, rope, steps, depth, _forced_on(forced, states.device), record,
                        backprop_depth, first_window_full_backprop)


def _forward(core, states, layout, rope, steps, depth, forced, record, backprop_depth, first_window_full) -> CoreOutput:
    cfg, plan = core.cfg, core.plan
    num_blocks, window = plan.num_stored_blocks, cfg.window_size
    s_len, b, h = states.shape
    flat = states.transpose(0, 1).reshape(b * s_len, h)
    injected_from = flat
    t = flat.shape[0]
    library = stack_library([core.block(i) for i in range(num_blocks)])  # once per micro-batch
    row_positions = None if core.packed else torch.arange(t, device=flat.device) % layout.row_length
    out = CoreOutput(states=states)
    aux_terms, loads = [], []
    for step in steps:
        if not step.routed:
            raise ValueError(f"grouped_core_forward: step {step} is not routed (see grouped_core_support)")
        if cfg.input_injection:
            mix = torch.sigmoid(core.injection_logit)
            flat = mix * flat + (1 - mix) * injected_from
        truncated = (backprop_depth is not None and core.training and torch.is_grad_enabled()
                     and step.depth <= depth - backprop_depth)
        windows = layout.for_depth(step.depth)
        router = core.router_for(step.depth)
        summaries = router_summaries(windows, flat, core.depth_vectors[step.depth - 1])
        eps = layout.noise.get(step.depth) if core.training and router.noise else None
        bias = core.balancer.for_depth(step.depth) if core.balancer is not None else None
        with fp8_disabled(core.tconfig):  # the router stays FP32 (it is no TE module either)
            decision = decide(router, summaries, eps, bias, forced, step.depth, windows)
        counts = window_loads(windows, decision.choice.detach(), num_blocks)
        if core.training:
            if core.balancer is not None:
                record_loads(core.balancer, step.depth, counts)
            if cfg.balancing == "loss_free" and cfg.seq_aux_loss_coeff > 0:
                aux_terms.append(cfg.seq_aux_loss_coeff * sequence_aux_loss(windows, decision)
                                 / layout.doc_count.clamp(min=1))
            elif cfg.balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
                aux_terms.append(cfg.aux_loss_coeff * global_aux_loss(windows, decision))
        loads.append((step.depth, counts))
        if record:
            n = windows.num_windows
            out.records.append(DepthRecord(step.depth, decision.choice.detach()[:n], decision.gate.detach()[:n],
                                           decision.probs.detach()[:n], windows.window_doc[:n],
                                           windows.window_ordinal[:n]))

        grouping = group_tokens(decision.choice.index_select(0, windows.token_window), windows.token_window,
                                num_blocks)
        positions = windows.token_position if core.packed else row_positions
        row_rope = (RowRope.from_table(rope, positions.index_select(0, grouping.order), flat.dtype)
                    if rope is not None else None)
        mask = chunk_bias(grouping.segments, window, [0], [t])
        # [2, h] per depth, [L, 2, h] per (depth, block)
        film = None if cfg.film == "off" else (core.film_gamma[step.depth - 1], core.film_beta[step.depth - 1])
        gate = token_gates(windows, decision.gate)
        keep = truncation_keep(windows, first_window_full) if truncated else None
        frozen = truncated and keep is None
        with torch.no_grad() if frozen else contextlib.nullcontext():
            grouped = grouped_blocks(library, permute_rows(flat, grouping.order, grouping.inverse), grouping,
                                     row_rope, mask, window, film)
            block_out = permute_rows(grouped, grouping.inverse, grouping.order)
        if frozen:  # no token of this depth keeps a gradient: the update is a constant
            with torch.no_grad():
                update = gate.to(flat.dtype).unsqueeze(1) * (block_out - flat)
            flat = flat + update
        else:
            flat = gated_combine(flat, block_out, gate, keep)
    out.states = flat.view(b, s_len, h).transpose(0, 1).contiguous()
    if aux_terms:
        out.aux_loss = torch.stack(aux_terms).sum()
    out.block_loads = torch.zeros(plan.depth, num_blocks, dtype=torch.long, device=flat.device)
    for l, row in loads:
        out.block_loads[l - 1] = row
    return out
