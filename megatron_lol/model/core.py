"""The core: the stored blocks and the execution plan that runs them.

This is the paper's Algorithm 1 (docs/model.md, "The routed core"). The forward
is its loop::

    state = CoreState(flat=s0, injected=s0)
    for step in steps:
        state = self.step_for(step).run(state, ctx)

where each step (:mod:`.core_steps`) first applies the optional input injection,
then either routes (LoL: windows of depth ``l``, the router's block ``rho`` and
gate ``alpha`` per window, ``s_I <- s_I + alpha (E_rho(s_I) - s_I)`` with every
block run once on all windows routed to it) or runs its fixed block
(``s <- E_b(s)``: dense, looped, Foil, Accordion, with the pass's own parts).

Which steps run is the plan's business (:mod:`megatron_lol.plan`); how a routed
depth's blocks run is the executor the core chose when it was built
(:mod:`.executors`); what runs faster on a device is a backend's
(:mod:`megatron_lol.backends`). Everything a
step needs is passed to the block call (:mod:`.block_call`), and everything
the forward observed (balancing loss, loads, routing records) is returned in
:class:`CoreOutput`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from megatron_lol.backends import select_backend
from megatron_lol.config.schema import ModelConfig
from megatron_lol.convert.hf_modeling.parts_lol import selected
from megatron_lol.model.balancing import BalancingBias
from megatron_lol.model.block_call import BlockParts, call_block
from megatron_lol.model.core_steps import CoreContext, CoreState, DepthRecord, FixedStep, RoutedStep
from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls
from megatron_lol.model.forward_options import ForwardOptions
from megatron_lol.model.grouped_core import grouped_core_support
from megatron_lol.model.host_layout import layout_from_documents, routed_depths
from megatron_lol.model.init import seeded
from megatron_lol.model.library import build_attention_set, build_layer
from megatron_lol.model.parts import part_parameters, step_parts
from megatron_lol.model.precision import row_multiple
from megatron_lol.model.router import WindowRouter
from megatron_lol.model.static_routing import router_only_prefix_means
from megatron_lol.model.windows import DocumentLayout
from megatron_lol.plan import Step
from megatron_lol.plan.routing import routing_of
from megatron_lol.plan.stages import local_blocks
from megatron_lol.plan.windows import windows_of
from megatron_lol.platform.trace_ranges import trace_range, trace_steps

__all__ = ["Core", "CoreOutput", "DepthRecord", "ForcedPath", "MoERecord"]


@dataclass
class ForcedPath:
    """Block ids and gates supplied by the caller (docs/model.md, "Path forcing").

    ``ids``/``gates``: ``[D, K]`` per (depth, window ordinal), applied to every
    document, or ``[D, num_docs, K]`` per document. An id of ``-1`` (or an
    ordinal beyond ``K``) means "no entry": that window is routed normally.
    """

    ids: torch.Tensor
    gates: torch.Tensor

    def lookup(self, depth: int, windows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(forced [C] bool, ids [C], gates [C] fp32)`` of the windows of a depth (a
        :class:`~.host_layout.DepthWindows` on the ids' device)."""
        ids = self.ids[depth - 1].to(windows.window_ordinal.device)
        gates = self.gates[depth - 1].to(windows.window_ordinal.device)
        k_max = ids.shape[-1]
        ordinal = windows.window_ordinal.clamp(max=k_max - 1)
        if ids.dim() == 1:
            wid, wgate = ids[ordinal], gates[ordinal]
        else:
            wid, wgate = ids[windows.window_doc, ordinal], gates[windows.window_doc, ordinal]
        forced = (wid >= 0) & (windows.window_ordinal < k_max)
        return forced, wid.clamp(min=0), wgate.float()


@dataclass
class MoERecord:
    """What one MoE router of the core decided at one (block, pass): for U_t, B2 and MMR."""

    block: int
    pass_index: int
    logits: torch.Tensor  # [T, E] fp32, before the softmax
    routing_map: torch.Tensor  # [T, E] bool, the experts each token was sent to


@dataclass
class CoreOutput:
    """The core's new states and what its forward observed."""

    states: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None  # balancing loss, already multiplied by its coefficient
    records: list = field(default_factory=list)  # DepthRecord per routed step (``record=True``)
    block_loads: Optional[torch.Tensor] = None  # [plan depth, L] windows per block (routed plans)
    moe_records: list = field(default_factory=list)  # MoERecord per MoE block call (``record_moe=True``)


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _expert_parallel() -> tuple:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank())


