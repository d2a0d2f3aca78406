"""Blocks and fixed layers from megatron-core ``ModuleSpec``s.

A LoL block is an ordinary pre-norm transformer layer (RMSNorm, bias-free
attention with RoPE, SwiGLU MLP). We take megatron-core's GPT layer spec and
change only what LoL needs:

* local spec: ``core_attention`` becomes :class:`SegmentCausalAttention`
  (document- and window-blocked causal attention) and the two norms become
  :class:`LocalRMSNorm` (separate modules, so that a step's FiLM can modulate
  their output, see ``block_call``; its weight is marked ``sequence_parallel``,
  so sequence parallelism works with the local norm);
* Transformer Engine spec (GPUs): megatron-core's TE layer spec, whose fused
  attention is fed THD ``PackedSeqParams`` (every document, or every window of
  a routed depth, is one packed sequence: :func:`thd_params`). Blocks that a
  step modulates with FiLM get the unfused TE layout (:func:`te_block_spec`):
  ``TENorm`` modules followed by ``TEColumnParallelLinear``, so the FiLM of the
  step reaches the norm outputs exactly as on the local spec.

Which implementation (TE or local) is decided here, once, from the config and
the platform; where it sits is the spec's business, as in megatron-core. Both
specs save the same distributed-checkpoint keys (megatron-core's fused TE
names), so a checkpoint moves between them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lol.config.schema import ConfigError, ModelConfig, ParallelConfig
from megatron_lol.plan.windows import windows_of


class LocalRMSNorm(nn.Module):
    """RMSNorm whose weight megatron's sequence-parallel gradient reduction recognises.

    With ``config.gradient_accumulation_fusion`` (BF16 training under megatron-core's DDP) its weight
    gradient goes the way of the fused linears': each call adds it to the FP32 ``main_grad`` itself
    (:class:`_RMSNormMainGrad`), so a block used at many depths does not have its calls summed in BF16.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.fuse_wgrad_accumulation = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # megatron's grad all-reduce for sequence-parallel norms keys on this attribute
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.fuse_wgrad_accumulation
            and torch.is_grad_enabled()
            and self.weight.requires_grad
            and hasattr(self.weight, "main_grad")
        ):
            return _RMSNormMainGrad.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _RMSNormMainGrad(torch.autograd.Function):
    """``F.rms_norm(x, weight)`` whose weight gradient (computed in FP32) is added to ``weight.main_grad``.

    megatron-core's protocol of fused gradient accumulation (its linears' and Transformer Engine's):
    the weight's own gradient becomes a zero placeholder and ``weight.grad_added_to_main_grad`` is
    set, so megatron-core's DDP does not add it again.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        shape = (x.shape[-1],)
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(True)
                (grad_x,) = torch.autograd.grad(F.rms_norm(xd, shape, weight.detach(), ctx.eps), xd, grad)
        normed = F.rms_norm(x.float(), shape, None, ctx.eps)
        weight.main_grad.add_((grad.float() * normed).reshape(-1, shape[0]).sum(dim=0))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return grad_x, torch.zeros_like(weight), None


def transformer_engine_usable() -> bool:
    from megatron_lol.platform import has_transformer_engine

    return has_transformer_engine()


def use_te_for(model: ModelConfig) -> bool:
    """TE spec when TE imports and CUDA is present, unless the config says otherwise."""
    available = transformer_engine_usable()
    if model.precision.transformer_engine is None:
        return available
    if model.precision.transformer_engine and not available:
        raise ConfigError("model.precision.transformer_engine: true, but Transformer Engine with CUDA is not available")
    return model.precision.transformer_engine


def transformer_config(
    model: ModelConfig,
    parallel: Optional[ParallelConfig] = None,
    num_layers: Optional[int] = None,
    use_te: bool = False,
    gradient_accumulation_fusion: bool = False,
):
    """megatron-core ``TransformerConfig`` for the blocks and fixed layers of ``model``.

    ``use_te``: the layers are Transformer Engine modules (fused RoPE for THD
    packed sequences; FP8 recipes, see :mod:`.precision`). Parameters are made
    in ``params_dtype`` (BF16 on GPUs) with FP32 main gradients in
    megatron-core's DDP and optimizer, as Megatron-LM's ``--bf16`` does; the
    router and the window arithmetic stay FP32 whatever the dtype (see
    :class:`~megatron_lol.model.router.WindowRouter`).

    ``gradient_accumulation_fusion``: the model trains under megatron-core's DDP
    (the trainer's models): with BF16 parameters every call of a linear (and of
    a local norm) adds its weight gradient to the FP32 ``main_grad`` itself
    (Transformer Engine's ``fuse_wgrad_accumulation``, megatron-core's fused
    accumulation on the local spec: ``platform.no_te.TorchWgradAccumulation``
    without apex), instead of autograd summing a block's calls at all its depths
    in BF16 first. Layers built with it need ``main_grad`` to run backward.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lol.config.schema import fp8_recipe_default, resolve_params_dtype

    parallel = parallel or ParallelConfig()
    dtype = torch.bfloat16 if resolve_params_dtype(model.precision.params_dtype) == "bf16" else torch.float32
    kwargs = dict(
        num_layers=num_layers or max(1, model.n_prelude + model.n_coda + model.execution_plan().num_stored_blocks),
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
        expert_model_parallel_size=(
            parallel.expert_model_parallel_size if model.moe.num_experts and model.moe.layers != "none" else 1
        ),
        sequence_parallel=parallel.sequence_parallel,
        # the same seed gives the same weights whatever the layout: initialise the
        # full master weights on CPU and split them (megatron-core's own option)
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        # TE's fused RoPE takes THD cu_seqlens (megatron's unfused THD RoPE loops over sequences)
        apply_rope_fusion=use_te,
        gradient_accumulation_fusion=gradient_accumulation_fusion and dtype == torch.bfloat16,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        recompute_granularity=parallel.recompute_granularity,
        recompute_method="uniform" if parallel.recompute_granularity == "full" else None,
        recompute_num_layers=1 if parallel.recompute_granularity == "full" else None,
    )
    if model.moe.num_experts and model.moe.layers != "none":
        # megatron-core MoE MLPs (used by the layers the spec gives an MoE MLP: see moe_layers)
        # Switch load balance + optional z-loss, both per layer call; Foil averages them over
        # every MoE execution (each layer on each pass) instead of megatron's sum over layers
        scale = 1.0 / moe_executions(model) if model.moe.loss_average_over_executions else 1.0
        kwargs.update(
            num_moe_experts=model.moe.num_experts,
            moe_router_topk=model.moe.router_topk,
            moe_ffn_hidden_size=model.moe.ffn_hidden_size or model.ffn_hidden,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=model.moe.aux_loss_coeff * scale,
            moe_z_loss_coeff=(model.moe.z_loss_coeff * scale if model.moe.z_loss_coeff else None),
            moe_shared_expert_intermediate_size=model.moe.shared_expert_intermediate_size,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_router_score_function=model.moe.router_score_function,
            # loss-free balancing: megatron-core's finalize_model_grads (called by the trainer's,
            # parallel/library_sync.py) moves each router's bias by the global batch's loads
            moe_router_enable_expert_bias=model.moe.router_enable_expert_bias,
            moe_router_bias_update_rate=model.moe.router_bias_update_rate,
        )
    if model.precision.fp8 is not None:
        # Megatron-LM's --fp8-format / --fp8-recipe / --fp8-margin / --fp8-amax-* (TransformerConfig's own fields)
        recipe = model.precision.fp8_recipe or fp8_recipe_default(model.execution_plan())
        kwargs.update(
            fp8=model.precision.fp8,
            fp8_recipe=recipe,
            fp8_margin=model.precision.fp8_margin,
            fp8_amax_history_len=model.precision.fp8_amax_history_len,
            fp8_amax_compute_algo=model.precision.fp8_amax_compute_algo,
        )
        if model.moe.num_experts and model.moe.layers != "none":
            # experts receive any number of tokens: megatron pads the routing map to FP8's multiple
            kwargs.update(moe_router_padding_for_quantization=True)
    return TransformerConfig(**kwargs)


