"""All blocks of a routed depth as one computation: a grouped GEMM per projection, one attention call.

The per-block executor runs a routed depth as one layer call per block on that
block's windows (:class:`~.executors.PerBlockCalls` over :func:`~.block_call.call_block`):
``L`` calls, each a dozen kernels and, under tensor parallelism, two
collectives. Here (:class:`~.executors.GroupedGEMMs`) the depth's tokens, grouped by block
(:class:`~.static_routing.TokenGrouping`), go through the blocks together:

* QKV, output projection, fc1 and fc2 are each one ``torch._grouped_mm`` over
  the blocks' weights stacked ``[L, out, in]``, with the group offsets as a
  device tensor (no host read);
* the norms' gains and a per-block FiLM are gathered per row by block id, with
  an ordered segment-sum backward (:func:`~.static_routing.gather_segment_rows`);
  a per-depth FiLM broadcasts;
* attention has no weights: the windows of every block are one segment-causal
  call over the grouped stream, whose segments are the windows: FlexAttention
  with the stream's block mask off the CPU, the chunked algorithm of
  :mod:`.attention` on it (:func:`~.attention.window_mask` decides);
* under tensor parallelism the weights are this rank's ColumnParallelLinear /
  RowParallelLinear shards and each projection makes one collective per depth
  (megatron-core's ``tensor_parallel.mappings``), not one per block.

The weights are stacked per micro-batch from the blocks' own parameters
(:func:`stack_library`; gradients flow back to them through ``torch.stack``,
or, under fused gradient accumulation, depth by depth into their FP32
``main_grad``: :func:`for_depth`), so checkpoints, the HF export,
expert-parallel sharding of the library and Muon's per-block
orthogonalisation are unchanged; the stacking costs one copy of the library
per micro-batch (measured by ``bench/launches.py --what stacking``).

``torch._grouped_mm`` (torch 2.13) as used here: group offsets are the int32
group ends, on the device; the CPU kernel runs fp32 and bf16 (one ``mm`` per
group) when every row stride is a multiple of 16 bytes (fp32: dimensions that
are multiples of 4, bf16: of 8; :func:`grouped_support` checks); its backward
needs a dense output gradient (:func:`_grouped_linear` makes one); torch's
meta function takes bf16 only, so ``torch.compile`` traces the grouped
projections in bf16 (the GPU dtype), not in fp32.

Blocks this does not cover (MoE MLPs, Transformer Engine modules, biases,
dropout, FP8, recomputation, context parallelism, hooks on the modules) are
named by :func:`grouped_support`, and the core runs them with the per-block executor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_lol.convert.hf_modeling.parts_lol import apply_norm, apply_write
from megatron_lol.model.attention import chunked_attention
from megatron_lol.model.static_routing import TokenGrouping, gather_segment_rows

#: torch._grouped_mm needs every row stride of its operands to be a multiple of 16 bytes
GROUPED_MM_ALIGNMENT_BYTES = 16


@dataclass
class StackedLibrary:
    """This rank's weights of the ``L`` blocks, stacked along a leading block axis."""

    norm1: torch.Tensor  # [L, h]
    qkv: torch.Tensor  # [L, (nq + 2 nkv) c / tp, h]
    proj: torch.Tensor  # [L, h, nq c / tp]
    norm2: torch.Tensor  # [L, h]
    fc1: torch.Tensor  # [L, 2 f / tp, h]
    fc2: torch.Tensor  # [L, h, f / tp]
    eps: float
    heads: int  # query heads of this rank
    groups: int  # key/value groups of this rank
    head_dim: int
    softmax_scale: float
    tp_group: Optional[object]  # the tensor-parallel group (None: no collectives)
    #: the blocks' parameters behind each stacked field, when their gradients go to FP32 ``main_grad``
    #: depth by depth (:func:`for_depth`); None: the stacks carry autograd to the parameters themselves
    sources: Optional[dict] = None


def _hooked(modules) -> bool:
    from torch.nn.modules import module as nn_module

    if (
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    ):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules)


