"""The routed core: a library of blocks and the plan that executes it.

This is the paper's Algorithm 1. For routed depth ``l = 1..d`` (``d`` the
current depth, which grows during training):

1. (optional) diagonal input injection ``s <- sig(theta) s + (1 - sig(theta)) s0``;
2. the windows of depth ``l`` (shifted by ``((l-1) S) mod W``, restarting per document);
3. the router reads the prefix summaries of the depth's *input* and picks one
   block ``rho`` and a gate ``alpha`` per window (or a forced path supplies them);
4. every block runs all windows routed to it as one packed batch;
5. ``s_I <- s_I + alpha * (E_rho(s_I) - s_I)``.

Other plans are the same loop with another choice of block per depth: ``dense``
runs block ``l`` on every token, ``looped`` runs block ``(l-1) mod L`` in pass
``(l-1) div L``; ``accordion`` runs its ``L`` window layers once and then the
first ``k`` of them again (``k`` the budget). Their gate is 1 (so the update is
``E(s)``) and their attention is full, sliding or strided (LoL's windows with a
fixed block). A block's later passes may use pass-specific parts: Foil's untied
attention (one attention per (block, pass), experts shared) and Accordion's
second-pass write gates and optional separate MoE router.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.balancing import BalancingBias, global_aux_loss, sequence_aux_loss
from megatron_lol.model.dispatch import apply_gated_updates, plan_dispatch, run_grouped, run_grouped_gated
from megatron_lol.model.library import build_layer, layer_norms, run_layer
from megatron_lol.model.router import RoutingDecision, WindowRouter, choose_blocks, router_summaries, window_noise
from megatron_lol.model.windows import DocumentLayout, WindowLayout


@dataclass
class ForcedPath:
    """Block ids and gates supplied by the caller (SPEC 1.4, path forcing).

    ``ids``/``gates``: ``[D, K]`` per (depth, window ordinal), applied to every
    document, or ``[D, num_docs, K]`` per document. An id of ``-1`` (or an
    ordinal beyond ``K``) means "no entry": that window is routed normally.
    """

    ids: torch.Tensor
    gates: torch.Tensor

    def lookup(self, depth: int, windows: WindowLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
class DepthRecord:
    """Routing record of one depth: what every window chose and with what probabilities."""

    depth: int
    choice: torch.Tensor  # [N]
    gate: torch.Tensor  # [N]
    probs: Optional[torch.Tensor]  # [N, L] (None for fixed plans)
    window_doc: torch.Tensor  # [N]
    window_ordinal: torch.Tensor  # [N]


@dataclass
class MoERecord:
    """What one MoE router of the core decided at one (block, pass): for U_t, B2 and MMR."""

    block: int
    pass_index: int
    logits: torch.Tensor  # [T, E] fp32, before the softmax
    routing_map: torch.Tensor  # [T, E] bool, the experts each token was sent to


@dataclass
class CoreOutput:
    states: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None  # already multiplied by its coefficient
    records: list = field(default_factory=list)
    block_loads: Optional[torch.Tensor] = None  # [depth, L] windows per block this forward


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _expert_parallel() -> tuple:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank())


class RoutedCore(nn.Module):
    def __init__(self, model: ModelConfig, tconfig, spec, first_layer_number: int, init_seed: Optional[int] = None,
                 vp_stage: Optional[int] = None, use_te: bool = False):
        super().__init__()
        from megatron_lol.model.lol_model import seeded

        self.cfg = model
        self.use_te = use_te
        self.recompute_full = tconfig.recompute_granularity == "full"
        L, D, h = model.num_blocks, model.core_depth, model.hidden_size
        # blocks keyed by their global index: an expert-parallel rank holds a subset
        self.blocks = nn.ModuleDict()
        for i in self.local_block_ids():
            with seeded(init_seed, f"core.blocks.{i}"):
                self.blocks[str(i)] = build_layer(spec, tconfig, first_layer_number + i, vp_stage)
        if _expert_parallel()[0] > 1 and model.plan == "lol":
            # sharded like MoE experts: megatron's DDP reduces these over the expert-data-parallel
            # group only (each EP rank holds different blocks)
            for p in self.blocks.parameters():
                p.allreduce = False
        self.routed = model.plan == "lol"
        if self.routed:
            n_routers = 1 if model.router_tied else D
            self.routers = nn.ModuleList(
                WindowRouter(h, L, noise=model.router_noise, noise_clamp=model.router_noise_clamp)
                for _ in range(n_routers))
            # e^(l): exists whether or not the router is tied (SPEC 1.2)
            self.depth_vectors = nn.Parameter(torch.empty(D, h, dtype=torch.float32))
            with seeded(init_seed, "core.depth_vectors"):
                nn.init.normal_(self.depth_vectors, std=model.init_method_std)
            if model.balancing == "loss_free":
                self.balancer = BalancingBias(L, D, model.per_depth_bias, model.bias_update_speed,
                                              model.bias_clamp, model.bias_update_stop_fraction)
            else:
                self.balancer = None
        if model.film != "off":
            shape = (D, 2, h) if model.film == "depth" else (D, L, 2, h)
            self.film_gamma = nn.Parameter(torch.ones(shape, dtype=tconfig.params_dtype))
            self.film_beta = nn.Parameter(torch.zeros(shape, dtype=tconfig.params_dtype))
        if model.input_injection:
            self.injection_logit = nn.Parameter(torch.zeros(h, dtype=tconfig.params_dtype))
        self._build_pass_parts(model, tconfig, spec, first_layer_number, init_seed, vp_stage)
        if tconfig.sequence_parallel:
            # a fixed-plan core may run sequence-sharded (see lol_model.core_gathers_sequence): per-channel
            # parameters applied to the local tokens get partial gradients, which megatron's
            # finalize_model_grads sums over the TP group for parameters marked like this (as its norms)
            for name in ("loop_gates", "film_gamma", "film_beta", "injection_logit"):
                param = getattr(self, name, None)
                if isinstance(param, nn.Parameter):
                    param.sequence_parallel = True
        # MoE routing records (U_t / B2 / MMR): a list while recording, else None
        self.moe_records: Optional[list] = None
        self._moe_tag: Optional[tuple] = None
        for layer in self.blocks.values():
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                router.register_forward_hook(self._record_moe)
        if self.second_pass_routers is not None:
            for router in self.second_pass_routers.values():
                router.register_forward_hook(self._record_moe)

    def _build_pass_parts(self, model: ModelConfig, tconfig, spec, first_layer_number, init_seed, vp_stage):
        """Parts of a block that belong to one pass only (Foil's attention, Accordion's gates/router)."""
        from megatron_lol.model.library import build_attention_set
        from megatron_lol.model.lol_model import seeded

        self.pass_attention = None
        if model.untie_attention:
            self.pass_attention = nn.ModuleDict()
            for p in range(1, model.loop_passes):
                for i in self.local_block_ids():
                    with seeded(init_seed, f"core.pass_attention.{i}_{p}"):
                        self.pass_attention[f"{i}_{p}"] = build_attention_set(
                            spec, tconfig, first_layer_number + i, vp_stage)
        self.loop_gates = None
        self.second_pass_routers = None
        if model.plan == "accordion":
            if model.loop_gates:
                # per-channel gates of the second pass's attention and MLP writes; 1 = an ordinary layer call
                self.loop_gates = nn.Parameter(torch.ones(model.num_blocks, 2, model.hidden_size,
                                                          dtype=tconfig.params_dtype))
            if model.second_pass_router == "separate":
                self.second_pass_routers = nn.ModuleDict()
                for i in self.local_block_ids():
                    mlp = self.block(i).mlp
                    with seeded(init_seed, f"core.second_pass_routers.{i}"):
                        router = type(mlp.router)(config=mlp.config, pg_collection=_pg_collection())
                    router.set_layer_number(mlp.router.layer_number)
                    self.second_pass_routers[str(i)] = router

    def _record_moe(self, router, args, output) -> None:
        if self.moe_records is None or self._moe_tag is None:
            return
        x = args[0]
        with torch.no_grad():
            logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), router.weight.float())
        routing_map = output[1]
        self.moe_records.append(MoERecord(self._moe_tag[0], self._moe_tag[1], logits.detach(),
                                          routing_map.detach().reshape(logits.shape).bool()))

    def execution(self, depth: int) -> tuple[int, int]:
        """(block, pass) that core execution ``depth`` (1-based) runs in a fixed plan."""
        nb = self.cfg.num_blocks
        if self.cfg.plan == "accordion":
            return (depth - 1, 0) if depth <= nb else (depth - 1 - nb, 1)
        return (depth - 1) % nb, (depth - 1) // nb

    def _pass_context(self, block: int, pass_index: int, stack: contextlib.ExitStack):
        """Enter the pass-specific sub-modules of ``block``; returns the write gates (or None)."""
        from megatron_lol.model.library import swapped_modules

        if pass_index == 0:
            return None
        layer = self.block(block)
        if self.pass_attention is not None:
            att = self.pass_attention[f"{block}_{pass_index}"]
            stack.enter_context(swapped_modules(layer, input_layernorm=att.input_layernorm,
                                                self_attention=att.self_attention))
        if self.second_pass_routers is not None:
            stack.enter_context(swapped_modules(layer.mlp, router=self.second_pass_routers[str(block)]))
        if self.loop_gates is not None:
            return self.loop_gates[block, 0], self.loop_gates[block, 1]
        return None

    # ------------------------------------------------------------------ helpers
    def local_block_ids(self) -> list:
        from megatron_lol.parallel.layout import local_blocks

        if self.cfg.plan != "lol":  # fixed plans run every block on every token: not sharded
            return list(range(self.cfg.num_blocks))
        ep, ep_rank = _expert_parallel()
        return local_blocks(self.cfg.num_blocks, ep, ep_rank)

    def _expert_group(self):
        ep, _ = _expert_parallel()
        if ep == 1 or self.cfg.plan != "lol":
            return None
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_group()

    def block(self, index: int):
        return self.blocks[str(index)]

    def router_for(self, depth: int) -> WindowRouter:
        return self.routers[0 if len(self.routers) == 1 else depth - 1]

    def _set_film(self, block: int, depth: int, on: bool) -> None:
        if self.cfg.film == "off":
            return
        for i, norm in enumerate(layer_norms(self.block(block))):
            if not on:
                norm.film = None
            elif self.cfg.film == "depth":
                norm.film = (self.film_gamma[depth - 1, i], self.film_beta[depth - 1, i])
            else:
                norm.film = (self.film_gamma[depth - 1, block, i], self.film_beta[depth - 1, block, i])

    def _call_block(self, block: int, depth: int, x: torch.Tensor, mask: SegmentMask, rope,
                    pass_index: int = 0) -> torch.Tensor:
        """Run one library block on ``x`` ([s, b, h] or packed [T, 1, h]).

        With full activation recomputation the whole block call (FiLM and
        pass-specific parts included) is re-run in the backward pass through
        megatron-core's checkpoint.
        """
        if self.use_te and rope is not None and mask.chunk is not None:
            rope = self._rope_table  # TE (THD) restarts positions per window itself

        def run(hidden, segments, rope_):
            self._set_film(block, depth, True)
            try:
                with contextlib.ExitStack() as stack:
                    gates = self._pass_context(block, pass_index, stack)
                    m = SegmentMask(segments=segments, chunk=mask.chunk, sliding=mask.sliding)
                    return run_layer(self.block(block), hidden, m, rope_, self.use_te, gates=gates)
            finally:
                self._set_film(block, depth, False)

        self._moe_tag = (block, pass_index)  # not set while a checkpoint recomputes in the backward
        try:
            if self.recompute_full and self.training and torch.is_grad_enabled():
                from megatron.core import tensor_parallel

                return tensor_parallel.checkpoint(run, False, x, mask.segments, rope)
            return run(x, mask.segments, rope)
        finally:
            self._moe_tag = None

    def decide(self, depth: int, windows: WindowLayout, flat: torch.Tensor,
               forced: Optional[ForcedPath], noise_seeds: Optional[torch.Tensor] = None,
               row_length: int = 0) -> RoutingDecision:
        """Router (or forced path) for the windows of one depth."""
        summaries = router_summaries(windows, flat, self.depth_vectors[depth - 1])
        router = self.router_for(depth)
        eps = None
        if noise_seeds is not None and self.training and router.noise:
            eps = window_noise(windows, noise_seeds, depth, self.cfg.num_blocks, row_length)
        probs = router.probabilities(summaries, eps)
        bias = self.balancer.for_depth(depth) if self.balancer is not None else None
        choice, gate = choose_blocks(probs, bias)
        if forced is not None:
            is_forced, ids, gates = forced.lookup(depth, windows)
            choice = torch.where(is_forced, ids, choice)
            gate = torch.where(is_forced, gates.to(gate.dtype), gate)
        return RoutingDecision(probs=probs, choice=choice, gate=gate)

    # ------------------------------------------------------------------ forward
    def _needs_device_mode(self) -> bool:
        """Whether this forward may create tensors through megatron's CUDA device calls.

        On one TP and EP rank, with no MoE layer and no recomputation in the
        core, the core's forward runs only our dispatch code and megatron's
        local layer without collectives, so it runs outside the CPU platform's
        device mode (see ``platform.device_mode_suspended``: a CUDA use there
        would raise, not run elsewhere).
        """
        from megatron.core import parallel_state

        if self.use_te or self.recompute_full or self.cfg.moe_layers == "all" or _expert_parallel()[0] > 1:
            return True
        return (parallel_state.model_parallel_is_initialized()
                and parallel_state.get_tensor_model_parallel_world_size() > 1)

    def forward(self, *args, **kwargs) -> CoreOutput:
        """See :meth:`_forward`; on CPU, outside the device mode when that is safe."""
        if self._needs_device_mode():
            return self._forward(*args, **kwargs)
        from megatron_lol.platform import device_mode_suspended

        with device_mode_suspended():
            return self._forward(*args, **kwargs)

    def _forward(self, states: torch.Tensor, docs: DocumentLayout, rope: torch.Tensor, depth: Optional[int] = None,
                 depth_range: Optional[tuple] = None, forced: Optional[ForcedPath] = None, record: bool = False,
                 backprop_depth: Optional[int] = None, first_window_full_backprop: bool = True,
                 noise_seeds: Optional[torch.Tensor] = None) -> CoreOutput:
        """``states``: [s, b, h] output of the prelude. ``rope``: [s, 1, 1, d] row-position freqs.

        ``noise_seeds`` [b]: one seed per row for the router noise (see ``window_noise``);
        None draws it from the global RNG. ``depth_range``: the (first, last)
        routed depths this pipeline stage hosts; depths beyond ``depth`` (the
        current, possibly grown, depth) are skipped.
        """
        cfg = self.cfg
        depth = cfg.core_depth if depth is None else depth
        s_len, b, h = states.shape
        self._row_length = s_len
        self._rope_table = rope
        flat = states.transpose(0, 1).reshape(b * s_len, h)
        injected_from = flat
        token_rope = rope.repeat(b, 1, 1, 1) if rope is not None else None  # [T, 1, 1, d], row-major
        out = CoreOutput(states=states)
        aux_terms = []
        loads = []
        first, last = depth_range or (1, cfg.core_depth)
        for l in range(first, min(last, depth) + 1):
            if cfg.input_injection:
                mix = torch.sigmoid(self.injection_logit)
                flat = mix * flat + (1 - mix) * injected_from
            truncated = (backprop_depth is not None and self.training and torch.is_grad_enabled()
                         and l <= depth - backprop_depth)
            if self.routed or cfg.dense_attention == "strided":
                windows = WindowLayout.build(docs, l, cfg.window_size, cfg.window_shift)
            else:
                windows = None
            if self.routed:
                decision = self.decide(l, windows, flat, forced, noise_seeds, s_len)
                if self.training:
                    if self.balancer is not None:
                        self.balancer.record(l, decision.choice)
                    if cfg.balancing == "loss_free" and cfg.seq_aux_loss_coeff > 0:
                        aux_terms.append(cfg.seq_aux_loss_coeff * sequence_aux_loss(windows, decision)
                                         / max(1, windows.num_docs))
                    elif cfg.balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
                        aux_terms.append(cfg.aux_loss_coeff * global_aux_loss(decision))
                loads.append((l, torch.bincount(decision.choice.detach(), minlength=cfg.num_blocks)))
                if record:
                    out.records.append(DepthRecord(l, decision.choice.detach(), decision.gate.detach(),
                                                   decision.probs.detach(), windows.window_doc,
                                                   windows.window_ordinal))
                flat = self._routed_update(l, flat, windows, decision, token_rope, truncated,
                                           first_window_full_backprop)
            else:
                flat = self._fixed_update(l, flat, docs, windows, token_rope, b, s_len, truncated)
        out.states = flat.view(b, s_len, h).transpose(0, 1).contiguous()
        if aux_terms:
            out.aux_loss = torch.stack(aux_terms).sum()
        if self.routed:
            # rows for every depth of the model; zero for depths not run here (other stages, not grown yet)
            out.block_loads = torch.zeros(cfg.core_depth, cfg.num_blocks, dtype=torch.long)
            for l, row in loads:
                out.block_loads[l - 1] = row
        return out

    def _routed_update(self, depth, flat, windows, decision, token_rope, truncated, first_window_full):
        token_choice = decision.choice.index_select(0, windows.token_window)
        T = flat.shape[0]
        W = self.cfg.window_size
        s_len = self._row_length

        def call(block, packed, segments, rope_index):
            # rope_index: flat token index or row position (< s_len); the row-major token_rope
            # holds row position t mod s_len at flat index t, so both index it directly
            rope = token_rope.index_select(0, rope_index) if token_rope is not None else None
            mask = SegmentMask(segments=segments.view(1, -1), chunk=W)
            return self._call_block(block, depth, packed.unsqueeze(1), mask, rope).squeeze(1)

        ep_group = self._expert_group()

        def run(plan):
            if ep_group is None:
                return run_grouped(plan, flat, call)
            from megatron_lol.parallel.window_dispatch import run_grouped_expert_parallel

            rope_index = torch.arange(T, device=flat.device) % s_len
            return run_grouped_expert_parallel(plan, flat, call, rope_index, ep_group)

        def update(states, plan, gate):
            """``s + alpha * (E(s) - s)`` for the planned tokens (see dispatch.run_grouped_gated)."""
            if ep_group is None:
                return run_grouped_gated(plan, states, call, gate)
            return apply_gated_updates(states, plan, run(plan), gate)

        if not truncated:
            plan = plan_dispatch(token_choice, windows.token_window, self.cfg.num_blocks)
            return update(flat, plan, decision.gate)
        # Truncated backprop through depth (SPEC 1.4): this depth's block updates are
        # constants for autograd, except for first-window tokens when enabled. The
        # state itself keeps its identity path, so earlier layers still get gradients.
        keep = windows.window_ordinal.index_select(0, windows.token_window) == 0
        if not first_window_full:
            keep = torch.zeros_like(keep)
        out = flat
        grad_idx = torch.nonzero(keep).squeeze(1)
        collective = ep_group is not None  # EP ranks must all take part, even with nothing to send
        if grad_idx.numel() or collective:
            plan = plan_dispatch(token_choice, windows.token_window, self.cfg.num_blocks, subset=grad_idx)
            out = update(out, plan, decision.gate)
        rest = torch.nonzero(~keep).squeeze(1)
        if rest.numel() or collective:
            with torch.no_grad():
                plan = plan_dispatch(token_choice, windows.token_window, self.cfg.num_blocks, subset=rest)
                frozen = run(plan)
            # added outside no_grad, so the state keeps its identity path (and the first-window graph)
            out = apply_gated_updates(out, plan, frozen, decision.gate.detach())
        return out

    def _fixed_update(self, depth, flat, docs, windows, token_rope, b, s_len, truncated):
        cfg = self.cfg
        block, pass_index = self.execution(depth)
        with torch.no_grad() if truncated else contextlib.nullcontext():
            if cfg.dense_attention == "strided":
                mask = SegmentMask(segments=windows.token_window.view(1, -1), chunk=cfg.window_size)
                new = self._call_block(block, depth, flat.unsqueeze(1), mask, token_rope, pass_index).squeeze(1)
            else:
                x = flat.view(b, s_len, -1).transpose(0, 1)
                sliding = cfg.window_size if cfg.dense_attention == "sliding" else None
                mask = SegmentMask(segments=docs.doc_index, sliding=sliding)
                # the whole sequence's positions: under sequence parallelism x holds s/tp rows and
                # megatron's attention gathers them before RoPE
                new = self._call_block(block, depth, x, mask, self._rope_table, pass_index)
                new = new.transpose(0, 1).reshape(b * s_len, -1)
        if truncated:
            return flat + (new - flat).detach()
        return new