def moe_executions(model: ModelConfig) -> int:
    """MoE layer calls per forward pass (fixed layers once each, core blocks per execution)."""
    fixed = model.n_prelude + model.n_coda if model.moe.layers in ("fixed", "all") else 0
    return max(1, fixed + (model.core_depth if model.moe.layers == "all" else 0))


def core_config(config, model: ModelConfig, packed: bool = False):
    """The core's TransformerConfig: its MoE layers may hold another number of experts (Foil's E);
    a plan that runs a stored block more than once keeps every call's weight gradient under
    Transformer Engine (``disable_parameter_transpose_cache``); with packed (THD) sequences a
    sliding-window core says its window in ``window_size``, which TE's attention (and the local
    attention on packed input) applies."""
    experts = model.core_experts
    if experts is not None and experts != config.num_moe_experts:
        config = dataclasses.replace(config, num_moe_experts=experts)
    if model.execution_plan().reruns_blocks and not config.disable_parameter_transpose_cache:
        # megatron-core's TE layers pass is_first_microbatch to TE unless this is set, and TE's
        # backward then writes the first micro-batch's weight gradient into main_grad with
        # accumulate=False: a block's first call (the last to run backward) would overwrite the
        # gradients of its other depths (docs/gpu.md, "A block that runs at several depths")
        config = dataclasses.replace(config, disable_parameter_transpose_cache=True)
    if packed and any(step.attention == "sliding" for step in model.execution_plan().steps()):
        # a query sees itself and the window_size - 1 keys before it (SegmentMask.sliding)
        config = dataclasses.replace(config, window_size=(windows_of(model).size - 1, 0))
    return config


