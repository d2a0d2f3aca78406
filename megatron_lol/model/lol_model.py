"""``LoLGPTModel``: embedding, prelude, routed core, coda, LM head.

Built from megatron-core parts (``LanguageModule`` for the loss and the tied /
pipeline-shared embedding, ``LanguageModelEmbedding``, ``RotaryEmbedding``,
``ColumnParallelLinear`` for the head, ``TransformerLayer`` from a
``ModuleSpec`` for every layer and block). Document boundaries are derived from
the EOD token, so attention never crosses a document anywhere and windows,
window ordinals and router prefixes restart per document (SPEC 1.1).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Optional

import torch
from torch import nn

from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.core import CoreOutput, ForcedPath, RoutedCore
from megatron_lol.model.library import (FiLMRMSNorm, block_spec, build_layer, core_config, run_layer, transformer_config,
                                        use_te_for)
from megatron_lol.model.windows import DocumentLayout


def core_gathers_sequence(model: ModelConfig) -> bool:
    """Whether the core needs the whole sequence on every tensor-parallel rank under SP.

    LoL's router reads window means over the whole sequence and the strided
    attention packs windows across rows, so those cores run on the gathered
    sequence (TP without SP). Fixed plans with full or sliding attention keep
    the sequence sharded like any megatron layer — which megatron-core's MoE
    layers require when TP > 1 (Foil, Accordion).
    """
    return model.plan == "lol" or model.dense_attention == "strided"


class AuxLossAttach(torch.autograd.Function):
    """Identity on the hidden states whose backward also back-propagates ``aux_loss``.

    This puts the balancing loss into the graph of whatever pipeline stage
    computed it (as megatron-core does for MoE auxiliary losses), scaled like
    the LM loss: ``scale`` is set by the trainer to ``1 / num_microbatches``.
    """

    scale: float = 1.0

    @staticmethod
    def forward(ctx, hidden, aux_loss):
        ctx.save_for_backward(aux_loss)
        return hidden

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, AuxLossAttach.scale)


@contextlib.contextmanager
def seeded(seed: Optional[int], key: str):
    """Initialise one component from its own RNG stream, derived from (seed, key).

    Every rank draws the full master weight of each component it builds from
    the same stream, whatever else it builds: so the same seed gives the same
    initial weights whatever the parallel layout (TP splits the master weight;
    a pipeline stage or expert-parallel rank that skips other components does
    not shift this one's stream).
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
        yield


def seed_experts_by_global_index(model: nn.Module, seed: Optional[int]) -> None:
    """Give every MoE expert its own initialisation stream, keyed by its *global* index.

    megatron-core builds a rank's local experts one after another from one
    stream, so under expert parallelism rank 1's first expert would start like
    rank 0's first, and a layout would change the weights. Each local expert is
    re-initialised from a fresh megatron ``MLP`` built under ``seeded(seed,
    "<layer>.experts.<global index>")`` (same class, config and TP group; TP
    still splits the full master weight), so any EP x TP layout starts from the
    weights of one process.
    """
    if seed is None:
        return
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    ep = parallel_state.get_expert_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0
    for name, module in model.named_modules():
        if not isinstance(module, SequentialMLP):
            continue
        for i, expert in enumerate(module.local_experts):
            global_index = ep_rank * module.num_local_experts + i
            sub = MLPSubmodules(linear_fc1=type(expert.linear_fc1), linear_fc2=type(expert.linear_fc2))
            with seeded(seed, f"{name}.{global_index}"):
                fresh = MLP(module.config, sub, ffn_hidden_size=module.config.moe_ffn_hidden_size, is_expert=True,
                            tp_group=module.tp_group)
            with torch.no_grad():
                for (n, p), (n2, q) in zip(expert.named_parameters(), fresh.named_parameters()):
                    assert n == n2 and p.shape == q.shape, (name, n, n2)
                    p.copy_(q)


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

    def __init__(self, model: ModelConfig, vocab_size: int, eod_id: Optional[int], parallel=None,
                 max_sequence_length: int = 4096, tconfig=None, init_seed: Optional[int] = 1234,
                 vp_stage: Optional[int] = None):
        """Build this rank's share of the model.

        Under pipeline parallelism the stage (and virtual stage ``vp_stage``) is
        read from megatron's ``parallel_state``; see :mod:`megatron_lol.parallel.layout`.
        Layers are keyed by their global index, so checkpoint keys do not
        depend on the layout.
        """
        import dataclasses

        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.enums import ModelType
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        from megatron_lol.parallel.layout import check_pipeline_layout, stage_plan

        n_layers = model.n_prelude + model.n_coda + model.num_blocks
        super().__init__(config=tconfig or transformer_config(model, parallel, num_layers=n_layers))
        self.model_type = ModelType.encoder_or_decoder
        self.cfg = model
        self.eod_id = eod_id
        self.vocab_size = vocab_size
        self.vp_stage = vp_stage
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        vpp = self.config.virtual_pipeline_model_parallel_size if pp > 1 else None
        check_pipeline_layout(model, pp, vpp)
        self.stage = stage_plan(model, pp, vpp, parallel_state.get_pipeline_model_parallel_rank(), vp_stage)
        self.pre_process, self.post_process = self.stage.first, self.stage.last
        self.use_te = use_te_for(model)
        if self.use_te and self.config.sequence_parallel:
            from megatron_lol.config.schema import ConfigError

            raise ConfigError("parallel.sequence_parallel: not yet supported with Transformer Engine THD packing "
                              "of documents; set model.use_transformer_engine: false or sequence_parallel: false")
        moe = model.num_experts if model.moe_layers != "none" else None
        if moe:
            # megatron-core's MoE loss logging tracker is process-global and sized by the first
            # model's num_layers; a model built later in the same process (tests, notebooks,
            # conversion) with more layers would index past it
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()
        fixed_spec = block_spec(self.use_te, num_experts=moe)  # prelude / coda
        spec = block_spec(self.use_te, num_experts=moe if model.moe_layers == "all" else None)
        self.share_embeddings_and_output_weights = not model.untie_embeddings_and_output_weights

        if self.pre_process:
            with seeded(init_seed, "embedding"):
                self.embedding = LanguageModelEmbedding(self.config, vocab_size, max_sequence_length,
                                                        position_embedding_type="none")
        self.rotary = RotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=1.0, rotary_base=float(model.rotary_base),
            seq_len_interpolation_factor=(model.rotary_scaling_factor if model.rotary_scaling_factor != 1 else None),
            use_cpu_initialization=True)
        self.prelude = nn.ModuleDict()
        for i in self.stage.prelude:
            with seeded(init_seed, f"prelude.{i}"):
                self.prelude[str(i)] = build_layer(fixed_spec, self.config, i + 1, vp_stage)
        self.core = None
        if self.stage.depths is not None:
            # The core packs windows of the whole sequence, so it runs on the gathered
            # (TP-replicated) sequence: its blocks are tensor parallel without SP.
            core_cfg = core_config(self.config, model)  # Foil: the core's own expert count
            if core_cfg.sequence_parallel and core_gathers_sequence(model):
                core_cfg = dataclasses.replace(core_cfg, sequence_parallel=False)
            self.core = RoutedCore(model, core_cfg, spec, first_layer_number=model.n_prelude + 1,
                                   init_seed=init_seed, vp_stage=vp_stage, use_te=self.use_te)
        first_coda = model.n_prelude + model.num_blocks + 1
        self.coda = nn.ModuleDict()
        for i in self.stage.coda:
            with seeded(init_seed, f"coda.{i}"):
                self.coda[str(i)] = build_layer(fixed_spec, self.config, first_coda + i, vp_stage)
        if self.post_process:
            self.final_norm = FiLMRMSNorm(self.config, model.hidden_size, eps=model.norm_epsilon)
            with seeded(init_seed, "output_layer"):
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    model.hidden_size, vocab_size, config=self.config, init_method=self.config.init_method,
                    bias=False, skip_bias_add=False, gather_output=False,
                    skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights)
        if self.share_embeddings_and_output_weights and (self.pre_process or self.post_process):
            # megatron-core's tied-embedding plumbing (copies and all-reduces across stages)
            self.setup_embeddings_and_output_layer()
        if moe:
            seed_experts_by_global_index(self, init_seed)
        self.input_tensor = None
        self.last_core: Optional[CoreOutput] = None

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                docs: Optional[DocumentLayout] = None, depth: Optional[int] = None,
                forced_path: Optional[ForcedPath] = None, record: bool = False,
                backprop_depth: Optional[int] = None, first_window_full_backprop: bool = True,
                noise_seeds: Optional[torch.Tensor] = None, return_hidden: bool = False,
                budget: Optional[int] = None):
        """``input_ids`` [b, s]. With ``labels`` returns the per-token loss [b, s],
        else the logits [b, s, vocab] (this rank's vocab shard under TP). A
        pipeline stage without the head returns its output hidden states.

        ``budget``: Accordion's loop budget ``k`` (default: ``model.loop_budget``,
        else the largest of ``loop_budgets``); it sets the core depth to ``L + k``.
        """
        from megatron.core import tensor_parallel

        b, s = input_ids.shape
        if docs is None:
            docs = DocumentLayout.from_tokens(input_ids, self.eod_id)
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        else:
            hidden = self.input_tensor
        rope = self.rotary(s)  # [s, 1, 1, d]
        doc_mask = SegmentMask(segments=docs.doc_index)
        recompute = self.config.recompute_granularity == "full"
        for layer in self.prelude.values():
            hidden = run_layer(layer, hidden, doc_mask, rope, self.use_te, recompute)
        self.last_core = None
        if self.core is not None:
            if self.cfg.plan == "accordion":
                depth = self.cfg.num_blocks + self.resolve_budget(budget)
            depth = self.cfg.core_depth if depth is None else depth
            sequence_parallel = self.config.sequence_parallel and core_gathers_sequence(self.cfg)
            if sequence_parallel:
                # router inputs (window means) need every token of the sequence
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=False)
            core = self.core(hidden, docs, rope, depth=depth, depth_range=self.stage.depths, forced=forced_path,
                             record=record, backprop_depth=backprop_depth,
                             first_window_full_backprop=first_window_full_backprop, noise_seeds=noise_seeds)
            hidden = core.states
            if sequence_parallel:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
            if core.aux_loss is not None and torch.is_grad_enabled():
                hidden = AuxLossAttach.apply(hidden, core.aux_loss)
            self.last_core = core
        for layer in self.coda.values():
            hidden = run_layer(layer, hidden, doc_mask, rope, self.use_te, recompute)
        if not self.post_process:
            return hidden
        hidden = self.final_norm(hidden)
        if return_hidden:
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    # ------------------------------------------------------------ utilities
    def resolve_budget(self, budget: Optional[int]) -> int:
        """Accordion's budget for a call: the given one, else the config's, else the largest."""
        cfg = self.cfg
        k = budget if budget is not None else cfg.loop_budget if cfg.loop_budget is not None else max(cfg.loop_budgets)
        if k not in cfg.loop_budgets:
            from megatron_lol.config.schema import ConfigError

            raise ConfigError(f"budget: {k} is not one of model.loop_budgets {cfg.loop_budgets}")
        return k

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
