"""A short call path for the two halves of megatron-core's local transformer layer on CPU.

A LoL depth calls each of its ``L`` blocks on that block's windows where a
fixed-path model calls one layer on every token, so a step makes ``L`` times as
many layer calls. megatron-core's local ``SelfAttention`` / ``MLP`` are general
(tensor-parallel mappings as autograd Functions, RoPE computing ``cos``/``sin``
for ``q`` and ``k`` separately and concatenating an empty pass-through part,
the SwiGLU ``x + 0`` offset, dropout with ``p = 0``), and on CPU that
generality costs time per call and per token (docs/performance.md).

:func:`attention_half` and :func:`mlp_half` compute ``x + Attn(Norm(x))`` and
``h + MLP(Norm(h))`` with the same operations on the same operands in the same
order as megatron-core's modules (``x @ W^T`` linears, ``residual + out``,
``silu(a) * b``, RoPE ``t cos + rot(t) sin``), so values and gradients are bit
for bit the reference's (``megatron_lol.model.block_call``), when nothing
needs that generality: one tensor-parallel rank, no sequence / context
parallelism, no biases, dropout, QK norms, FP8, recomputation or offloading,
no fused weight-gradient accumulation (BF16 training: weight gradients go to ``main_grad``),
SwiGLU, non-interleaved RoPE over the whole head, a segment-mask core
attention, and no hooks on the modules skipped (the hooks then fire on the
reference path). Otherwise they return None and the caller runs the reference.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module

_ATTENTION_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MLP_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hooked(*modules) -> bool:
    if (
        _nn_module._global_forward_hooks
        or _nn_module._global_forward_pre_hooks
        or _nn_module._global_backward_hooks
        or _nn_module._global_backward_pre_hooks
    ):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules)


def _common_ok(config) -> bool:
    return (
        config.tensor_model_parallel_size == 1
        and not config.sequence_parallel
        and not config.add_bias_linear
        and config.hidden_dropout == 0.0
        and config.fp8 is None
        and getattr(config, "fp4", None) is None
        and not getattr(config, "gradient_accumulation_fusion", False)
    )


def _attention_eligible(att) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    sa = getattr(att, "self_attention", None)
    if sa is None:
        return False
    c = sa.config
    return (
        _common_ok(c)
        and getattr(c, "context_parallel_size", 1) == 1
        and not getattr(c, "add_qkv_bias", False)
        and not c.rotary_interleaved
        and not c.apply_rope_fusion
        and not getattr(c, "multi_latent_attention", False)
        and not getattr(c, "attention_output_gate", False)
        and not hasattr(c, "yarn_rotary_scaling_factor")  # YaRN's mscale != 1
        and not getattr(c, "test_mode", False)
        and not getattr(att, "recompute_input_layernorm", False)
        and not getattr(att, "offload_attn_norm", False)
        and not getattr(sa, "offload_qkv_linear", False)
        and not getattr(sa, "offload_core_attention", False)
        and not getattr(sa, "offload_attn_proj", False)
        and not getattr(sa, "checkpoint_core_attention", False)
        and getattr(getattr(sa, "core_attention", None), "accepts_segment_mask", False)
        and isinstance(getattr(sa, "q_layernorm", None), (type(None), IdentityOp))
        and isinstance(getattr(sa, "k_layernorm", None), (type(None), IdentityOp))
    )


def _mlp_eligible(layer) -> bool:
    from megatron.core.transformer.mlp import MLP

    mlp = getattr(layer, "mlp", None)
    if type(mlp) is not MLP:
        return False
    c = mlp.config
    return (
        _common_ok(c)
        and c.gated_linear_unit
        and c.activation_func is F.silu
        and getattr(c, "glu_linear_offset", 0.0) == 0.0
        and getattr(c, "activation_func_clamp_value", None) is None
        and not getattr(layer, "recompute_mlp", False)
        and not getattr(layer, "recompute_pre_mlp_layernorm", False)
        and not getattr(layer, "offload_mlp_norm", False)
        and getattr(c, "mlp_chunks_for_prefill", 1) <= 1
    )


def _cached(table, module, check) -> bool:
    ok = table.get(module)
    if ok is None:
        ok = table[module] = check(module)
    return ok


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_half(
    att, x: torch.Tensor, mask, rope: Optional[torch.Tensor], modulate: Optional[Callable]
) -> Optional[torch.Tensor]:
    """``x + Attn(modulate(Norm(x)))`` for ``att`` (a layer, or an attention set with
    ``input_layernorm`` and ``self_attention``); None where the short path does not apply."""
    if not _cached(_ATTENTION_OK, att, _attention_eligible):
        return None
    sa = att.self_attention
    head_dim = sa.hidden_size_per_attention_head
    if (
        isinstance(rope, tuple)
        or (rope is not None and rope.shape[-1] != head_dim)
        or _hooked(sa, sa.linear_qkv, sa.linear_proj)
    ):
        return None
    s, b = x.shape[0], x.shape[1]
    y = att.input_layernorm(x)
    if modulate is not None:
        y = modulate(y)
    mixed = torch.matmul(y, sa.linear_qkv.weight.t())
    groups = sa.num_query_groups_per_partition
    per_group = sa.num_attention_heads_per_partition // groups
    mixed = mixed.view(s, b, groups, (per_group + 2) * head_dim)
    query, key, value = torch.split(mixed, [per_group * head_dim, head_dim, head_dim], dim=3)
    query = query.reshape(s, b, -1, head_dim)
    if rope is not None:
        # megatron computes cos/sin (times mscale = 1) once for q and once for k: the same values
        cos = torch.cos(rope).to(query.dtype)
        sin = torch.sin(rope).to(query.dtype)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
    context = sa.core_attention(query, key, value, mask)
    return x + torch.matmul(context, sa.linear_proj.weight.t())


def mlp_half(layer, h: torch.Tensor, modulate: Optional[Callable]) -> Optional[torch.Tensor]:
    """``h + MLP(modulate(Norm(h)))`` for a dense SwiGLU MLP; None where the short path does not apply."""
    if not _cached(_MLP_OK, layer, _mlp_eligible):
        return None
    mlp = layer.mlp
    if _hooked(mlp, mlp.linear_fc1, mlp.linear_fc2):
        return None
    y = layer.pre_mlp_layernorm(h)
    if modulate is not None:
        y = modulate(y)
    fc1 = torch.matmul(y, mlp.linear_fc1.weight.t())
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    return h + torch.matmul(F.silu(gate) * linear, mlp.linear_fc2.weight.t())