def grouped_support(blocks) -> Optional[str]:
    """Why these blocks cannot run grouped (one line), or None when they can."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    from megatron_lol.model.attention import SegmentCausalAttention
    from megatron_lol.model.library import LocalRMSNorm

    if not blocks:
        return "no blocks"
    first = blocks[0]
    c = first.config
    for block in blocks:
        if type(block.mlp) is not MLP:
            return f"block MLP is {type(block.mlp).__name__} (MoE blocks run per block)"
        if not (isinstance(block.input_layernorm, LocalRMSNorm) and isinstance(block.pre_mlp_layernorm, LocalRMSNorm)):
            return "norms are not the local spec's LocalRMSNorm (Transformer Engine layers run per block)"
        sa = block.self_attention
        if not isinstance(getattr(sa, "core_attention", None), SegmentCausalAttention):
            return "core attention is not SegmentCausalAttention"
        if not all(
            isinstance(getattr(sa, name, None), (type(None), IdentityOp)) for name in ("q_layernorm", "k_layernorm")
        ):
            return "QK layernorm"
        if _hooked(
            [
                block,
                block.input_layernorm,
                block.pre_mlp_layernorm,
                sa,
                sa.linear_qkv,
                sa.linear_proj,
                sa.core_attention,
                block.mlp,
                block.mlp.linear_fc1,
                block.mlp.linear_fc2,
            ]
        ):
            return "hooks on the block's modules"
    checks = [
        (c.add_bias_linear or getattr(c, "add_qkv_bias", False), "linear biases"),
        (c.hidden_dropout != 0.0 or c.attention_dropout != 0.0, "dropout"),
        (c.fp8 is not None or getattr(c, "fp4", None) is not None, "FP8/FP4"),
        (c.recompute_granularity is not None, f"recompute_granularity={c.recompute_granularity}"),
        (c.sequence_parallel, "sequence parallelism inside the core"),
        (getattr(c, "context_parallel_size", 1) != 1, "context parallelism"),
        (not (c.gated_linear_unit and c.activation_func is F.silu), "MLP is not SwiGLU"),
        (
            getattr(c, "glu_linear_offset", 0.0) != 0.0 or getattr(c, "activation_func_clamp_value", None) is not None,
            "SwiGLU offset/clamp",
        ),
        (c.rotary_interleaved or c.apply_rope_fusion, "interleaved or fused RoPE"),
        (
            getattr(c, "multi_latent_attention", False) or getattr(c, "attention_output_gate", False),
            "multi-latent attention / output gate",
        ),
        (hasattr(c, "yarn_rotary_scaling_factor"), "YaRN RoPE"),
    ]
    for failed, reason in checks:
        if failed:
            return reason
    lib_dtype = first.self_attention.linear_qkv.weight.dtype
    unit = GROUPED_MM_ALIGNMENT_BYTES // lib_dtype.itemsize
    sa, mlp = first.self_attention, first.mlp
    dims = {
        "hidden": c.hidden_size,
        "qkv": sa.linear_qkv.weight.shape[0],
        "proj": sa.linear_proj.weight.shape[1],
        "fc1": mlp.linear_fc1.weight.shape[0],
        "fc2": mlp.linear_fc2.weight.shape[1],
    }
    bad = {k: v for k, v in dims.items() if v % unit}
    if bad:
        return f"torch._grouped_mm needs dimensions that are multiples of {unit} for {lib_dtype}: {bad}"
    return None


#: the stacked fields and where each block keeps the weight behind them
_LIBRARY_WEIGHTS = {
    "norm1": lambda b: b.input_layernorm.weight,
    "qkv": lambda b: b.self_attention.linear_qkv.weight,
    "proj": lambda b: b.self_attention.linear_proj.weight,
    "norm2": lambda b: b.pre_mlp_layernorm.weight,
    "fc1": lambda b: b.mlp.linear_fc1.weight,
    "fc2": lambda b: b.mlp.linear_fc2.weight,
}


def _fuses_wgrad_accumulation(blocks) -> bool:
    """Whether the blocks' weight gradients go to FP32 ``main_grad`` call by call (megatron-core's
    ``gradient_accumulation_fusion`` with BF16 weights under its DDP, as the trainer builds them)."""
    return bool(getattr(blocks[0].config, "gradient_accumulation_fusion", False)) and all(
        hasattr(get(b), "main_grad") for b in blocks for get in _LIBRARY_WEIGHTS.values()
    )


def stack_library(blocks) -> StackedLibrary:
    """Stack the blocks' weights, one copy per micro-batch.

    Without fused gradient accumulation the stacks are ``torch.stack`` (differentiable: autograd sums
    a block's depths into the stack's gradient, then hands it to the parameters). With it the stacks
    are made outside autograd and each depth takes them through :func:`for_depth`, whose backward adds
    that depth's gradient to the blocks' FP32 ``main_grad``, as the per-block executor's fused
    accumulation does for every call: a block used at many depths is not summed in BF16.
    """
    first = blocks[0]
    sa = first.self_attention
    tp = sa.linear_qkv.tp_group if getattr(sa.linear_qkv, "tp_group", None) is not None else None
    if tp is not None and torch.distributed.get_world_size(tp) == 1:
        tp = None
    sources = None
    if _fuses_wgrad_accumulation(blocks):
        sources = {name: [get(b) for b in blocks] for name, get in _LIBRARY_WEIGHTS.items()}
        with torch.no_grad():
            stacks = {name: torch.stack(weights) for name, weights in sources.items()}
    else:
        stacks = {name: torch.stack([get(b) for b in blocks]) for name, get in _LIBRARY_WEIGHTS.items()}
    return StackedLibrary(
        **stacks,
        sources=sources,
        eps=first.input_layernorm.eps,
        heads=sa.num_attention_heads_per_partition,
        groups=sa.num_query_groups_per_partition,
        head_dim=sa.hidden_size_per_attention_head,
        softmax_scale=sa.core_attention.softmax_scale,
        tp_group=tp,
    )


class _DepthLibrary(torch.autograd.Function):
    """A stacked weight ``[L, ...]`` as one depth's input (no copy); the backward adds this depth's
    gradient of each block's slice to that block's FP32 ``main_grad`` and hands autograd
    megatron-core's placeholder (``grad_added_to_main_grad``: its DDP skips it)."""

    @staticmethod
    def forward(ctx, stacked, *weights):
        ctx.weights = weights
        return stacked.view_as(stacked)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        placeholders = []
        for weight, part in zip(ctx.weights, grad):
            weight.main_grad.add_(part.float())
            weight.grad_added_to_main_grad = True
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            placeholders.append(make(weight.shape, dtype=weight.dtype, device=weight.device))
        return (None, *placeholders)


