"""``LoLGPTModel``: embedding, prelude, core, coda, LM head.

Built from megatron-core parts (``LanguageModule`` for the loss and the tied /
pipeline-shared embedding, ``LanguageModelEmbedding``, ``RotaryEmbedding``,
``ColumnParallelLinear`` for the head, ``TransformerLayer`` from a
``ModuleSpec`` for every layer and block). Document boundaries are derived from
the EOD token, so attention never crosses a document anywhere and windows,
window ordinals and router prefixes restart per document (docs/model.md,
"Documents").

Two layouts of the hidden states between the embedding and the head:

* ``[s, b, h]`` (local spec), megatron-core's usual one;
* packed (Transformer Engine spec): the micro-batch is one row-major stream
  ``[b*s, 1, h]`` whose documents are THD packed sequences, as Megatron-LM
  packs sequences (micro-batch 1, ``cu_seqlens``). Sequence parallelism then
  shards that stream, so every rank's attention sees whole documents after
  its all-gather; pipeline stages exchange ``[b*s, 1, h]`` tensors
  (:meth:`LoLGPTModel.pipeline_shape`).

The model is built on the CPU (the same master weights for every layout) and
moved to the device policy's device by its user before DDP wraps it; in the
forward every tensor follows the device of the input ids and parameters.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lol.backends import select_backend
from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.block_call import call_block
from megatron_lol.model.core import Core
from megatron_lol.model.forward_options import ForwardOptions
from megatron_lol.model.grouped_core import routes_grouped
from megatron_lol.model.init import seed_experts_by_global_index, seeded
from megatron_lol.model.library import (
    LocalRMSNorm,
    block_spec,
    build_layer,
    core_config,
    transformer_config,
    use_te_for,
)
from megatron_lol.model.parts import model_parts
from megatron_lol.model.precision import fp8_autocast
from megatron_lol.model.windows import DocumentLayout
from megatron_lol.plan.routing import routing_of
from megatron_lol.plan.stages import check_pipeline_layout, stage_layout
from megatron_lol.plan.windows import windows_of
from megatron_lol.platform import cuda_available
from megatron_lol.platform.trace_ranges import trace_range


class AuxLossAttach(torch.autograd.Function):
    """Identity on the hidden states whose backward also back-propagates ``aux_loss``.

    This puts the balancing loss into the graph of whatever pipeline stage
    computed it (as megatron-core does for MoE auxiliary losses), scaled like
    the LM loss: the caller passes ``scale`` (the trainer: ``1 / num_microbatches``).
    """

    @staticmethod
    def forward(ctx, hidden, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return hidden

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """The vocabulary padded to a multiple of ``divisible_by``, whatever the TP size: unlike
    Megatron-LM (a multiple of ``divisible_by * TP``) the model does not change with the layout.
    ``tensor_parallel`` must divide the result (see :mod:`megatron_lol.training.vocab`)."""
    padded = ((vocab_size + divisible_by - 1) // divisible_by) * divisible_by
    if padded % tensor_parallel:
        raise ValueError(f"a vocabulary of {padded} rows cannot be split over {tensor_parallel} tensor-parallel ranks")
    return padded


def _language_module():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return LanguageModule


class LoLGPTModel(_language_module()):
    """A Library-of-Layers decoder (also dense and looped plans, see :mod:`.core`).

    Subclasses megatron-core's ``LanguageModule`` for the vocab-parallel loss and
    the tied / pipeline-shared embedding plumbing.
    """

    def __init__(
        self,
        model: ModelConfig,
        vocab_size: int,
        eod_id: Optional[int],
        *,
        parallel=None,
        max_sequence_length: int = 4096,
        tconfig=None,
        init_seed: Optional[int] = 1234,
        vp_stage: Optional[int] = None,
        packed_sequences: Optional[bool] = None,
        gradient_accumulation_fusion: bool = False,
    ):
        """Build this rank's share of the model.

        Under pipeline parallelism the stage (and virtual stage ``vp_stage``) is
        read from megatron's ``parallel_state``; see :mod:`megatron_lol.plan.stages`.
        Layers are keyed by their global index, so checkpoint keys do not
        depend on the layout. ``packed_sequences``: the packed layout (default:
        with the Transformer Engine spec, which needs it); tests run the local
        spec packed to check that layout on the CPU. ``gradient_accumulation_fusion``:
        the model trains under megatron-core's DDP (see ``library.transformer_config``).
        """
        import dataclasses

        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.enums import ModelType
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        plan = model.execution_plan()
        n_layers = model.n_prelude + model.n_coda + plan.num_stored_blocks
        use_te = use_te_for(model)
        super().__init__(
            config=tconfig
            or transformer_config(
                model,
                parallel,
                num_layers=n_layers,
                use_te=use_te,
                gradient_accumulation_fusion=gradient_accumulation_fusion,
            )
        )
        self.model_type = ModelType.encoder_or_decoder
        self.cfg = model
        self.plan = plan
        self.eod_id = eod_id
        # router-only token ids (docs/model.md, "Router-only tokens"); moves with the module (.cuda())
        router_only = list(routing_of(model).router_only_tokens)
        self.register_buffer("router_only_ids", torch.tensor(router_only, dtype=torch.long), persistent=False)
        self.vocab_size = vocab_size
        self.vp_stage = vp_stage
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        vpp = self.config.virtual_pipeline_model_parallel_size if pp > 1 else None
        check_pipeline_layout(model, plan.depth, pp, vpp, plan.name, plan.pipeline_ok)
        self.stage = stage_layout(
            model, plan.depth, pp, vpp, parallel_state.get_pipeline_model_parallel_rank(), vp_stage
        )
        self.pre_process, self.post_process = self.stage.first, self.stage.last
        self.use_te = use_te
        self.packed = use_te if packed_sequences is None else packed_sequences
        if use_te and not self.packed:
            raise ValueError(
                "LoLGPTModel(packed_sequences=False): the Transformer Engine spec runs packed (THD) sequences only"
            )
        moe = model.moe.num_experts if model.moe.layers != "none" else None
        if moe:
            # megatron-core's MoE loss logging tracker is process-global and sized by the first
            # model's num_layers; a model built later in the same process (tests, notebooks,
            # conversion) with more layers would index past it
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()
        fixed_spec = block_spec(self.use_te, num_experts=moe)  # prelude / coda
        # the library runs grouped (stacked local-spec weights, torch._grouped_mm) or per block, in TE layers
        # under the TE spec; a part of the norm hook (FiLM) modulates the core's blocks' norm outputs: under TE
        # they get separate norm modules for it
        grouped = routes_grouped(model, cuda_available(), parallel.routed_core if parallel else "auto")
        self.grouped_library = self.use_te and grouped
        core_te = self.use_te and not self.grouped_library
        modulated = any(part.hook == "norm" for part in model_parts(model, model.execution_plan()))
        spec = block_spec(core_te, num_experts=moe if model.moe.layers == "all" else None, film=modulated)
        self.share_embeddings_and_output_weights = not model.untie_embeddings_and_output_weights

        if self.pre_process:
            with seeded(init_seed, "embedding"):
                self.embedding = LanguageModelEmbedding(
                    self.config, vocab_size, max_sequence_length, position_embedding_type="none"
                )
        self.rotary = RotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=1.0,
            rotary_base=float(model.rotary_base),
            seq_len_interpolation_factor=(model.rotary_scaling_factor if model.rotary_scaling_factor != 1 else None),
            use_cpu_initialization=True,
        )
        self.prelude = nn.ModuleDict()
        for i in self.stage.prelude:
            with seeded(init_seed, f"prelude.{i}"):
                self.prelude[str(i)] = build_layer(fixed_spec, self.config, i + 1, vp_stage)
        self.core = None
        if self.stage.depths is not None:
            # The core packs windows of the whole sequence, so it runs on the gathered
            # (TP-replicated) sequence: its blocks are tensor parallel without SP.
            core_cfg = core_config(self.config, model, self.packed)  # Foil: the core's own expert count
            if self.grouped_library:
                # local-spec blocks: megatron's unfused RoPE and no FP8 (the grouped GEMMs run in BF16)
                core_cfg = dataclasses.replace(core_cfg, apply_rope_fusion=False, fp8=None)
            if core_cfg.sequence_parallel and plan.gathers_sequence:
                core_cfg = dataclasses.replace(core_cfg, sequence_parallel=False)
            self.core = Core(
                model,
                core_cfg,
                spec,
                first_layer_number=model.n_prelude + 1,
                init_seed=init_seed,
                vp_stage=vp_stage,
                packed=self.packed,
                grouped=grouped,
            )
        first_coda = model.n_prelude + plan.num_stored_blocks + 1
        self.coda = nn.ModuleDict()
        for i in self.stage.coda:
            with seeded(init_seed, f"coda.{i}"):
                self.coda[str(i)] = build_layer(fixed_spec, self.config, first_coda + i, vp_stage)
        if self.post_process:
            self.final_norm = LocalRMSNorm(self.config, model.hidden_size, eps=model.norm_epsilon)
            with seeded(init_seed, "output_layer"):
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    model.hidden_size,
                    vocab_size,
                    config=self.config,
                    init_method=self.config.init_method,
                    bias=False,
                    skip_bias_add=False,
                    gather_output=False,
                    skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
                )
        if self.share_embeddings_and_output_weights and (self.pre_process or self.post_process):
            # megatron-core's tied-embedding plumbing (copies and all-reduces across stages)
            self.setup_embeddings_and_output_layer()
        if moe:
            seed_experts_by_global_index(self, init_seed)
        self.input_tensor = None

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        options: Optional[ForwardOptions] = None,
        *,
        docs: Optional[DocumentLayout] = None,
        return_hidden: bool = False,
        return_core: bool = False,
        **overrides,
    ):
        """``input_ids`` [b, s]. With ``labels`` returns the per-token loss [b, s],
        else the logits [b, s, vocab] (this rank's vocab shard under TP). A
        pipeline stage without the head returns its output hidden states.

        ``options``: a :class:`~.forward_options.ForwardOptions` (depth, budget, forced path, records,
        truncated backprop, router-noise seeds, balancing-gradient scale, routing check, host layout);
        keyword arguments named like its fields override it (``model(x, depth=2)``).
        ``docs``: the documents (default: from the EOD tokens, or the layout's when there is one).
        ``return_core``: return ``(output, CoreOutput or None)``: the routing records, MoE records,
        block loads and balancing loss of this stage's core.
        """
        opts = ForwardOptions.of(options, overrides, "LoLGPTModel.forward")
        b, s = input_ids.shape
        if opts.layout is not None:
            docs = opts.layout.document_layout()
        if docs is None:
            docs = DocumentLayout.from_tokens(input_ids, self.eod_id)
        router_only = self.router_only_index(input_ids)
        if router_only is not None:
            # the layers see the filler: a router-only token's identity reaches the router only
            input_ids = torch.where(router_only >= 0, routing_of(self.cfg).router_only_filler, input_ids)
        if self.pre_process:
            # packed: the micro-batch is one row of b*s tokens (so is the embedding's SP scatter)
            hidden = self.embedding(
                input_ids=input_ids.reshape(1, b * s) if self.packed else input_ids, position_ids=None
            )
        else:
            hidden = self.input_tensor
        rope = self.rotary(s)  # [s, 1, 1, d]
        with fp8_autocast(self.config):  # FP8 (when configured) for the layers' GEMMs, not the head
            hidden, core = self._layers(hidden, docs, rope, opts, router_only)
        out = self._head(hidden, labels, return_hidden, b, s)
        if labels is not None and router_only is not None and not (return_hidden or not self.post_process):
            # a router-only token is given, never predicted: its label carries no loss
            out = torch.where(self.router_only_index(labels) >= 0, 0.0, out)
        return (out, core) if return_core else out

    def _layers(self, hidden, docs, rope, opts: ForwardOptions, router_only=None) -> tuple:
        """Prelude, core and coda of this stage: ``(hidden states, CoreOutput or None)``."""
        from megatron.core import tensor_parallel

        layout = opts.layout
        # documents as THD sequences: offsets from the host-built layout when there is one (no device read)
        # and, packed, every token's position in its document: RoPE angles per token (no THD RoPE host reads)
        doc_mask = SegmentMask(
            segments=docs.doc_index,
            cu_seqlens=layout.doc_cu_seqlens if layout is not None else None,
            positions=docs.positions if self.packed else None,
        )
        backend = select_backend(hidden.device)
        recompute = self.config.recompute_granularity == "full"
        with trace_range("prelude"):
            for layer in self.prelude.values():
                hidden, _ = call_block(
                    layer, hidden, doc_mask, rope, packed=self.packed, recompute=recompute, backend=backend
                )
        core = None
        if self.core is not None:
            if self.plan.has_budgets:
                depth = self.plan.depth_for(opts.budget)
            else:
                self.plan.resolve_budget(opts.budget)  # refuses a budget for a plan without one
                depth = self.plan.depth if opts.depth is None else opts.depth
            first, last = self.stage.depths
            steps = [step for step in self.plan.steps(depth) if first <= step.depth <= last]
            sequence_parallel = self.config.sequence_parallel and self.plan.gathers_sequence
            if sequence_parallel:
                # router inputs (window means) need every token of the sequence
                hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            core = self.core(hidden, docs, rope, steps, opts, depth=depth, router_only=router_only)
            hidden = core.states
            if sequence_parallel:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
            if core.aux_loss is not None and torch.is_grad_enabled():
                hidden = AuxLossAttach.apply(hidden, core.aux_loss, opts.aux_loss_scale)
        with trace_range("coda"):
            for layer in self.coda.values():
                hidden, _ = call_block(
                    layer, hidden, doc_mask, rope, packed=self.packed, recompute=recompute, backend=backend
                )
        return hidden, core

    def _head(
        self, hidden: torch.Tensor, labels: Optional[torch.Tensor], return_hidden: bool, b: int, s: int
    ) -> torch.Tensor:
        if not self.post_process:
            return hidden
        hidden = self.final_norm(hidden)
        if return_hidden:
            if self.packed and hidden.shape[0] == b * s:  # [b*s, 1, h] -> [s, b, h]
                return hidden.view(b, s, -1).transpose(0, 1)
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, v/tp]; packed: [b*s, 1, v/tp]
        if labels is None:
            if self.packed:
                return logits.view(b, s, -1)
            return logits.transpose(0, 1).contiguous()
        if self.packed:
            return self.compute_language_model_loss(labels.reshape(1, b * s), logits).view(b, s)
        return self.compute_language_model_loss(labels, logits)

    def host_layout(self, tokens: torch.Tensor):
        """The :class:`~.host_layout.HostLayout` of the micro-batch ``tokens`` ``[b, s]`` on the CPU (its
        documents and the windows of this plan's routed depths; no router noise: an evaluation forward),
        for a caller that builds its batch on the host, as the trainer does, and passes it as
        ``layout=`` (moved with ``.to(device)``): the forward then does not build it."""
        from megatron_lol.model.host_layout import build_host_layout, routed_depths

        return build_host_layout(
            tokens,
            self.eod_id,
            windows_of(self.cfg).size,
            windows_of(self.cfg).shift,
            routed_depths(self.plan),
            self.plan.num_stored_blocks,
        )

    def router_only_index(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """Each token's index in ``model.plan.routing.router_only_tokens`` (-1: an ordinary token); None when
        there are none."""
        if self.router_only_ids.numel() == 0:
            return None
        match = tokens.unsqueeze(-1) == self.router_only_ids
        return torch.where(match.any(-1), match.to(torch.int32).argmax(-1).to(torch.long), -1)

    def pipeline_shape(self, seq_length: int, micro_batch_size: int) -> tuple:
        """``(seq_length, micro_batch_size)`` of the tensors pipeline stages exchange (the schedules size
        their receive buffers from them): packed, one stream of ``micro_batch_size * seq_length`` tokens."""
        if self.packed:
            return seq_length * micro_batch_size, 1
        return seq_length, micro_batch_size

    # ------------------------------------------------------------ utilities
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Layout-independent distributed-checkpoint keys (see :mod:`megatron_lol.parallel.sharded_state`)."""
        from megatron_lol.parallel.sharded_state import lol_sharded_state_dict

        return lol_sharded_state_dict(self, prefix, metadata)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand a non-first stage its input activations here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    @property
    def balancer(self):
        return getattr(self.core, "balancer", None)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from this rank's shard (identity without TP)."""
        from megatron.core import tensor_parallel

        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
