"""The steps of the core's loop: ``for step in steps: state = step.run(state, ctx)``.

:class:`~megatron_lol.model.core.Core` turns each :class:`~megatron_lol.plan.Step`
of the plan into one of the step classes here and runs them in order over a
:class:`CoreState`; what every step of one forward reads (documents, RoPE,
forcing, truncation, the backend) is one :class:`CoreContext`. A step is
Algorithm 1's body at depth ``l`` (docs/model.md, "The routed core"):

* the optional diagonal input injection, ``s <- sig(theta) s + (1 - sig(theta)) s0``
  (:meth:`CoreStep.run`, shared by every kind);
* :class:`RoutedStep` (LoL): windows of depth ``l``, the router's decision (or a
  forced path), balancing terms, then ``s_I <- s_I + alpha (E_rho(s_I) - s_I)``
  with every block run once on all windows routed to it;
* :class:`FixedStep` (dense, looped, Foil, Accordion): ``s <- E_b(s)`` with the
  step's attention (full, sliding, strided) and the pass's own parts.

The step classes are the extension point: a core uses ``Core.routed_step_class``
and ``Core.fixed_step_class``, so a variant (or a test's naive reference) swaps
one kind's update without touching the loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_lol.convert.hf_modeling.parts_lol import inject
from megatron_lol.model.attention import SegmentMask, uses_flex
from megatron_lol.model.balancing import global_aux_loss, sequence_aux_loss
from megatron_lol.model.dispatch import apply_gated_updates, block_updates, gated_update, group_by_block
from megatron_lol.model.forward_options import ForwardOptions
from megatron_lol.model.router import RoutingDecision
from megatron_lol.model.windows import DocumentLayout, WindowLayout
from megatron_lol.plan import Step
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
    noise seeds, truncated backprop, records, routing check, host layout), read through the
    properties below. ``moe_records``: the list MoE block calls append to (None: not recorded).
    With ``options.layout`` the core's routed depths are
    :class:`~.grouped_core.GroupedRoutedStep` (``Core.step_for``).
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
    router_only: Optional[torch.Tensor] = None  # [b*s, h] router-only means per token (Router.router_only_prefix_means)
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
        if self.core.cfg.input_injection:
            state.flat = inject(state.flat, state.injected, self.core.injection_logit)
        return self.advance(state, ctx)

    def advance(self, state: CoreState, ctx: CoreContext) -> CoreState:
        raise NotImplementedError

    def windows(self, ctx: CoreContext) -> Optional[WindowLayout]:
        """The step's windows (shifted per depth, restarting per document), when it uses them."""
        if not self.step.windowed:
            return None
        cfg = self.core.cfg
        return WindowLayout.build(ctx.docs, self.step.depth, cfg.window_size, cfg.window_shift)


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
                    segments=windows.token_window.view(1, -1), chunk=cfg.window_size, positions=positions
                )
                rope = ctx.rope if core.packed else ctx.token_rope
                new = core.call(step, step.block, flat.unsqueeze(1), mask, rope, ctx).squeeze(1)
            else:
                s_len, b = ctx.stream_shape
                x = flat.view(b, s_len, -1).transpose(0, 1)
                sliding = cfg.window_size if step.attention == "sliding" else None
                key = ("document mask", sliding)  # one per forward: the GPU's block mask is built once
                if key not in ctx.cache:
                    ctx.cache[key] = SegmentMask(
                        segments=ctx.docs.doc_index,
                        sliding=sliding,
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

    :meth:`advance` is the depth's bookkeeping, shared by every way of running it:
    windows, decision, agreement check, balancing loads and losses, records,
    then the gated update. How the windows are laid out, how the decision and
    the loads are computed and how the blocks run are the methods below
    (:class:`~.grouped_core.GroupedRoutedStep` overrides them to run the depth
    from a host-built layout as one grouped computation).
    """

    def advance(self, state: CoreState, ctx: CoreContext) -> CoreState:
        core, step, cfg = self.core, self.step, self.core.cfg
        windows = self.windows(ctx)
        with trace_range("router"):
            decision = self.decide(windows, state.flat, ctx)
        if ctx.routing_check is not None:
            ctx.routing_check(step.depth, decision)
        counts = self.loads(windows, decision)
        if ctx.training:
            if core.balancer is not None:
                self.record_balance(counts, decision)
            if cfg.balancing == "loss_free" and cfg.seq_aux_loss_coeff > 0:
                state.aux_terms.append(cfg.seq_aux_loss_coeff * self.sequence_aux_loss(windows, decision, ctx))
            elif cfg.balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
                state.aux_terms.append(cfg.aux_loss_coeff * self.global_aux_loss(windows, decision))
        state.loads.append((step.depth, counts))
        if ctx.record:
            n = windows.num_windows  # a padded layout's real windows come first
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

    def decide(self, windows: WindowLayout, flat: torch.Tensor, ctx: CoreContext) -> RoutingDecision:
        """The router's decision (or the forced path) for the windows of this depth."""
        return self.core.decide(
            self.step.depth,
            windows,
            flat,
            ctx.forced,
            ctx.noise_seeds,
            ctx.row_length,
            router_only=ctx.router_only,
        )

    def loads(self, windows: WindowLayout, decision: RoutingDecision) -> torch.Tensor:
        """Windows per block ``[L]`` (long)."""
        return torch.bincount(decision.choice.detach(), minlength=self.core.plan.num_stored_blocks)

    def record_balance(self, counts: torch.Tensor, decision: RoutingDecision) -> None:
        """Add this depth's loads to the loss-free balancing bias."""
        self.core.balancer.record(self.step.depth, decision.choice)

    def sequence_aux_loss(self, windows: WindowLayout, decision: RoutingDecision, ctx: CoreContext) -> torch.Tensor:
        """The sequence-wise balancing loss, averaged over the micro-batch's documents."""
        return sequence_aux_loss(windows, decision) / max(1, windows.num_docs)

    def global_aux_loss(self, windows: WindowLayout, decision: RoutingDecision) -> torch.Tensor:
        return global_aux_loss(decision)

    def update(
        self, flat: torch.Tensor, windows: WindowLayout, decision: RoutingDecision, ctx: CoreContext
    ) -> torch.Tensor:
        """``s_I <- s_I + alpha (E_rho(s_I) - s_I)`` for every window ``I`` of this depth."""
        core, step = self.core, self.step
        L, W = core.plan.num_stored_blocks, core.cfg.window_size
        token_choice = decision.choice.index_select(0, windows.token_window)
        ep_group = core.expert_group()
        window_position = None
        if core.packed:  # THD attention restarts RoPE per window: each token's position in it (see SegmentMask)
            first = windows.window_first_token.index_select(0, windows.token_window)
            window_position = torch.arange(first.shape[0], device=first.device) - first

        def runner(biases: Optional[dict], index_is_position: bool = False):
            def run_block(block, rows, segments, token_index):
                # token_index: the flat token index, or what the expert-parallel dispatch carried with
                # the windows (the row position; packed: the position in the window, index_is_position).
                # The row-major token_rope holds row position t mod row_length at flat index t, so a flat
                # index or a row position indexes it directly. Packed (THD) attention takes the table
                # and each token's position in its window.
                positions = None
                if core.packed:
                    rope = ctx.rope
                    positions = token_index if index_is_position else window_position.index_select(0, token_index)
                else:
                    rope = ctx.token_rope.index_select(0, token_index) if ctx.token_rope is not None else None
                mask = SegmentMask(
                    segments=segments.view(1, -1),
                    chunk=W,
                    bias=None if biases is None else biases.get(block),
                    positions=None if positions is None else positions.view(1, -1),
                )
                return core.call(step, block, rows.unsqueeze(1), mask, rope, ctx, pad_to=core.row_multiple).squeeze(1)

            return run_block

        def biases(grouping):
            """The chunked algorithm's masks of every block's windows (CPU; FlexAttention builds its own)."""
            return None if core.packed or uses_flex(flat) else grouping.chunk_biases(W)

        def updates(grouping):
            """``E(s) - s`` of the grouped tokens (under EP their windows travel to their block's rank)."""
            if ep_group is None:
                return block_updates(grouping, flat, runner(biases(grouping)))
            from megatron_lol.parallel.window_dispatch import run_grouped_expert_parallel

            if core.packed:
                return run_grouped_expert_parallel(grouping, flat, runner(None, True), window_position, ep_group)
            rope_index = torch.arange(flat.shape[0], device=flat.device) % ctx.row_length
            return run_grouped_expert_parallel(grouping, flat, runner(None), rope_index, ep_group)

        def update(states, grouping, gate):
            if ep_group is None:
                run_block = runner(biases(grouping))
                backend = ctx.backend
                new = backend.gated_update(states, grouping, gate, run_block) if backend is not None else None
                return new if new is not None else gated_update(states, grouping, gate, run_block)
            return apply_gated_updates(states, grouping, updates(grouping), gate)

        if not ctx.truncated(step):
            return update(flat, group_by_block(token_choice, windows.token_window, L), decision.gate)
        # Truncated backprop through depth: this depth's block updates are constants for autograd,
        # except for first-window tokens when enabled. The state keeps its identity path, so
        # earlier layers still get gradients.
        keep = windows.window_ordinal.index_select(0, windows.token_window) == 0
        if not ctx.first_window_full_backprop:
            keep = torch.zeros_like(keep)
        new = flat
        collective = ep_group is not None  # EP ranks must all take part, even with nothing to send
        grad_idx = torch.nonzero(keep).squeeze(1)
        if grad_idx.numel() or collective:
            new = update(new, group_by_block(token_choice, windows.token_window, L, subset=grad_idx), decision.gate)
        rest = torch.nonzero(~keep).squeeze(1)
        if rest.numel() or collective:
            grouping = group_by_block(token_choice, windows.token_window, L, subset=rest)
            with torch.no_grad():
                frozen = updates(grouping)
            # added outside no_grad, so the state keeps its identity path (and the first-window graph)
            new = apply_gated_updates(new, grouping, frozen, decision.gate.detach())
        return new