def for_depth(lib: StackedLibrary) -> StackedLibrary:
    """The library as one depth uses it: itself, or (fused gradient accumulation, see
    :func:`stack_library`) its stacks with a backward into the blocks' FP32 ``main_grad``."""
    if lib.sources is None or not torch.is_grad_enabled():
        return lib
    return replace(
        lib, **{name: _DepthLibrary.apply(getattr(lib, name), *weights) for name, weights in lib.sources.items()}
    )


@dataclass
class RowRope:
    """``cos`` / ``sin`` of every grouped row's RoPE angles ``[T, 1, c]`` (the states' dtype)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def from_table(cls, table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> "RowRope":
        """``table``: megatron's RoPE angles ``[s, 1, 1, c]``; ``positions`` ``[T]``: each row's position
        (row positions, or positions inside the window as THD attention restarts them)."""
        angles = table.reshape(table.shape[0], -1)
        # cos of the table, then a gather: the same values as megatron's cos of gathered angles
        return cls(
            cos=torch.cos(angles).to(dtype).index_select(0, positions).unsqueeze(1),
            sin=torch.sin(angles).to(dtype).index_select(0, positions).unsqueeze(1),
        )


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def part_rows(per_block: list, grouping: TokenGrouping, config) -> tuple:
    """The step's per-pass parts for the grouped rows: ``per_block`` holds, for each block of the stacked
    library in order, its ``((part, tensors), ...)``; the tensors of a part that gives every block the
    same (``Part.per_block``: FiLM per depth) stay as they are, the others are gathered per row by block
    (``[T, ...]``: parts index their tensors from the end, parts_lol.Part.apply)."""
    out = []
    for i, (part, first) in enumerate(per_block[0]):
        if not part.per_block(config):
            out.append((part, first))
            continue
        tensors = []
        for j, t in enumerate(first):
            table = torch.stack([hooks[i][1][j] for hooks in per_block]).reshape(len(per_block), -1)
            rows = gather_segment_rows(table, grouping.block_of_row, grouping.group_offsets)
            tensors.append(rows.view((rows.shape[0],) + tuple(t.shape)))
        out.append((part, tuple(tensors)))
    return tuple(out)


def _norm(x: torch.Tensor, gains: torch.Tensor, eps: float, grouping: TokenGrouping) -> torch.Tensor:
    rows = gather_segment_rows(gains, grouping.block_of_row, grouping.group_offsets)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * rows


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: ``_grouped_mm``'s backward refuses the
    zero-stride gradient of a broadcast (``loss = out.sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of ``x`` times ``weights[m]^T`` for its group ``m`` (``weights`` ``[L, out, in]``): one
    ``torch._grouped_mm`` with device offsets (the group ends)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets))


def _column_input(y: torch.Tensor, lib: StackedLibrary) -> torch.Tensor:
    """The input of a column-parallel projection: identity forward, all-reduce of its gradient."""
    if lib.tp_group is None:
        return y
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(y, group=lib.tp_group)


def _row_output(y: torch.Tensor, lib: StackedLibrary) -> torch.Tensor:
    """The output of a row-parallel projection: one all-reduce over the ranks' partial sums."""
    if lib.tp_group is None:
        return y
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(y, group=lib.tp_group)


