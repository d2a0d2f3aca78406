"""One call of a transformer layer (a library block or a fixed layer), with everything explicit.

A block stored once may run at several steps of the core, each with its own
per-step parts, all passed as arguments (:class:`BlockParts`), never set on
the modules around the call:

* ``hooks``: ``((part, tensors), ...)``, the step's per-pass parts that act
  inside the call (:mod:`megatron_lol.convert.hf_modeling.parts_lol`): those of
  the ``norm`` hook on the outputs of the attention norm (row 0) and the MLP
  norm (row 1), e.g. FiLM ``gamma * Norm(x) + beta``; those of the ``write``
  hook on the two residual writes, e.g. Accordion's loop gates
  ``h1 = x + g_attn * (Attn_out - x)``, ``out = h1 + g_mlp * (MLP_out - h1)``;
* ``attention``: the pass's own input norm and self-attention (Foil's untied
  attention; the MLP and its experts stay the block's);
* ``moe_router``: the pass's own MoE router (Accordion's separate router);
* ``record_moe``: also return what the MoE router decided (U_t / B2 / MMR).

The layer is :class:`LoLTransformerLayer`, megatron-core's ``TransformerLayer``
(same constructor, submodules, parameters and checkpoints) whose forward takes
these parts: it calls the submodules (norms, ``self_attention``, ``mlp``) in
the order megatron-core's own forward does, with the same residual additions,
so with no parts the result is megatron-core's bit for bit. Being the layer's
``forward``, it runs through the module call, so forward hooks on a layer fire
as usual. A backend (``megatron_lol.backends``) may run a half of the call
faster; it declines where it does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from megatron_lol.convert.hf_modeling.parts_lol import apply_norm, apply_write
from megatron_lol.model.attention import TokenRopeParams, applies_token_rope


@dataclass
class BlockParts:
    """The per-step parts of one block call (see the module docstring)."""

    hooks: tuple = ()
    attention: Optional[nn.Module] = None
    moe_router: Optional[nn.Module] = None
    record_moe: bool = False

    @property
    def norm(self) -> tuple:
        return tuple(item for item in self.hooks if item[0].hook == "norm")

    @property
    def write(self) -> tuple:
        return tuple(item for item in self.hooks if item[0].hook == "write")


NO_PARTS = BlockParts()


@dataclass
class MoERoute:
    """What one MoE router decided in one call: logits ``[T, E]`` (fp32, before the softmax) and the
    experts each token was sent to (``routing_map`` ``[T, E]`` bool)."""

    logits: torch.Tensor
    routing_map: torch.Tensor


def _modulator(norm_parts: tuple, row: int):
    """The norm-hook parts of row ``row`` as one function of the norm's output (None: there are none)."""
    if not norm_parts:
        return None
    return lambda y: apply_norm(y, row, norm_parts)


def _attention_half(att, x, mask, rope, norm_parts, packed_seq_params, backend) -> torch.Tensor:
    modulate = _modulator(norm_parts, 0)
    if backend is not None and packed_seq_params is None:
        out = backend.attention_half(att, x, mask, rope, modulate)
        if out is not None:
            return out
    y = att.input_layernorm(x)
    if modulate is not None:
        y = modulate(y)
    attn, bias = att.self_attention(y, attention_mask=mask, rotary_pos_emb=rope, packed_seq_params=packed_seq_params)
    return x + (attn if bias is None else attn + bias)


def moe_forward(moe, x: torch.Tensor, router: nn.Module, record: bool) -> tuple:
    """megatron-core's ``MoELayer`` forward (shared experts, route, dispatch, experts, combine)
    with ``router`` choosing the experts; returns ``(output, MoERoute or None)``."""
    shared = moe.shared_experts_compute(x)
    probs, routing_map = router(x)
    route = None
    if record:
        with torch.no_grad():
            flat = x.reshape(-1, x.shape[-1]).float()
            logits = torch.nn.functional.linear(flat, router.weight.float())
        route = MoERoute(logits.detach(), routing_map.detach().reshape(logits.shape).bool())
    hidden, probs = moe.preprocess(x, probs, routing_map)
    dispatched, probs = moe.dispatch(hidden, probs)
    out, _ = moe.routed_experts_compute(dispatched, probs)
    return moe.postprocess(moe.combine(out), shared), route


def _mlp_half(layer, h, parts: BlockParts, backend) -> tuple:
    modulate = _modulator(parts.norm, 1)
    if backend is not None:
        out = backend.mlp_half(layer, h, modulate)
        if out is not None:
            return out, None
    y = layer.pre_mlp_layernorm(h)
    if modulate is not None:
        y = modulate(y)
    mlp = layer.mlp
    router = parts.moe_router if parts.moe_router is not None else getattr(mlp, "router", None)
    if router is not None and (parts.moe_router is not None or parts.record_moe):
        out, route = moe_forward(mlp, y, router, parts.record_moe)
        return h + out, route
    out, bias = mlp(y)
    return h + (out if bias is None else out + bias), None


