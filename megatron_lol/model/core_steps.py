"""The steps of the core's loop: ``for step in steps: state = step.run(state, ctx)``.

:class:`~megatron_lol.model.core.Core` turns each :class:`~megatron_lol.plan.Step`
of the plan into one of the step classes here and runs them in order over a
:class:`CoreState`; what every step of one forward reads (documents, RoPE,
forcing, truncation, the backend) is one :class:`CoreContext`. A step is
Algorithm 1's body at depth ``l`` (docs/model.md, "The routed core"):

* the step's parts of the ``input`` hook (the optional diagonal input injection,
  ``s <- sig(theta) s + (1 - sig(theta)) s0``; :meth:`CoreStep.run`, shared by every kind);
* :class:`RoutedStep` (LoL): windows of depth ``l`` (from the host-built layout),
  the router's decision (or a forced path), balancing terms, then
  ``s_I <- s_I + alpha (E_rho(s_I) - s_I)`` with every block run once on all
  windows routed to it, by the core's executor (:mod:`.executors`);
* :class:`FixedStep` (dense, looped, Foil, Accordion): ``s <- E_b(s)`` with the
  step's attention (full, sliding, strided) and the pass's own parts.

The step classes are the extension point: a core uses ``Core.routed_step_class``
and ``Core.fixed_step_class``, so a variant (or a test's naive reference) swaps
one kind's update without touching the loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.executors import routed_update
from megatron_lol.model.forward_options import ForwardOptions
from megatron_lol.model.host_layout import DepthWindows
from megatron_lol.model.precision import fp8_disabled
from megatron_lol.model.router import RoutingDecision
from megatron_lol.model.static_routing import (
    decide,
    depth_only_summaries,
    global_aux_loss,
    router_summaries,
    sequence_aux_loss,
    window_loads,
    with_router_only,
)
from megatron_lol.model.windows import DocumentLayout, WindowLayout
from megatron_lol.plan import Step
from megatron_lol.plan.windows import windows_of
from megatron_lol.platform.trace_ranges import trace_range


@dataclass
class DepthRecord:
    """Routing record of one depth: what every window chose and with what probabilities."""

    depth: int
    choice: torch.Tensor  # [N]
    gate: torch.Tensor  # [N]
    probs: Optional[torch.Tensor]  # [N, L]
    window_doc: torch.Tensor  # [N]
    window_ordinal: torch.Tensor  # [N]


@dataclass
class CoreContext:
    """What every step of one core forward reads; fixed for the forward.

    ``rope``: megatron's RoPE table ``[s, 1, 1, d]`` (row positions);
    ``token_rope``: the same angles per flat token ``[b*s, 1, 1, d]``, row-major.
    ``options``: the forward's :class:`~.forward_options.ForwardOptions` (depth, forced path,
    noise seeds, truncated backprop, records, routing check, host layout: the core fills it in
    when the caller brought none), read through the properties below. ``moe_records``: the list
    MoE block calls append to (None: not recorded).
    """

    docs: DocumentLayout
    rope: Optional[torch.Tensor]
    token_rope: Optional[torch.Tensor]
    rows: int  # of the micro-batch (docs' shape [rows, row_length])
    row_length: int
    stream_shape: tuple  # (s, b) of the core's input states: (b*s, 1) when packed
    training: bool
    options: ForwardOptions  # what the caller asked (its depth resolved to an int)
    backend: Optional[object] = None
    moe_records: Optional[list] = None
    router_only: Optional[torch.Tensor] = (
        None  # [b*s, h] router-only means per token (static_routing.router_only_prefix_means)
    )
    cache: dict = field(default_factory=dict)  # what the steps of one forward compute once

    # the caller's options, read by the steps under their own names
    depth = property(lambda self: self.options.depth)
    forced = property(lambda self: self.options.forced_path)
    noise_seeds = property(lambda self: self.options.noise_seeds)
    backprop_depth = property(lambda self: self.options.backprop_depth)
    first_window_full_backprop = property(lambda self: self.options.first_window_full_backprop)
    routing_check = property(lambda self: self.options.routing_check)
    record = property(lambda self: self.options.record)
    layout = property(lambda self: self.options.layout)

    def truncated(self, step: Step) -> bool:
        """Whether ``step``'s updates are constants for autograd (truncated backprop through depth)."""
        return (
            self.backprop_depth is not None
            and self.training
            and torch.is_grad_enabled()
            and step.depth <= self.depth - self.backprop_depth
        )


