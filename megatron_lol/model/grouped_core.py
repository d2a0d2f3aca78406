"""A routed depth of a LoL model shaped for GPUs: no host reads, one grouped computation per depth.

:class:`GroupedRoutedStep` is the core loop's routed step (``Core.step_for``
picks it when the forward is given a host-built layout). It keeps
:class:`~.core_steps.RoutedStep`'s bookkeeping (docs/model.md, "The routed
core": input injection, the router's summaries, choice and gate or a forced
path, the balancing loads and losses, records, truncated backprop through
depth) and changes how each part is computed: the windows come from the
:class:`~.host_layout.HostLayout` (already on the device), routing, loads and
losses from :mod:`.static_routing`, and all blocks of the depth run as one
computation (:mod:`.grouped_blocks`). No device-to-host read anywhere in the
forward or backward (under expert parallelism one per depth, below), and a
number of operations per depth that does not grow with ``L``.

:func:`grouped_core_support` says when it applies (a LoL plan whose blocks
:func:`~.grouped_blocks.grouped_support` accepts); elsewhere the reference
core runs. Under expert parallelism the depth's rows travel to their blocks'
ranks in one exchange (:mod:`.grouped_exchange`), whose split sizes are the
depth's one device-to-host read. The per-block reference stays the
definition: the tests compare this against it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from megatron_lol.model.attention import window_mask
from megatron_lol.model.core_steps import CoreContext, RoutedStep
from megatron_lol.model.grouped_blocks import RowRope, for_depth, grouped_blocks, grouped_support, stack_library
from megatron_lol.model.grouped_exchange import exchange_rows
from megatron_lol.model.host_layout import DepthWindows
from megatron_lol.model.precision import fp8_disabled
from megatron_lol.model.static_routing import (
    Decision,
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


def routes_grouped(model, cuda: bool) -> bool:
    """Whether ``model``'s routed depths will run grouped (``model.routed_core``), decided from the config
    when the model is built, so the library's blocks can be built for it: ``grouped`` always (the trainer
    refuses with one line what :func:`grouped_core_support` declines), ``auto`` on CUDA for a plan of
    routed depths only, with the window router, no router-only tokens and no MoE blocks.

    Under the Transformer Engine spec such a model keeps TE layers for its prelude and coda and builds
    its library with the local spec, whose weights the grouped computation stacks (``torch._grouped_mm``
    in the parameters' dtype: FP8, when configured, covers the prelude and coda only)."""
    mode = model.routed_core
    if mode == "reference" or (mode == "auto" and not cuda):
        return False
    plan = model.execution_plan()
    if mode == "grouped":
        return plan.routed and all(step.routed for step in plan.steps())
    # MoE blocks: grouped_support declines them from the built blocks; here from the config
    return grouped_config_support(model, plan) is None and model.moe_layers != "all"


def grouped_config_support(model, plan) -> Optional[str]:
    """What the config alone says against running ``plan``'s routed depths grouped (one line), or None: the
    rules :func:`routes_grouped` (at build time) and :func:`grouped_core_support` (on the built core) share."""
    if not plan.routed or any(not step.routed for step in plan.steps()):
        return f"plan {plan.name!r} has fixed steps (only routed LoL depths run grouped)"
    if model.router_only_tokens:
        return "router_only_tokens (the grouped depth has no router-only term)"
    if model.router_input != "windows":
        return f"router_input: {model.router_input} (the grouped depth runs the window router)"
    return None


def grouped_core_support(core) -> Optional[str]:
    """Why ``core`` cannot run grouped (one line), or None when it can."""
    reason = grouped_config_support(core.cfg, core.plan)
    if reason is not None:
        return reason
    return grouped_support([core.block(i) for i in core.local_block_ids()])


class GroupedRoutedStep(RoutedStep):
    """A routed depth from the host-built layout (``ctx.layout``), every block in one grouped computation.

    The bookkeeping is :meth:`RoutedStep.advance`'s; what differs: the windows
    are the layout's, padded to its capacity (padding windows are invalid and
    hold no token), so the decision, loads and balancing terms are computed
    with device offsets and sums instead of ``bincount`` / ``index_add_``; the
    router noise is the layout's (drawn on the host from the samples' seeds);
    the update is :func:`apply_routed_update`. The stacked library
    (:func:`~.grouped_blocks.stack_library`) is built once per forward and kept
    in ``ctx.cache``. RoPE positions are row positions on the local layout and
    positions inside the window on the packed one, as the reference's
    attention applies them.
    """

    def windows(self, ctx: CoreContext) -> DepthWindows:
        return ctx.layout.for_depth(self.step.depth)

    def decide(self, windows: DepthWindows, flat: torch.Tensor, ctx: CoreContext) -> Decision:
        core, depth = self.core, self.step.depth
        router = core.router_for(depth)
        summaries = router_summaries(windows, flat, core.depth_vectors[depth - 1])
        eps = ctx.layout.noise.get(depth) if ctx.training and router.noise else None
        bias = core.balancer.for_depth(depth) if core.balancer is not None else None
        forced = _cached(ctx, "forced", lambda: _forced_on(ctx.forced, flat.device))
        with fp8_disabled(core.tconfig):  # the router stays FP32 (it is no TE module either)
            return decide(router, summaries, eps, bias, forced, depth, windows)

    def loads(self, windows: DepthWindows, decision: Decision) -> torch.Tensor:
        return window_loads(windows, decision.choice.detach(), self.core.plan.num_stored_blocks)

    def record_balance(self, counts: torch.Tensor, decision: Decision) -> None:
        record_loads(self.core.balancer, self.step.depth, counts)

    def sequence_aux_loss(self, windows: DepthWindows, decision: Decision, ctx: CoreContext) -> torch.Tensor:
        return sequence_aux_loss(windows, decision) / ctx.layout.doc_count.clamp(min=1)

    def global_aux_loss(self, windows: DepthWindows, decision: Decision) -> torch.Tensor:
        return global_aux_loss(windows, decision)

    def update(self, flat: torch.Tensor, windows: DepthWindows, decision: Decision, ctx: CoreContext) -> torch.Tensor:
        core, step, cfg = self.core, self.step, self.core.cfg
        # this rank's blocks (under expert parallelism its share of the library)
        library = for_depth(
            _cached(ctx, "library", lambda: stack_library([core.block(i) for i in core.local_block_ids()]))
        )
        if core.packed:  # THD attention restarts RoPE positions per window
            positions = windows.token_position
        else:
            positions = _cached(
                ctx, "row_positions", lambda: torch.arange(flat.shape[0], device=flat.device) % ctx.row_length
            )
        # [2, h] per depth, [L, 2, h] per (depth, block)
        film = None if cfg.film == "off" else (core.film_gamma[step.depth - 1], core.film_beta[step.depth - 1])
        return apply_routed_update(
            flat,
            windows,
            decision,
            library,
            ctx.rope,
            positions,
            film=film,
            window_size=cfg.window_size,
            truncation=truncation_mode(ctx.truncated(step), ctx.first_window_full_backprop),
            expert_group=core.expert_group(),
        )


def _cached(ctx: CoreContext, key: str, make):
    if key not in ctx.cache:
        ctx.cache[key] = make()
    return ctx.cache[key]


def _forced_on(forced, device):
    """A :class:`~.core.ForcedPath` on the states' device (None stays None)."""
    if forced is None:
        return None
    return replace(
        forced, ids=forced.ids.to(device, non_blocking=True), gates=forced.gates.to(device, non_blocking=True)
    )


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
    positions: torch.Tensor  # [T] RoPE position of every grouped row
    rope: Optional[RowRope]  # cos / sin of every grouped row (None where the rows run on other ranks)
    attention_bias: Optional[object]  # the grouped stream's window mask (attention.window_mask; idem)
    gate: torch.Tensor  # [T] every token's window gate (token order)


def group_depth(
    flat: torch.Tensor,
    windows,
    decision,
    num_blocks: int,
    rope: Optional[torch.Tensor],
    positions: torch.Tensor,
    window_size: int,
    run_here: bool = True,
) -> GroupedDepth:
    """Group the tokens by the block their window chose (stable sort, offsets on the device).

    ``run_here``: the blocks run on this rank, so the rows' RoPE and attention mask are made here
    (under expert parallelism the receiving ranks make them: :func:`expert_parallel_blocks`)."""
    grouping = group_tokens(decision.choice.index_select(0, windows.token_window), windows.token_window, num_blocks)
    grouped_positions = positions.index_select(0, grouping.order)
    row_rope = RowRope.from_table(rope, grouped_positions, flat.dtype) if rope is not None and run_here else None
    return GroupedDepth(
        grouping=grouping,
        rows=permute_rows(flat, grouping.order, grouping.inverse),
        positions=grouped_positions,
        rope=row_rope,
        attention_bias=window_mask(grouping.segments, window_size) if run_here else None,
        gate=token_gates(windows, decision.gate),
    )


def expert_parallel_blocks(
    library, depth: GroupedDepth, rope: Optional[torch.Tensor], window_size: int, film: Optional[tuple], group
) -> torch.Tensor:
    """``E(s)`` of the depth's grouped rows when this rank holds only its share of the library: the rows go
    to their blocks' ranks (:func:`~.grouped_exchange.exchange_rows`), each rank runs what it received
    as one grouped computation, the outputs come back in ``depth.rows``' order. ``library``: this rank's
    blocks stacked; ``film``: the depth's, per depth ``[2, h]`` or per block ``[L, 2, h]`` (all blocks)."""
    import torch.distributed as dist

    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = library.qkv.shape[0]
    num_blocks = per_rank * ep
    received = exchange_rows(depth.rows, depth.grouping, depth.positions, num_blocks, group)
    if received.rows.shape[0] == 0:  # nothing routed here: the (empty) rows keep the exchange's graph
        return received.send_back(received.rows)
    if film is not None and film[0].dim() == 3:  # FiLM per (depth, block): this rank's blocks
        film = tuple(part[rank * per_rank : (rank + 1) * per_rank] for part in film)
    dtype = depth.rows.dtype
    row_rope = RowRope.from_table(rope, received.positions, dtype) if rope is not None else None
    bias = window_mask(received.grouping.segments, window_size)
    outputs = grouped_blocks(library, received.rows, received.grouping, row_rope, bias, window_size, film)
    return received.send_back(outputs)


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
    expert_group=None,
) -> torch.Tensor:
    """``s + alpha (E_rho(s) - s)`` of one depth: :func:`group_depth`, every block at once
    (:func:`~.grouped_blocks.grouped_blocks`), :func:`combine_depth`. Static shapes, no host read.

    ``flat`` ``[T, h]``: the depth's input; ``positions`` ``[T]``: RoPE positions per token;
    ``truncation``: see :func:`truncation_mode` (``"frozen"``: the whole update is a constant).
    ``expert_group``: the library is sharded over this expert-parallel group (``library`` holds this
    rank's blocks): the rows travel to their blocks' ranks (:func:`expert_parallel_blocks`; one
    device-to-host read, the all-to-all's split sizes).
    """
    with torch.no_grad() if truncation == "frozen" else contextlib.nullcontext():
        if expert_group is None:
            depth = group_depth(flat, windows, decision, library.qkv.shape[0], rope, positions, window_size)
            grouped_out = grouped_blocks(
                library, depth.rows, depth.grouping, depth.rope, depth.attention_bias, window_size, film
            )
        else:
            num_blocks = library.qkv.shape[0] * torch.distributed.get_world_size(expert_group)
            depth = group_depth(flat, windows, decision, num_blocks, rope, positions, window_size, run_here=False)
            grouped_out = expert_parallel_blocks(library, depth, rope, window_size, film, expert_group)
    return combine_depth(flat, grouped_out, depth, windows, truncation)