def reference_layer(layer, x, mask, rope, parts: BlockParts = NO_PARTS, packed_seq_params=None, backend=None) -> tuple:
    """``(output, MoERoute or None)`` of one layer call on ``x`` ``[s, b, h]``."""
    att = parts.attention if parts.attention is not None else layer
    h = _attention_half(att, x, mask, rope, parts.norm, packed_seq_params, backend)
    writes = parts.write
    h = apply_write(x, h, 0, writes)
    out, route = _mlp_half(layer, h, parts, backend)
    return apply_write(h, out, 1, writes), route


class LoLTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` whose forward takes the step's parts explicitly."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
        parts: BlockParts = NO_PARTS,
        backend=None,
        **unused,
    ) -> tuple:
        """``(output, MoERoute or None)``; see :func:`reference_layer`."""
        return reference_layer(self, hidden_states, attention_mask, rotary_pos_emb, parts, packed_seq_params, backend)


def call_block(
    layer,
    hidden: torch.Tensor,
    mask,
    rope: Optional[torch.Tensor],
    parts: BlockParts = NO_PARTS,
    *,
    packed: bool = False,
    recompute: bool = False,
    backend=None,
    pad_to: int = 1,
) -> tuple:
    """Run one layer with segment-causal attention; returns ``(output, MoERoute or None)``.

    Unpacked (the local spec): ``hidden`` is ``[s, b, h]`` and ``mask`` (a
    :class:`~megatron_lol.model.attention.SegmentMask`) goes to the
    segment-causal core attention. Packed (the Transformer Engine spec):
    ``hidden`` is a row-major token stream ``[T, 1, h]`` (this rank's ``T/tp``
    rows under sequence parallelism) and the segments of ``mask`` (over the
    whole stream) become THD ``PackedSeqParams``; their lengths are bounded by
    ``mask.chunk`` (windows) or the row length (documents), and ``rope`` is the
    position table (positions restart per sequence). A sliding window is the
    attention's own ``config.window_size`` there (see ``library.core_config``).
    ``pad_to``: the stream is padded with zero rows to a multiple of it (FP8)
    and the padding's outputs dropped. ``recompute``: full activation
    recomputation of this call when training (megatron-core's checkpoint;
    Transformer Engine's under FP8: :func:`~.precision.recompute`).
    """
    if recompute and layer.training and torch.is_grad_enabled():
        from megatron_lol.model.precision import recompute as checkpoint

        holder = {}

        def run(h, segments, rope_):
            m = replace(mask, segments=segments)
            if segments is mask.segments:  # the same segments: the same FlexAttention block masks
                m.flex_cache = mask.flex_cache
            out, holder["route"] = call_block(layer, h, m, rope_, parts, packed=packed, backend=backend, pad_to=pad_to)
            return out

        out = checkpoint(layer.config, run, hidden, mask.segments, rope)
        return out, holder.get("route")
    if not packed:
        return layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rope, parts=parts, backend=backend)
    from megatron_lol.model.library import pad_rows, thd_params

    if hidden.dim() != 3 or hidden.shape[1] != 1:
        raise ValueError(f"call_block(packed=True): expected a packed stream [T, 1, h], got {tuple(hidden.shape)}")
    if mask.sliding is not None:
        _check_window_size(parts.attention if parts.attention is not None else layer, mask.sliding)
    segments = mask.segments.reshape(-1)
    params, padded = thd_params(segments, mask.chunk or mask.segments.shape[-1], pad_to, cu_seqlens=mask.cu_seqlens)
    rows = hidden.shape[0]
    if padded > segments.numel():  # never under sequence parallelism: the trunk is a multiple already
        hidden = pad_rows(hidden, rows + padded - segments.numel())
    if rope is not None and mask.positions is not None:
        att = parts.attention if parts.attention is not None else layer
        params, rope = _token_rope(att, params, rope, mask, padded)
    out, route = layer(
        hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope, parts=parts, packed_seq_params=params
    )
    return (out[:rows] if out.shape[0] != rows else out), route


def _token_rope(att, params, rope: torch.Tensor, mask, padded: int) -> tuple:
    """``(params, rope)`` for a packed call whose token positions are known: the angles gathered per
    token into :class:`~.attention.TokenRopeParams` and no table for megatron-core's attention (its
    unfused THD RoPE reads the sequence lengths back to the host), where the core attention applies
    them; the arguments unchanged elsewhere (Transformer Engine's fused RoPE). Padding rows (FP8)
    are one more sequence, positions from 0."""
    if not applies_token_rope(att.self_attention):
        return params, rope
    positions = mask.positions.reshape(-1)
    if padded > positions.numel():
        positions = torch.cat([positions, torch.arange(padded - positions.numel(), device=positions.device)])
    return TokenRopeParams.of(params, rope.index_select(0, positions)), None


def _check_window_size(layer, sliding: int) -> None:
    """Packed attention takes its sliding window from its config: it must be the mask's."""
    config = layer.self_attention.config
    if tuple(config.window_size or ()) != (sliding - 1, 0):
        raise RuntimeError(
            f"sliding window {sliding} requested, but the layer's attention was built with "
            f"window_size={config.window_size}: build the core with library.core_config(packed=True)"
        )