@dataclass
class CoreState:
    """The residual stream between steps and what the steps observed so far.

    ``flat``: the states as one row-major token stream ``[b*s, h]``;
    ``injected``: the core's input ``s0`` (input injection mixes it back in).
    """

    flat: torch.Tensor
    injected: torch.Tensor
    aux_terms: list = field(default_factory=list)  # balancing losses, coefficients applied
    loads: list = field(default_factory=list)  # (depth, [L] windows per block)
    records: list = field(default_factory=list)  # DepthRecord per routed step (ctx.record)


class CoreStep:
    """One step of the plan bound to the core that runs it."""

    def __init__(self, core, step: Step):
        self.core = core
        self.step = step

    def run(self, state: CoreState, ctx: CoreContext) -> CoreState:
        for part, tensors in self.core.step_hooks(self.step, self.step.block, "input"):
            state.flat = part.apply(state.flat, state.injected, *tensors)
        return self.advance(state, ctx)

    def advance(self, state: CoreState, ctx: CoreContext) -> CoreState:
        raise NotImplementedError

    def windows(self, ctx: CoreContext) -> Optional[WindowLayout]:
        """The step's windows (shifted per depth, restarting per document), when it uses them."""
        if not self.step.windowed:
            return None
        cfg = self.core.cfg
        return WindowLayout.build(ctx.docs, self.step.depth, windows_of(cfg).size, windows_of(cfg).shift)


class FixedStep(CoreStep):
    """``s <- E_b(s)``: the step's block on every token, attention full, sliding or strided."""

    def advance(self, state: CoreState, ctx: CoreContext) -> CoreState:
        core, step, cfg = self.core, self.step, self.core.cfg
        flat = state.flat
        truncated = ctx.truncated(step)
        with torch.no_grad() if truncated else contextlib.nullcontext():
            if step.attention == "strided":
                windows = self.windows(ctx)
                positions = None
                if core.packed:  # RoPE restarts per window: each token's position in it (see SegmentMask)
                    first = windows.window_first_token.index_select(0, windows.token_window)
                    positions = torch.arange(first.shape[0], device=first.device) - first
                mask = SegmentMask(
                    segments=windows.token_window.view(1, -1), chunk=windows_of(cfg).size, positions=positions
                )
                rope = ctx.rope if core.packed else ctx.token_rope
                new = core.call(step, step.block, flat.unsqueeze(1), mask, rope, ctx).squeeze(1)
            else:
                s_len, b = ctx.stream_shape
                x = flat.view(b, s_len, -1).transpose(0, 1)
                sliding = windows_of(cfg).size if step.attention == "sliding" else None
                key = ("document mask", sliding)  # one per forward: the GPU's block mask is built once
                if key not in ctx.cache:
                    ctx.cache[key] = SegmentMask(
                        segments=ctx.docs.doc_index,
                        sliding=sliding,
                        # packed: the documents' THD offsets from the host-built layout (no device read)
                        cu_seqlens=ctx.layout.doc_cu_seqlens if ctx.layout is not None else None,
                        positions=ctx.docs.positions if core.packed else None,
                    )
                mask = ctx.cache[key]
                # the whole sequence's positions: under sequence parallelism x holds s/tp rows and
                # megatron's attention gathers them before RoPE
                new = core.call(step, step.block, x, mask, ctx.rope, ctx)
                new = new.transpose(0, 1).reshape(b * s_len, -1)
        state.flat = flat + (new - flat).detach() if truncated else new
        return state