def grouped_blocks(
    lib: StackedLibrary,
    x: torch.Tensor,
    grouping: TokenGrouping,
    rope: Optional[RowRope],
    attention_bias,
    chunk: int,
    hooks: tuple = (),
) -> torch.Tensor:
    """``E_m(x)`` of every grouped row ``x`` ``[T, h]`` (row ``r`` through block ``block_of_row[r]``).

    The operations of megatron-core's local layer (``block_call.reference_layer``)
    in its order, on all blocks' rows at once. ``attention_bias``: the grouped stream's window
    mask (``window_mask(grouping.segments, chunk)``: the chunked algorithm's additive mask on the CPU,
    a FlexAttention block mask on GPUs).
    ``hooks``: the step's per-pass parts per row (:func:`part_rows`), applied where the layer call
    applies them (block_call.py).
    """
    norms = tuple(item for item in hooks if item[0].hook == "norm")
    writes = tuple(item for item in hooks if item[0].hook == "write")
    t = x.shape[0]
    offs = grouping.group_ends
    y = apply_norm(_norm(x, lib.norm1, lib.eps, grouping), 0, norms)
    mixed = _grouped_linear(_column_input(y, lib), lib.qkv, offs)
    per_group = lib.heads // lib.groups
    c = lib.head_dim
    mixed = mixed.view(t, lib.groups, (per_group + 2) * c)
    query, key, value = torch.split(mixed, [per_group * c, c, c], dim=2)
    query = query.reshape(t, lib.heads, c)
    if rope is not None:
        query = query * rope.cos + _rotate_half(query) * rope.sin
        key = key * rope.cos + _rotate_half(key) * rope.sin
    if per_group > 1:  # grouped-query attention: share each key/value head
        key = key.repeat_interleave(per_group, dim=1)
        value = value.repeat_interleave(per_group, dim=1)
    # FlexAttention when the mask is a block mask (off the CPU), else the chunked algorithm
    context = chunked_attention(query, key, value, attention_bias, chunk, lib.softmax_scale)
    attn = _grouped_linear(context.reshape(t, lib.heads * c), lib.proj, offs)
    h1 = apply_write(x, x + _row_output(attn, lib), 0, writes)
    y = apply_norm(_norm(h1, lib.norm2, lib.eps, grouping), 1, norms)
    fc1 = _grouped_linear(_column_input(y, lib), lib.fc1, offs)
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    fc2 = _grouped_linear(F.silu(gate) * linear, lib.fc2, offs)
    return apply_write(h1, h1 + _row_output(fc2, lib), 1, writes)
