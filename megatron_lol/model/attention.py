"""Segment-causal core attention for documents and packed windows.

Every attention in a LoL model is causal *inside a segment*: a document in the
prelude and coda, a window in the routed core (SPEC 1.1). This module is the
``core_attention`` of megatron-core's ``SelfAttention`` (the QKV and output
projections, RoPE and tensor parallelism stay megatron-core's); it receives a
:class:`SegmentMask` through the ``attention_mask`` argument.

Two algorithms, chosen by the mask:

* dense ``[b, heads, s, s]`` scores masked to ``j <= i`` and same segment
  (documents: segments may be as long as the row);
* chunked, for packed windows ``[T, 1, ...]`` whose segments are at most
  ``chunk`` tokens long: queries of chunk ``c`` only look at keys of chunks
  ``c-1`` and ``c``, so the work is ``2 * T * chunk`` instead of ``T^2`` and no
  window is padded (only the packed stream is, to a multiple of ``chunk``).

On GPUs with Transformer Engine the same packing is expressed as THD
``PackedSeqParams`` for TE's fused attention instead (see ``library.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule


@dataclass
class SegmentMask:
    """Which keys a query may see: ``j <= i`` and ``segment[j] == segment[i]``.

    ``segments``: ``[b, s]`` segment ids (None: one segment per row, plain
    causal). ``chunk``: every segment is at most this long and the tensor is a
    packed stream (b == 1): use the chunked algorithm. ``sliding``: also require
    ``i - j < sliding`` (dense sliding-window baseline).
    """

    segments: Optional[torch.Tensor] = None
    chunk: Optional[int] = None
    sliding: Optional[int] = None


class SegmentCausalAttention(MegatronModule):
    """Drop-in ``core_attention`` (same constructor as megatron's DotProductAttention)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.dropout = torch.nn.Dropout(p)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask = attention_mask if isinstance(attention_mask, SegmentMask) else SegmentMask()
        if self.heads != self.groups:  # grouped-query attention: share each K/V head
            rep = self.heads // self.groups
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        if mask.chunk is not None:
            out = self._chunked(query, key, value, mask)
        else:
            out = self._dense(query, key, value, mask)
        s, b = out.shape[0], out.shape[1]
        return out.reshape(s, b, self.heads * self.head_dim)

    def _softmax_av(self, scores, allowed, v):
        scores = scores.float() * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(self.dropout(probs), v)

    def _dense(self, q, k, v, mask: SegmentMask):
        s, b = q.shape[0], q.shape[1]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        idx = torch.arange(s, device=q.device)
        allowed = idx.view(1, s) <= idx.view(s, 1)  # [sq, sk]
        if mask.sliding is not None:
            allowed = allowed & (idx.view(s, 1) - idx.view(1, s) < mask.sliding)
        allowed = allowed.view(1, 1, s, s)
        if mask.segments is not None:
            seg = mask.segments
            allowed = allowed & (seg.unsqueeze(2) == seg.unsqueeze(1)).unsqueeze(1)
        out = self._softmax_av(torch.matmul(q, k.transpose(-1, -2)), allowed, v)
        return out.permute(2, 0, 1, 3)  # [s, b, h, d]

    def _chunked(self, q, k, v, mask: SegmentMask):
        t_len, b, h, d = q.shape
        assert b == 1, "chunked segment attention expects a packed stream [T, 1, heads, dim]"
        c = mask.chunk
        n = -(-t_len // c)
        pad = n * c - t_len
        seg = mask.segments.reshape(-1)

        def chunks(x):
            x = x.reshape(t_len, h, d)
            if pad:
                x = torch.cat([x, x.new_zeros(pad, h, d)], dim=0)
            return x.view(n, c, h, d)

        qc, kc, vc = chunks(q), chunks(k), chunks(v)
        # keys of chunk c: chunks c-1 and c (a segment of <= c tokens spans at most two)
        prev = lambda x: torch.cat([x.new_zeros(1, *x.shape[1:]), x[:-1]], dim=0)  # noqa: E731
        k2 = torch.cat([prev(kc), kc], dim=1)  # [n, 2c, h, d]
        v2 = torch.cat([prev(vc), vc], dim=1)
        seg_p = torch.cat([seg, seg.new_full((pad,), -1)]).view(n, c)
        seg_k = torch.cat([prev(seg_p.unsqueeze(-1)).squeeze(-1).masked_fill(
            torch.arange(n, device=seg.device).view(n, 1) == 0, -2), seg_p], dim=1)
        pos_q = torch.arange(n * c, device=seg.device).view(n, c)
        pos_k = torch.cat([pos_q - c, pos_q], dim=1)
        allowed = (seg_p.unsqueeze(2) == seg_k.unsqueeze(1)) & (pos_k.unsqueeze(1) <= pos_q.unsqueeze(2))
        # [n, h, c, d] x [n, h, d, 2c]
        scores = torch.matmul(qc.transpose(1, 2), k2.permute(0, 2, 3, 1))
        out = self._softmax_av(scores, allowed.unsqueeze(1), v2.transpose(1, 2))  # [n, h, c, d]
        out = out.transpose(1, 2).reshape(n * c, h, d)[:t_len]
        return out.unsqueeze(1)  # [T, 1, h, d]
