"""The local-spec transformer layer with a short call path for LoL's many small calls.

A LoL depth calls each of its L blocks once, on that block's windows, where a
fixed-path model calls one layer on every token; a step makes ``L`` times as
many block calls. megatron-core's ``TransformerLayer`` is general (inference
contexts, offloading, CUDA graphs, fusions, tensor-parallel mappings as
autograd Functions, bias-dropout-add closures, RoPE recomputing ``cos``/``sin``
for ``q`` and ``k`` and concatenating an empty pass-through part), and on CPU
that generality costs time per call and per token (measured below).

:class:`LeanTransformerLayer` is that layer (same constructor, submodules,
parameters, checkpoints and sharded state dict) whose two halves take a short
path when the configuration has none of the generality in play: one tensor-
parallel rank, no sequence/context parallelism, no MoE MLP (the attention
half still qualifies), no biases, no dropout, no QK norms or output gate, no
recomputation or offloading inside the layer, SwiGLU MLP, non-interleaved
RoPE over the whole head, and no hooks on the modules it skips (the attention
and MLP modules and their linears, whose weights it reads). It then runs the
same operations on the same operands in the same order as megatron-core's path (``x @ W^T`` linears,
``residual + out``, SwiGLU ``silu(a) * b``, RoPE ``t cos + rot(t) sin``), so
outputs and gradients are bit for bit those of ``TransformerLayer`` (tested:
tests/test_lean_layer.py, fp32 and bf16, dense and chunked masks, GQA, FiLM,
Accordion's gated halves). Anything else takes megatron-core's path.

Measured (``python bench/layer_call.py``: width 256, 2,048 packed tokens in
windows of 64, forward + backward, CPU, 1 thread): 151 against 165 ms through
``TransformerLayer`` in one call, 153 against 166 ms in four calls of 512
tokens (one per block, as in a LoL depth), 185 against 213 ms in sixteen calls
of 128. Part of the saving is per call, part per token: megatron's local path
also makes extra passes over the activations (``cos``/``sin`` twice, the RoPE
``cat`` with an empty part, the SwiGLU ``x_linear + 0`` offset, dropout with
``p = 0``). On GPUs with Transformer Engine the TE spec is used and this class
is not.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from torch.nn.modules import module as _nn_module
from megatron.core.transformer.transformer_layer import TransformerLayer

# call arguments the short path understands; any other one given a value takes megatron's path
_HANDLED = {"hidden_states", "attention_mask", "rotary_pos_emb"}


def _hooked(*modules) -> bool:
    """Whether a module the short path skips (it reads their weights instead) has hooks.

    Then megatron's path runs, so that every hook fires as it always did
    (the norms and the core attention are called as modules on both paths).
    """
    if (_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
            or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LeanTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` with a short call path (see the module docstring)."""

    #: set False to force megatron-core's path everywhere (tests, ``bench/layer_call.py``)
    enabled: bool = True

    # ------------------------------------------------------------- eligibility
    def _lean_common_ok(self) -> bool:
        """What both halves need: one TP rank, no SP, no biases, no dropout, no FP8/FP4."""
        c = self.config
        return (c.tensor_model_parallel_size == 1 and not c.sequence_parallel
                and not c.add_bias_linear and self.hidden_dropout == 0.0
                and c.fp8 is None and getattr(c, "fp4", None) is None)

    def _lean_attention_ok(self) -> bool:
        ok = getattr(self, "_lean_attention", None)
        if ok is None:
            from megatron_lol.model.attention import SegmentCausalAttention

            c = self.config
            sa = getattr(self, "self_attention", None)
            ok = (
                sa is not None and self._lean_common_ok()
                and getattr(c, "context_parallel_size", 1) == 1
                and not getattr(c, "add_qkv_bias", False)
                and not c.rotary_interleaved and not c.apply_rope_fusion
                and not getattr(c, "multi_latent_attention", False)
                and not getattr(c, "attention_output_gate", False)
                and not hasattr(c, "yarn_rotary_scaling_factor")  # YaRN's mscale != 1
                and not getattr(c, "test_mode", False)  # megatron's in-attention self-checks
                and not getattr(self, "recompute_input_layernorm", False)
                and not getattr(self, "offload_attn_norm", False)
                and not getattr(sa, "offload_qkv_linear", False)
                and not getattr(sa, "offload_core_attention", False)
                and not getattr(sa, "offload_attn_proj", False)
                and not getattr(sa, "checkpoint_core_attention", False)
                and isinstance(getattr(sa, "core_attention", None), SegmentCausalAttention)
                and isinstance(getattr(sa, "q_layernorm", None), (type(None), IdentityOp))
                and isinstance(getattr(sa, "k_layernorm", None), (type(None), IdentityOp))
                and isinstance(getattr(self, "cross_attention", None), IdentityOp)
            )
            self._lean_attention = ok
        return ok and LeanTransformerLayer.enabled

    def _lean_mlp_ok(self) -> bool:
        ok = getattr(self, "_lean_mlp", None)
        if ok is None:
            from megatron.core.transformer.mlp import MLP

            c = self.config
            ok = (
                type(getattr(self, "mlp", None)) is MLP and self._lean_common_ok()
                and c.gated_linear_unit and c.activation_func is F.silu
                and getattr(c, "glu_linear_offset", 0.0) == 0.0
                and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(self, "recompute_mlp", False)
                and not getattr(self, "recompute_pre_mlp_layernorm", False)
                and not getattr(self, "offload_mlp_norm", False)
                and getattr(c, "mlp_chunks_for_prefill", 1) <= 1
            )
            self._lean_mlp = ok
        return ok and LeanTransformerLayer.enabled

    # ------------------------------------------------------------------ halves
    def _forward_attention(self, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask")
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        if (not self._lean_attention_ok() or len(args) > 1 or (args and "hidden_states" in kwargs)
                or any(v is not None for k, v in kwargs.items() if k not in _HANDLED)
                or isinstance(rotary_pos_emb, tuple)
                or (rotary_pos_emb is not None
                    and rotary_pos_emb.shape[-1] != self.self_attention.hidden_size_per_attention_head)
                or _hooked(self.self_attention, self.self_attention.linear_qkv, self.self_attention.linear_proj)):
            return super()._forward_attention(*args, **kwargs)
        sa = self.self_attention
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        x = self.input_layernorm(hidden_states)
        mixed = torch.matmul(x, sa.linear_qkv.weight.t())
        groups = sa.num_query_groups_per_partition
        head_dim = sa.hidden_size_per_attention_head
        per_group = sa.num_attention_heads_per_partition // groups
        mixed = mixed.view(s, b, groups, (per_group + 2) * head_dim)
        query, key, value = torch.split(mixed, [per_group * head_dim, head_dim, head_dim], dim=3)
        query = query.reshape(s, b, -1, head_dim)
        if rotary_pos_emb is not None:
            # megatron computes cos/sin (times mscale = 1) once for q and once for k: same values
            cos = torch.cos(rotary_pos_emb).to(query.dtype)
            sin = torch.sin(rotary_pos_emb).to(query.dtype)
            query = (query * cos) + (_rotate_half(query) * sin)
            key = (key * cos) + (_rotate_half(key) * sin)
        context = sa.core_attention(query, key, value, attention_mask)
        out = torch.matmul(context, sa.linear_proj.weight.t())
        return hidden_states + out, None  # megatron's bias-dropout-add: residual + dropout_0(out)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        if (not self._lean_mlp_ok() or inference_context is not None or padding_mask is not None
                or _hooked(self.mlp, self.mlp.linear_fc1, self.mlp.linear_fc2)):
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask)
        mlp = self.mlp
        x = self.pre_mlp_layernorm(hidden_states)
        fc1 = torch.matmul(x, mlp.linear_fc1.weight.t())
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        act = F.silu(gate) * linear
        return hidden_states + torch.matmul(act, mlp.linear_fc2.weight.t())


def lean_path_taken(layer) -> Optional[tuple[bool, bool]]:
    """``(attention, mlp)``: whether each half of ``layer`` takes the short path (None: not lean)."""
    if not isinstance(layer, LeanTransformerLayer):
        return None
    return layer._lean_attention_ok(), layer._lean_mlp_ok()
