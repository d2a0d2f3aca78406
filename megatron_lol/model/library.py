"""Blocks and fixed layers from megatron-core ``ModuleSpec``s.

A LoL block is an ordinary pre-norm transformer layer (RMSNorm, bias-free
attention with RoPE, SwiGLU MLP). We take megatron-core's GPT layer spec and
change only what LoL needs:

* ``core_attention`` becomes :class:`SegmentCausalAttention` (document- and
  window-blocked causal attention) on the local path; on GPUs with Transformer
  Engine, TE's fused attention is kept and fed THD ``PackedSeqParams``;
* the two norms become :class:`FiLMRMSNorm`, so that per-depth FiLM can modulate
  a block shared by all depths (SPEC 1.4) and sequence parallelism works with
  the local norm (its weight is marked ``sequence_parallel``).

Which implementation (TE or local) is decided here, once, from the config and
the platform; where it sits is the spec's business, as in megatron-core.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lol.config.schema import ConfigError, ModelConfig, ParallelConfig


class FiLMRMSNorm(nn.Module):
    """RMSNorm with an optional FiLM modulation ``gamma * Norm(h) + beta`` (after its own gain).

    The routed core sets :attr:`film` to the ``(gamma, beta)`` of the current
    depth before it runs a block and clears it afterwards; fixed layers never
    set it.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # megatron's grad all-reduce for sequence-parallel norms keys on this attribute
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
        self.film: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.film is not None:
            gamma, beta = self.film
            y = gamma.to(y.dtype) * y + beta.to(y.dtype)
        return y


def transformer_engine_usable() -> bool:
    from megatron_lol.platform import has_transformer_engine

    return has_transformer_engine()


def use_te_for(model: ModelConfig) -> bool:
    """TE spec when TE imports and CUDA is present, unless the config says otherwise."""
    available = transformer_engine_usable()
    if model.use_transformer_engine is None:
        return available
    if model.use_transformer_engine and not available:
        raise ConfigError("model.use_transformer_engine: true, but Transformer Engine with CUDA is not available")
    return model.use_transformer_engine


def transformer_config(model: ModelConfig, parallel: Optional[ParallelConfig] = None,
                       num_layers: Optional[int] = None, fp8: Optional[str] = None,
                       fp8_recipe: Optional[str] = None):
    """megatron-core ``TransformerConfig`` for the blocks and fixed layers of ``model``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = parallel or ParallelConfig()
    dtype = torch.bfloat16 if model.params_dtype == "bf16" else torch.float32
    kwargs = dict(
        num_layers=num_layers or max(1, model.n_prelude + model.n_coda + model.num_blocks),
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        # the block library's expert parallelism lives in parallel_state and the
        # core; megatron's TransformerConfig reserves this field for FFN MoE
        expert_model_parallel_size=parallel.expert_model_parallel_size if model.num_experts else 1,
        sequence_parallel=parallel.sequence_parallel,
        # the same seed gives the same weights whatever the layout: initialise the
        # full master weights on CPU and split them (megatron-core's own option)
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        recompute_granularity=parallel.recompute_granularity,
        recompute_method="uniform" if parallel.recompute_granularity == "full" else None,
        recompute_num_layers=1 if parallel.recompute_granularity == "full" else None,
    )
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe=fp8_recipe or "delayed")
    return TransformerConfig(**kwargs)


def block_spec(use_te: bool = False):
    """The ``ModuleSpec`` of one block / fixed layer."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_lol.model.attention import SegmentCausalAttention

    if use_te:
        # TE linears and fused attention (fed THD PackedSeqParams for windows);
        # FiLM and SP norms need the norms as separate modules, so we use the
        # unfused TENorm + TE linear layout of the spec.
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
        return spec
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SegmentCausalAttention)
    attn = dataclasses.replace(attn, submodules=attn_sub)
    sub = dataclasses.replace(sub, self_attention=attn, input_layernorm=FiLMRMSNorm,
                              pre_mlp_layernorm=FiLMRMSNorm)
    return dataclasses.replace(spec, submodules=sub)


def build_layer(spec, config, layer_number: int, vp_stage: Optional[int] = None):
    """Build one layer / block; ``layer_number`` is its global 1-based number.

    megatron-core adds a pipeline-stage offset to ``layer_number`` assuming its
    own even split of ``num_layers``; our plan places layers itself, so the
    global number is set back afterwards.
    """
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(spec, config=config, layer_number=layer_number,
                         vp_stage=vp_stage if config.virtual_pipeline_model_parallel_size else None)
    layer.layer_number = layer_number
    return layer


def layer_norms(layer) -> list[FiLMRMSNorm]:
    """The two FiLM-able norms of a block, in order (attention, MLP)."""
    return [m for m in (getattr(layer, "input_layernorm", None), getattr(layer, "pre_mlp_layernorm", None))
            if isinstance(m, FiLMRMSNorm)]