class Core(nn.Module):
    """Stored blocks, their per-step parts, the router(s) and the balancing bias of one model."""

    #: what a routed / a fixed plan step runs as (:mod:`.core_steps`); a subclass or an instance may swap them
    routed_step_class = RoutedStep
    fixed_step_class = FixedStep

    def __init__(
        self,
        model: ModelConfig,
        tconfig,
        spec,
        first_layer_number: int,
        init_seed: Optional[int] = None,
        vp_stage: Optional[int] = None,
        *,
        packed: bool = False,
        grouped: bool = False,
    ):
        """``packed``: the blocks take THD packed sequences (the Transformer Engine layout, see
        :func:`~.block_call.call_block`); states then arrive as one packed stream ``[T, 1, h]``.
        ``grouped``: run the routed depths' blocks as one grouped computation
        (:class:`~.executors.GroupedGEMMs`, :func:`~.grouped_core.routes_grouped`) where the built
        blocks allow it (else per block; ``grouped_refusal`` says why)."""
        super().__init__()
        self.cfg = model
        self.plan = model.execution_plan()
        self.packed = packed
        # rows of a block's packed windows are padded to this multiple (FP8 GEMMs)
        self.row_multiple = row_multiple(tconfig)
        self.tconfig = tconfig
        self.recompute_full = tconfig.recompute_granularity == "full"
        plan, h = self.plan, model.hidden_size
        L, D = plan.num_stored_blocks, plan.depth
        self.blocks = nn.ModuleDict()  # keyed by global index: an expert-parallel rank holds a subset
        for i in self.local_block_ids():
            with seeded(init_seed, f"core.blocks.{i}"):
                self.blocks[str(i)] = build_layer(spec, tconfig, first_layer_number + i, vp_stage)
        if plan.shards_library and _expert_parallel()[0] > 1:
            # sharded like MoE experts: megatron's DDP reduces these over the expert-data-parallel
            # group only (each EP rank holds different blocks)
            for p in self.blocks.parameters():
                p.allreduce = False
        self.balancer = None
        if plan.routed:
            routing = model.plan.routing
            n_routers = 1 if routing.router_tied else D
            self.routers = nn.ModuleList(
                WindowRouter(h, L, noise=routing.router_noise, noise_clamp=routing.router_noise_clamp)
                for _ in range(n_routers)
            )
            # e^(l): exists whether or not the router is tied
            self.depth_vectors = nn.Parameter(torch.empty(D, h, dtype=torch.float32))
            with seeded(init_seed, "core.depth_vectors"):
                nn.init.normal_(self.depth_vectors, std=model.init_method_std)
            if model.plan.routing.router_only_tokens:
                # the router's own embeddings of the router-only tokens (no layer ever reads them)
                n_ro = len(model.plan.routing.router_only_tokens)
                self.router_only_embeddings = nn.Parameter(torch.empty(n_ro, h, dtype=torch.float32))
                with seeded(init_seed, "core.router_only_embeddings"):
                    nn.init.normal_(self.router_only_embeddings, std=model.init_method_std)
            if model.plan.routing.balancing == "loss_free":
                self.balancer = BalancingBias(
                    L,
                    D,
                    model.plan.routing.per_depth_bias,
                    model.plan.routing.bias_update_speed,
                    model.plan.routing.bias_clamp,
                    model.plan.routing.bias_update_stop_fraction,
                )
        # the per-pass parts' tensors (FiLM, injection, loop gates, plug-ins: megatron_lol/model/parts.py),
        # each a parameter of the core under its own name; the model-wide parts' first, as registered
        self.step_parts = step_parts(model, plan)
        self.part_names = tuple(part_parameters(model, plan))
        for name, (part, shape, init) in part_parameters(model, plan).items():
            if not part.enabled(model):
                continue
            self.register_parameter(name, nn.Parameter(torch.full(shape, init, dtype=tconfig.params_dtype)))
        self._build_pass_parts(tconfig, spec, first_layer_number, init_seed, vp_stage)
        # how the routed depths' blocks run, chosen once (routing is the same either way)
        self.grouped_refusal = grouped_core_support(self) if grouped else "not asked for"
        self.executor = GroupedGEMMs() if self.grouped_refusal is None else PerBlockCalls()
        if tconfig.sequence_parallel:
            # a fixed-plan core may run sequence-sharded (see ExecutionPlan.gathers_sequence): per-channel
            # parameters applied to the local tokens get partial gradients, which megatron's
            # finalize_model_grads sums over the TP group for parameters marked like this (as its norms)
            for name in self.part_names:
                getattr(self, name).sequence_parallel = True

    def _build_pass_parts(self, tconfig, spec, first_layer_number, init_seed, vp_stage) -> None:
        """Parts of a block that belong to one pass only (Foil's attention, Accordion's gates/router)."""
        plan, local = self.plan, set(self.local_block_ids())
        self.pass_attention = None
        sets = [(b, p) for b, p in plan.untied_attention_sets() if b in local]
        if sets:
            self.pass_attention = nn.ModuleDict()
            for b, p in sets:
                with seeded(init_seed, f"core.pass_attention.{b}_{p}"):
                    self.pass_attention[f"{b}_{p}"] = build_attention_set(
                        spec, tconfig, first_layer_number + b, vp_stage
                    )
        for name, (part, shape, init) in part_parameters(self.cfg, plan).items():
            if not part.enabled(self.cfg):  # the steps' own parts (Accordion's loop gates), after the pass attention
                self.register_parameter(name, nn.Parameter(torch.full(shape, init, dtype=tconfig.params_dtype)))
        self.second_pass_routers = None
        if plan.separate_router_blocks():
            self.second_pass_routers = nn.ModuleDict()
            for b in plan.separate_router_blocks():
                if b not in local:
                    continue
                mlp = self.block(b).mlp
                with seeded(init_seed, f"core.second_pass_routers.{b}"):
                    router = type(mlp.router)(config=mlp.config, pg_collection=_pg_collection())
                router.set_layer_number(mlp.router.layer_number)
                self.second_pass_routers[str(b)] = router

    # ------------------------------------------------------------------ helpers
    def local_block_ids(self) -> list:
        L = self.plan.num_stored_blocks
        if not self.plan.shards_library:  # fixed plans run every block on every token: not sharded
            return list(range(L))
        ep, ep_rank = _expert_parallel()
        return local_blocks(L, ep, ep_rank)

    def expert_group(self):
        """The expert-parallel group the library is sharded over (None: not sharded)."""
        ep, _ = _expert_parallel()
        if ep == 1 or not self.plan.shards_library:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_group()

    def block(self, index: int):
        return self.blocks[str(index)]

    def router_for(self, depth: int) -> WindowRouter:
        return self.routers[0 if len(self.routers) == 1 else depth - 1]

    def part_params(self) -> dict:
        """The per-pass parts' tensors by name (what :meth:`Part.select` reads)."""
        return {name: getattr(self, name) for name in self.part_names}

    def step_hooks(self, step: Step, block: int, hook: Optional[str] = None) -> tuple:
        """``((part, tensors), ...)`` of the parts ``step`` applies to a call of ``block`` (of ``hook`` only)."""
        parts = self.step_parts[step.depth - 1]
        if not parts:
            return ()
        return selected(parts, self.part_params(), step.depth, step.pass_index, block, hook)

    def parts(self, step: Step, block: int, record_moe: bool = False) -> BlockParts:
        """Everything step ``step`` passes to a call of ``block`` besides its input."""
        return BlockParts(
            hooks=tuple(item for item in self.step_hooks(step, block) if item[0].hook != "input"),
            attention=self.pass_attention[f"{block}_{step.pass_index}"] if step.untied_attention else None,
            moe_router=self.second_pass_routers[str(block)] if step.separate_router else None,
            record_moe=record_moe,
        )

    def call(self, step: Step, block: int, x, mask, rope, ctx: CoreContext, *, pad_to: int = 1):
        """One call of stored ``block`` at ``step`` (its per-pass parts, recompute, the backend)."""
        recompute = self.recompute_full and self.training and torch.is_grad_enabled()
        moe_records = ctx.moe_records
        with trace_range(f"block {block}"):
            out, route = call_block(
                self.block(block),
                x,
                mask,
                rope,
                self.parts(step, block, moe_records is not None),
                packed=self.packed,
                recompute=recompute,
                backend=ctx.backend,
                pad_to=pad_to,
            )
        if route is not None and moe_records is not None:
            moe_records.append(MoERecord(block, step.pass_index, route.logits, route.routing_map))
        return out

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        states: torch.Tensor,
        docs: DocumentLayout,
        rope: Optional[torch.Tensor],
        steps: Sequence[Step],
        options: Optional[ForwardOptions] = None,
        *,
        router_only: Optional[torch.Tensor] = None,
        **overrides,
    ) -> CoreOutput:
        """Run ``steps`` (this pipeline stage's share of the first ``options.depth`` steps of the plan).

        ``states``: [s, b, h] output of the prelude (or the previous stage); packed: the
        micro-batch as one row-major stream [b*s, 1, h]. ``docs`` always has the rows' shape
        [b, s]. ``rope``: [s, 1, 1, d] row-position frequencies. ``options``: the forward's
        :class:`~.forward_options.ForwardOptions` (keyword arguments named like its fields override
        it); its ``depth`` must be given. ``options.layout``: the micro-batch's host-built
        :class:`~.host_layout.HostLayout` on the states' device, whose windows and router noise the
        routed depths use; without one the core builds it here from ``docs`` (:meth:`_layout`).
        ``router_only`` [b, s]: each token's index in ``plan.routing.router_only_tokens`` (-1: an ordinary
        token), for the router's router-only term.
        """
        opts = ForwardOptions.of(options, overrides, "Core.forward")
        if opts.depth is None:
            raise ValueError("Core.forward: options.depth is required (the model resolves it from the plan)")
        if opts.layout is None and any(step.routed for step in steps):
            opts = ForwardOptions.of(opts, {"layout": self._layout(docs, steps, opts, states.device)}, "Core.forward")
        backend = select_backend(states.device)
        s_len, b, h = states.shape  # packed: (b*s, 1, h)
        rows, row_len = docs.shape
        context = backend.core_context(self) if backend is not None else contextlib.nullcontext()
        with context:
            ctx = CoreContext(
                docs=docs,
                rope=rope,
                token_rope=rope.repeat(rows, 1, 1, 1) if rope is not None else None,
                rows=rows,
                row_length=row_len,
                stream_shape=(s_len, b),
                training=self.training,
                options=opts,
                backend=backend,
                moe_records=[] if opts.record_moe else None,
                router_only=None
                if router_only is None
                else router_only_prefix_means(
                    self.router_only_embeddings, router_only.reshape(-1), docs.positions.reshape(-1), row_len
                ),
            )
            flat = states.transpose(0, 1).reshape(b * s_len, h)
            state = CoreState(flat=flat, injected=flat)
            for step in trace_steps(steps):  # profiler range "depth {l}" around each step
                state = self.step_for(step).run(state, ctx)
        return self._output(state, ctx, (s_len, b, h))

    def _layout(self, docs: DocumentLayout, steps: Sequence[Step], opts: ForwardOptions, device):
        """The host layout of a forward that brought none (from ``docs``; router noise from
        ``opts.noise_seeds`` as the trainer's layouts draw it).

        Kept for the model's public call, ``model(tokens)`` (tests, tools, a notebook: a forward
        from token ids alone must work). It copies the documents to the host, one device read per
        forward on a GPU, so every caller in the package builds the layout with its batch instead
        and passes ``layout=``: the trainer and ``evaluate`` (``host_layout_for_batch``,
        ``packed_eval``), ``analyze`` (``LoLGPTModel.host_layout``) and the benches."""
        cpu_docs = DocumentLayout(docs.positions.cpu(), docs.doc_index.cpu(), docs.num_docs)
        seeds = opts.noise_seeds
        if seeds is not None and not (self.training and routing_of(self.cfg).router_noise):
            seeds = None
        layout = layout_from_documents(
            cpu_docs,
            windows_of(self.cfg).size,
            windows_of(self.cfg).shift,
            routed_depths(self.plan),
            num_blocks=self.plan.num_stored_blocks,
            row_seeds=None if seeds is None else seeds.cpu(),
        )
        return layout.to(device) if device.type != "cpu" else layout

    def step_for(self, step: Step):
        """The runnable form of plan step ``step``: ``routed_step_class`` or ``fixed_step_class``."""
        return self.routed_step_class(self, step) if step.routed else self.fixed_step_class(self, step)

    def _output(self, state: CoreState, ctx: CoreContext, shape: tuple) -> CoreOutput:
        s_len, b, h = shape
        out = CoreOutput(
            states=state.flat.view(b, s_len, h).transpose(0, 1).contiguous(),
            records=state.records,
            moe_records=ctx.moe_records if ctx.moe_records is not None else [],
        )
        if state.aux_terms:
            out.aux_loss = torch.stack(state.aux_terms).sum()
        if self.plan.routed:
            # rows for every depth of the plan; zero for depths not run here (other stages, not grown yet)
            out.block_loads = torch.zeros(
                self.plan.depth, self.plan.num_stored_blocks, dtype=torch.long, device=state.flat.device
            )
            for l, row in state.loads:
                out.block_loads[l - 1] = row
        return out