class RoutedStep(CoreStep):
    """A routed depth: decide per window, then run each block once on the windows routed to it.

    One implementation on every device and layout: the windows are the depth's in the
    micro-batch's host-built layout (``ctx.layout``), summaries, decision, loads and balancing
    terms come from :mod:`.static_routing`, and the update is
    :func:`~.executors.routed_update`, whose blocks run on ``core.executor`` (chosen when the core
    was built). :meth:`advance` is the depth's bookkeeping; :meth:`update` is the extension point
    (a test's naive per-window reference overrides it).
    """

    def windows(self, ctx: CoreContext) -> DepthWindows:
        return ctx.layout.for_depth(self.step.depth)

    def advance(self, state: CoreState, ctx: CoreContext) -> CoreState:
        core, step, cfg = self.core, self.step, self.core.cfg
        windows = self.windows(ctx)
        with trace_range("router"):
            decision = self.decide(windows, state.flat, ctx)
        if ctx.routing_check is not None:
            ctx.routing_check(step.depth, decision)
        counts = window_loads(windows, decision.choice.detach(), core.plan.num_stored_blocks)
        if ctx.training:
            if core.balancer is not None:
                core.balancer.record(step.depth, counts)
            if cfg.plan.routing.balancing == "loss_free" and cfg.plan.routing.seq_aux_loss_coeff > 0:
                per_doc = sequence_aux_loss(windows, decision) / ctx.layout.doc_count.clamp(min=1)
                state.aux_terms.append(cfg.plan.routing.seq_aux_loss_coeff * per_doc)
            elif cfg.plan.routing.balancing == "aux_loss" and cfg.plan.routing.aux_loss_coeff > 0:
                state.aux_terms.append(cfg.plan.routing.aux_loss_coeff * global_aux_loss(windows, decision))
        state.loads.append((step.depth, counts))
        if ctx.record:
            n = windows.num_windows  # the layout's real windows come first
            state.records.append(
                DepthRecord(
                    step.depth,
                    decision.choice.detach()[:n],
                    decision.gate.detach()[:n],
                    decision.probs.detach()[:n],
                    windows.window_doc[:n],
                    windows.window_ordinal[:n],
                )
            )
        with trace_range("dispatch"):
            state.flat = self.update(state.flat, windows, decision, ctx)
        return state

    def decide(self, windows: DepthWindows, flat: torch.Tensor, ctx: CoreContext) -> RoutingDecision:
        """The router's decision (or the forced path) for the windows of this depth: summaries of the
        depth's input (or the depth vector alone, ``router_input: depth``) plus the router-only term."""
        core, depth = self.core, self.step.depth
        router = core.router_for(depth)
        depth_vector = core.depth_vectors[depth - 1]
        if core.cfg.plan.routing.router_input == "depth":
            summaries = depth_only_summaries(windows, depth_vector)
        else:
            summaries = router_summaries(windows, flat, depth_vector)
        summaries = with_router_only(windows, summaries, ctx.router_only)
        eps = ctx.layout.noise.get(depth) if ctx.training and router.noise else None
        bias = core.balancer.for_depth(depth) if core.balancer is not None else None
        forced = ctx.cache.get("forced")
        if forced is None and ctx.forced is not None:
            forced = ctx.cache["forced"] = replace(
                ctx.forced,
                ids=ctx.forced.ids.to(flat.device, non_blocking=True),
                gates=ctx.forced.gates.to(flat.device, non_blocking=True),
            )
        with fp8_disabled(core.tconfig):  # the router stays FP32 (it is no TE module either)
            return decide(router, summaries, eps, bias, forced, depth, windows)

    def update(
        self, flat: torch.Tensor, windows: DepthWindows, decision: RoutingDecision, ctx: CoreContext
    ) -> torch.Tensor:
        """``s_I <- s_I + alpha (E_rho(s_I) - s_I)`` for every window ``I`` of this depth."""
        return routed_update(self.core, self.step, flat, windows, decision, ctx)