def thd_params(
    segments: torch.Tensor, max_seqlen: int, pad_to: int = 1, cu_seqlens: Optional[torch.Tensor] = None
) -> tuple:
    """``(PackedSeqParams, padded length)``: THD packing of a stream of contiguous segments ``[T]``.

    Windows (or documents) are the packed sequences: ``cu_seqlens`` are the
    offsets where the segment id changes. TE's fused attention applies the
    causal mask inside each sequence and RoPE restarts per sequence (relative
    positions inside a window or document are all RoPE sees, so this equals
    the local spec's row positions). ``max_seqlen`` is an upper bound of the
    sequence lengths (a window size, a row length): no device-to-host read for
    it. ``pad_to``: FP8 GEMMs need a row count that is a multiple of 16; the
    stream is then padded by ``(-T) % pad_to`` rows forming one more sequence of
    their own, whose outputs the caller drops (:func:`pad_rows`). ``cu_seqlens``:
    the segments' offsets ``[..., T]`` when the caller built them on the host
    (zero-length sequences allowed); otherwise found here, a device-to-host read.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    seg = segments.reshape(-1)
    n = seg.numel()
    padded = n + (-n) % pad_to
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
        if padded > n:
            cu = torch.cat([cu, cu.new_full((1,), padded)])
    else:
        starts = torch.ones_like(seg, dtype=torch.bool)
        starts[1:] = seg[1:] != seg[:-1]
        first = torch.nonzero(starts).squeeze(1)
        ends = [n, padded] if padded > n else [n]
        cu = torch.cat([first, first.new_tensor(ends)]).to(torch.int32)
    longest = max(max_seqlen, padded - n)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return params, padded


def segment_offsets(segments: torch.Tensor, bound: int) -> torch.Tensor:
    """THD offsets ``[bound + 1]`` (int32) of a stream of contiguous segment runs ``[n]``, found on the
    device without a host read: the shape is the caller's bound of the number of runs (at most ``n``),
    and the offsets past the last run are ``n`` (zero-length sequences, as a host layout's padding).

    Each row's run number is a running count of the places where the id changes; a run starts at
    the smallest row of its number (``scatter_reduce`` with ``amin``: one value per slot, whatever
    the order of the writes). The per-block executor gives each block call its windows' offsets so
    (:class:`~.executors.PerBlockCalls`), instead of :func:`thd_params` finding them with a read.
    """
    seg = segments.reshape(-1)
    n = seg.numel()
    changes = torch.ones_like(seg, dtype=torch.long)
    changes[1:] = (seg[1:] != seg[:-1]).long()
    run = torch.cumsum(changes, 0) - 1
    cu = torch.full((bound + 1,), n, dtype=torch.long, device=seg.device)
    cu = cu.scatter_reduce(0, run, torch.arange(n, device=seg.device), "amin")
    return cu.to(torch.int32)


def pad_rows(x: torch.Tensor, padded: int) -> torch.Tensor:
    """``x`` ``[T, ...]`` with zero rows appended up to ``padded`` rows (itself when nothing is added)."""
    extra = padded - x.shape[0]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_zeros((extra,) + tuple(x.shape[1:]))], dim=0)


def block_spec(use_te: bool = False, num_experts: Optional[int] = None, film: bool = False):
    """The ``ModuleSpec`` of one block / fixed layer (``num_experts``: megatron-core MoE MLP;
    ``film``: a step modulates the norm outputs, see :func:`te_block_spec`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lol.model.attention import SegmentCausalAttention
    from megatron_lol.model.block_call import LoLTransformerLayer

    if use_te:
        return te_block_spec(num_experts, film)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SegmentCausalAttention)
    attn = dataclasses.replace(attn, submodules=attn_sub)
    sub = dataclasses.replace(sub, self_attention=attn, input_layernorm=LocalRMSNorm, pre_mlp_layernorm=LocalRMSNorm)
    return dataclasses.replace(spec, module=LoLTransformerLayer, submodules=sub)


def te_block_spec(num_experts: Optional[int] = None, film: bool = False):
    """megatron-core's Transformer Engine layer spec, with FiLM's norms where a step needs them.

    Without FiLM: megatron-core's spec as it is (the attention and dense-MLP
    norms fused into ``TELayerNormColumnParallelLinear``; MoE layers already
    have a separate ``TENorm`` before the router). With FiLM the two norms are
    separate ``TENorm`` modules and the first linears ``TEColumnParallelLinear``
    (the layout of the local spec, in TE modules), so ``gamma * Norm(x) +
    beta`` is applied between them and the FiLM parameters get their gradients
    as under the local spec. Separate norms save under the fused names
    (megatron-core's own map for its local spec), so the local spec and both TE
    layouts load each other's checkpoints.
    """
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_lol.model.block_call import LoLTransformerLayer

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=False)
    sub = spec.submodules
    # the local spec's checkpoint names for the separate norms (megatron-core's map for its local spec)
    keys = dict(sub.sharded_state_dict_keys_map or {})
    if num_experts:  # MoE: the norm before the router is a separate TENorm in both layouts
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    if film:
        attn = dataclasses.replace(
            sub.self_attention,
            submodules=dataclasses.replace(sub.self_attention.submodules, linear_qkv=TEColumnParallelLinear),
        )
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
        mlp = sub.mlp
        if not num_experts:  # a dense MLP's norm leaves its first linear
            mlp = dataclasses.replace(
                mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=TEColumnParallelLinear)
            )
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        sub = dataclasses.replace(sub, input_layernorm=TENorm, self_attention=attn, pre_mlp_layernorm=TENorm, mlp=mlp)
    sub = dataclasses.replace(sub, sharded_state_dict_keys_map=keys)
    return dataclasses.replace(spec, module=LoLTransformerLayer, submodules=sub)


def build_layer(spec, config, layer_number: int, vp_stage: Optional[int] = None):
    """Build one layer / block; ``layer_number`` is its global 1-based number.

    megatron-core adds a pipeline-stage offset to ``layer_number`` assuming its
    own even split of ``num_layers``; our plan places layers itself, so the
    global number is set back afterwards.
    """
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(
        spec,
        config=config,
        layer_number=layer_number,
        vp_stage=vp_stage if config.virtual_pipeline_model_parallel_size else None,
    )
    layer.layer_number = layer_number
    if hasattr(layer.mlp, "set_layer_number"):  # an MoE layer's router logs its losses by layer number
        layer.mlp.set_layer_number(layer_number)
    attention = getattr(layer, "self_attention", None)
    if attention is not None and not isinstance(getattr(attention, "core_attention", None), _te_attention_types()):
        # selective recompute is done inside SegmentCausalAttention (see there)
        attention.checkpoint_core_attention = False
    return layer


def _te_attention_types() -> tuple:
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

    except Exception:  # TE absent
        return ()
    return (TEDotProductAttention,) if isinstance(TEDotProductAttention, type) else ()


def build_attention_set(spec, config, layer_number: int, vp_stage: Optional[int] = None) -> nn.Module:
    """An attention sub-layer (input norm + self-attention) shaped like ``spec``'s.

    Foil's untied passes: a looped block keeps its MLP (experts, router) for
    every pass but gets one of these per extra pass. Built through megatron's
    own layer (MLP and its norm replaced by identities) so the attention is
    exactly the block's kind (local or TE, GQA, TP-sharded).
    """
    from megatron.core.transformer.identity_op import IdentityOp

    sub = dataclasses.replace(spec.submodules, mlp=IdentityOp, pre_mlp_layernorm=IdentityOp)
    layer = build_layer(dataclasses.replace(spec, submodules=sub), config, layer_number, vp_stage)
    holder = nn.Module()
    holder.input_layernorm = layer.input_layernorm
    holder.self_attention = layer.self_attention
    return holder
