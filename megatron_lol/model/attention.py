"""Segment-causal core attention for documents and packed windows.

Every attention in a LoL model is causal *inside a segment*: a document in the
prelude and coda, a window in the routed core (docs/model.md, "Windows"). This module is the
``core_attention`` of megatron-core's ``SelfAttention`` (the QKV and output
projections, RoPE and tensor parallelism stay megatron-core's); it receives a
:class:`SegmentMask` through the ``attention_mask`` argument.

Which kernel computes the masked softmax (docs/gpu.md, "Attention kernels"):

* plain causal attention (no segments, no sliding window: megatron-core's
  ``GPTModel`` baseline) is ``F.scaled_dot_product_attention(is_causal=True)``
  with no mask tensor, on every device: PyTorch's flash / memory-efficient
  kernels on GPUs;
* every other mask where the tensors are not on the CPU
  (:func:`uses_flex`): FlexAttention with a block mask built on the device
  (:mod:`~.flex_masks`; documents, sliding windows, a depth's packed windows,
  THD sequences), never a materialised ``[s, s]`` mask; the block mask is built
  once per :class:`SegmentMask` and shared by the layers that receive it;
* on the CPU, two explicit algorithms, chosen by the mask:

  - dense ``[b, heads, s, s]`` scores masked to ``j <= i`` and same segment
    (documents: segments may be as long as the row);
  - chunked, for packed windows ``[T, 1, ...]`` whose segments are at most
    ``chunk`` tokens long: queries of chunk ``c`` only look at keys of chunks
    ``c-1`` and ``c``, so the work is ``2 * T * chunk`` instead of ``T^2`` and no
    window is padded (only the packed stream is, to a multiple of ``chunk``).

  They are bit for bit what the CPU backend and earlier results assume, and
  faster on the CPU than FlexAttention's eager path (which is its math
  reference: full scores, no backward on the CPU).

Attention dropout in training (FlexAttention has none) keeps the GPU on
``F.scaled_dot_product_attention`` with the explicit boolean / additive mask of
the CPU algorithms (the LoL configs train without attention dropout, and the
grouped core refuses it).

On GPUs with Transformer Engine the same packing is expressed as THD
``PackedSeqParams`` for TE's fused attention instead (see ``library.py``).
Given such parameters, this module computes what TE's attention does with
them (each ``cu_seqlens`` sequence causal on its own, a sliding window from
``config.window_size``), so the packed layout of the TE spec runs, and is
tested, on the local spec too.

RoPE of a packed stream: megatron-core's unfused THD RoPE (the local spec's)
reads every sequence length back to the host (``cu_seqlens.tolist()`` and a
``.item()``, per projection and call). When the caller knows each token's
position inside its sequence (:attr:`SegmentMask.positions`, from the
documents or a host-built layout), ``call_block`` gathers the angles per token
instead and hands them over in :class:`TokenRopeParams`; this module applies
them to queries and keys with megatron-core's own RoPE function, the one the
THD path ends in, so the values are the same bit for bit and nothing is read
back. Transformer Engine's fused THD RoPE takes ``cu_seqlens`` on the device
and stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention.flex_attention import BlockMask


@dataclass
class SegmentMask:
    """Which keys a query may see: ``j <= i`` and ``segment[j] == segment[i]``.

    Every segment id is one contiguous run of tokens (documents, windows, THD
    sequences): the GPU's block mask (:mod:`~.flex_masks`) relies on it.

    ``segments``: ``[b, s]`` segment ids (None: one segment per row, plain
    causal). ``chunk``: every segment is at most this long and the tensor is a
    packed stream (b == 1): use the chunked algorithm. ``sliding``: also require
    ``i - j < sliding`` (dense sliding-window baseline). ``bias``: the chunked
    algorithm's additive mask when the caller built it already (for several
    blocks' streams at once, see ``executors.PerBlockCalls``). ``cu_seqlens``:
    the THD offsets of the segments of a packed stream when the caller knows them
    (a host-built layout's, zero-length entries allowed), so the packed call need
    not find them on the device (a host read). ``positions``: each token's position
    inside its segment (same shape as ``segments``), so a packed call can gather
    RoPE angles per token instead of megatron-core's THD RoPE, which reads the
    sequence lengths back to the host (see the module docstring).
    """

    segments: Optional[torch.Tensor] = None
    chunk: Optional[int] = None
    sliding: Optional[int] = None
    bias: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    #: FlexAttention block masks of this mask by ``(seq_len, batch)``, built on first use (not copied
    #: by ``dataclasses.replace``: a replaced mask may have other segments)
    flex_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def plain_causal(self) -> bool:
        """No segments, no sliding window, no chunk: ``is_causal=True`` attention."""
        return self.segments is None and self.sliding is None and self.chunk is None and self.bias is None

    def block_mask(self, seq_len: int, batch: int, device: torch.device):
        """The FlexAttention block mask of this mask over ``seq_len`` tokens (built once, on the device)."""
        key = (seq_len, batch)
        if key not in self.flex_cache:
            from megatron_lol.model.flex_masks import segment_block_mask

            segments = None if self.segments is None else self.segments.reshape(batch, seq_len)
            self.flex_cache[key] = segment_block_mask(segments, seq_len, sliding=self.sliding, batch=1, device=device)
        return self.flex_cache[key]


def uses_flex(t: torch.Tensor) -> bool:
    """Whether masked attention of ``t`` runs on FlexAttention (off the CPU; the
    :attr:`SegmentCausalAttention.fused` switch overrides it, e.g. to check the GPU algorithm on the CPU)."""
    fused = SegmentCausalAttention.fused
    return t.device.type != "cpu" if fused is None else bool(fused)


@dataclass
class TokenRopeParams(PackedSeqParams):
    """THD ``PackedSeqParams`` whose RoPE the core attention applies: ``token_rope`` ``[T, 1, 1, d]``
    holds every token's angles (megatron-core's attention is then called without ``rotary_pos_emb``)."""

    token_rope: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, params: PackedSeqParams, token_rope: torch.Tensor) -> "TokenRopeParams":
        return cls(**{f.name: getattr(params, f.name) for f in fields(PackedSeqParams)}, token_rope=token_rope)


def applies_token_rope(attention) -> bool:
    """Whether ``attention`` (a megatron-core ``SelfAttention``) can take :class:`TokenRopeParams`: its
    core attention is :class:`SegmentCausalAttention` and megatron-core would run its unfused THD RoPE
    (Transformer Engine's fused RoPE and context parallelism keep megatron-core's path)."""
    config = attention.config
    return (
        getattr(attention.core_attention, "accepts_token_rope", False)
        and not config.apply_rope_fusion
        and not getattr(config, "fused_single_qkv_rope", False)
        and getattr(config, "context_parallel_size", 1) == 1
        and not config.multi_latent_attention
    )


def apply_token_rope(t: torch.Tensor, token_rope: torch.Tensor, config) -> torch.Tensor:
    """RoPE of a THD tensor ``t`` ``[T, heads, d]`` with per-token angles ``[T, 1, 1, d]``: what
    megatron-core's unfused THD RoPE computes (it gathers the angles per sequence, then calls this
    same function), without reading sequence lengths back to the host."""
    return _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        token_rope,
        rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention,
        mscale=_yarn_get_concentration_factor_from_config(config),
    ).squeeze(1)


class SegmentCausalAttention(MegatronModule):
    """Drop-in ``core_attention`` (same constructor as megatron's DotProductAttention)."""

    #: takes a :class:`SegmentMask` as ``attention_mask`` (backends check this before calling it directly)
    accepts_segment_mask = True
    #: applies the per-token RoPE of :class:`TokenRopeParams` to queries and keys (packed calls)
    accepts_token_rope = True
    #: the GPU's kernels (FlexAttention) for masked attention: None = wherever the tensors are not on the
    #: CPU; True on the CPU checks the GPU algorithm there (eager FlexAttention, :mod:`~.flex_masks`)
    fused: Optional[bool] = None

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        *,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state

        tp = (
            parallel_state.get_tensor_model_parallel_world_size()
            if parallel_state.model_parallel_is_initialized()
            else 1
        )
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.dropout = torch.nn.Dropout(p)
        self.selective_recompute = config.recompute_granularity == "selective"

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask = attention_mask if isinstance(attention_mask, SegmentMask) else SegmentMask()
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            # megatron's own selective recompute cannot carry a SegmentMask (it saves
            # its arguments as tensors), so this module checkpoints itself
            from megatron.core import tensor_parallel

            def run(q, k, v, segments):
                m = SegmentMask(segments=segments, chunk=mask.chunk, sliding=mask.sliding, bias=mask.bias)
                m.flex_cache = mask.flex_cache  # the same segments: the same block masks
                return self._attend(q, k, v, m)

            return tensor_parallel.checkpoint(run, False, query, key, value, mask.segments)
        return self._attend(query, key, value, mask)

    def _packed(self, query, key, value, params):
        """THD input ``[T, heads, dim]``: the sequences of ``cu_seqlens_q``, each causal (and sliding
        when ``config.window_size`` is set); returns ``[T, 1, heads * dim]``."""
        if params.qkv_format != "thd":
            raise ValueError(f"SegmentCausalAttention: packed format {params.qkv_format!r} (only thd)")
        token_rope = getattr(params, "token_rope", None)
        if token_rope is not None:
            query = apply_token_rope(query, token_rope, self.config)
            key = apply_token_rope(key, token_rope, self.config)
        cu = params.cu_seqlens_q.long()
        total = query.shape[0]
        segments = torch.repeat_interleave(
            torch.arange(cu.numel() - 1, device=query.device), cu[1:] - cu[:-1], output_size=total
        )
        window = getattr(self.config, "window_size", None)
        sliding = window[0] + 1 if window else None
        # sequences at most max_seqlen long: the chunked algorithm, unless a sliding window needs the dense one
        chunk = None if sliding is not None or params.max_seqlen_q >= total else int(params.max_seqlen_q)
        mask = SegmentMask(segments=segments.view(1, -1), chunk=chunk, sliding=sliding)
        q, k, v = (t.unsqueeze(1) for t in (query, key, value))
        return self.forward(q, k, v, mask)

    def _attend(self, query, key, value, mask: SegmentMask):
        if self.heads != self.groups:  # grouped-query attention: share each K/V head
            rep = self.heads // self.groups
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        if mask.plain_causal:
            out = self._causal(query, key, value)
        elif self._use_fused(query) and not (self.training and self.dropout.p > 0):
            out = self._flex(query, key, value, mask)
        elif mask.chunk is not None:
            out = self._chunked(query, key, value, mask)
        else:
            out = self._dense(query, key, value, mask)
        s, b = out.shape[0], out.shape[1]
        return out.reshape(s, b, self.heads * self.head_dim)

    def _use_fused(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" if self.fused is None else bool(self.fused)

    def _causal(self, q, k, v):
        """Plain causal attention, ``[s, b, h, d]``: SDPA with ``is_causal=True`` and no mask tensor
        (the flash and memory-efficient kernels on GPUs, the CPU's flash kernel on the CPU)."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        p = self.dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3)

    def _flex(self, q, k, v, mask: SegmentMask):
        """Every other mask off the CPU, ``[s, b, h, d]``: FlexAttention under the mask's block mask
        (:mod:`~.flex_masks`; a packed stream's windows are ``b = 1``, the chunk only bounds them)."""
        from megatron_lol.model.flex_masks import flex_segment_attention

        s, b = q.shape[0], q.shape[1]
        block_mask = mask.block_mask(s, b if mask.segments is not None else 1, q.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return flex_segment_attention(q, k, v, block_mask, self.softmax_scale).permute(2, 0, 1, 3)

    def _fused_attention(self, q, k, v, mask) -> torch.Tensor:
        """``softmax(q k^T * scale + mask) v`` by PyTorch's fused attention (``mask``: boolean, True = may
        attend, or additive in the query's dtype); every query sees at least one key. Only for attention
        dropout off the CPU (FlexAttention has none): the mask rules out the flash kernel."""
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        p = self.dropout.p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.softmax_scale)

    def _softmax_av(self, scores, allowed, v):
        scores = scores.float() * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.dropout.p > 0:
            probs = self.dropout(probs)
        return torch.matmul(probs, v)

    def _dense(self, q, k, v, mask: SegmentMask):
        s = q.shape[0]
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
        if self._use_fused(q):
            out = self._fused_attention(q, k, v, allowed)
        else:
            out = self._softmax_av(torch.matmul(q, k.transpose(-1, -2)), allowed, v)
        return out.permute(2, 0, 1, 3)  # [s, b, h, d]

    def _chunked(self, q, k, v, mask: SegmentMask):
        """Packed windows: queries of chunk ``j`` against the keys of chunks ``j-1, j``.

        The two-chunk key blocks are the key stream padded by one chunk in
        front (``F.pad``), viewed as ``[n + 1, c, ...]`` chunks and concatenated
        with itself shifted by one chunk: one ``cat`` per tensor, whose backward
        is two slices (an overlapping ``unfold`` view gives the same values with
        a costlier backward); the
        mask is an additive ``0 / -inf`` bias (``mask.bias`` when the caller built
        it, else built here). Adding a ``0 / -inf`` bias is the same as
        ``masked_fill`` bit for bit, and the scores are the same dot products.
        """
        t_len, b, h, d = q.shape
        assert b == 1, "chunked segment attention expects a packed stream [T, 1, heads, dim]"
        bias = mask.bias
        if bias is None:
            bias = chunk_bias(mask.segments.reshape(-1), mask.chunk, [0], [t_len])
        fused = self._fused_attention if self._use_fused(q) else None
        out = chunked_attention(
            q.reshape(t_len, h, d),
            k.reshape(t_len, h, d),
            v.reshape(t_len, h, d),
            bias,
            mask.chunk,
            self.softmax_scale,
            self.dropout,
            fused=fused,
        )
        return out.unsqueeze(1)  # [T, 1, h, d]


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    c: int,
    softmax_scale: float,
    dropout: Optional[torch.nn.Dropout] = None,
    *,
    fused=None,
) -> torch.Tensor:
    """Segment-causal attention of a packed stream ``[T, heads, dim]`` whose segments are at most ``c``
    long, with the additive mask ``bias`` of :func:`chunk_bias`, or (off the CPU, :func:`window_mask`)
    the stream's FlexAttention block mask, which replaces the whole algorithm; returns ``[T, heads, dim]``.

    The algorithm of :meth:`SegmentCausalAttention._chunked`, as a function of
    tensors only (attention has no weights), so the windows of several blocks can
    be one call. ``fused(q, k, v, bias)`` (``[n, h, c, d]`` queries against ``[n, h, 2c, d]``
    keys, the bias as the mask), when given, replaces the explicit softmax: PyTorch's fused
    attention on GPUs (``SegmentCausalAttention._fused_attention``).
    """
    if isinstance(bias, BlockMask):
        from megatron_lol.model.flex_masks import flex_segment_attention

        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, T, d]
        return flex_segment_attention(q, k, v, bias, softmax_scale).squeeze(0).transpose(0, 1)
    t_len, h, d = q.shape
    n = -(-t_len // c)
    pad = n * c - t_len
    if pad:
        q = F.pad(q, (0, 0, 0, 0, 0, pad))  # zero rows at the end (one op: no zeros + cat)
    # [(n + 1) c, h, d] (one chunk of zeros in front, the padding behind) as n + 1 chunks;
    # [n, 2c, h, d]: keys (values) of chunks j-1 and j
    kp = F.pad(k, (0, 0, 0, 0, c, pad)).view(n + 1, c, h, d)
    vp = F.pad(v, (0, 0, 0, 0, c, pad)).view(n + 1, c, h, d)
    k2 = torch.cat([kp[:-1], kp[1:]], dim=1)
    v2 = torch.cat([vp[:-1], vp[1:]], dim=1)
    if fused is not None:
        out = fused(q.view(n, c, h, d).transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), bias)
        return out.transpose(1, 2).reshape(n * c, h, d)[:t_len]
    scores = torch.matmul(q.view(n, c, h, d).transpose(1, 2), k2.permute(0, 2, 3, 1))  # [n, h, c, 2c]
    scores = scores.float() * softmax_scale + bias
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout is not None and dropout.p > 0:
        probs = dropout(probs)
    out = torch.matmul(probs, v2.transpose(1, 2))  # [n, h, c, d]
    return out.transpose(1, 2).reshape(n * c, h, d)[:t_len]


def window_mask(segments: torch.Tensor, c: int):
    """The mask :func:`chunked_attention` takes for one packed stream of windows (flat ``segments``, each
    at most ``c`` long): its FlexAttention block mask where :func:`uses_flex`, else :func:`chunk_bias`."""
    if uses_flex(segments):
        from megatron_lol.model.flex_masks import segment_block_mask

        return segment_block_mask(segments.view(1, -1), segments.numel())
    return chunk_bias(segments, c, [0], [segments.numel()])


def chunk_bias(segments: torch.Tensor, c: int, starts, lengths) -> torch.Tensor:
    """Additive masks of the chunked algorithm for several packed streams at once.

    ``segments``: flat segment ids; stream ``m`` is ``segments[starts[m]:starts[m]+lengths[m]]``.
    Returns ``[sum_m ceil(len_m / c), 1, c, 2c]`` fp32 (``0`` allowed, ``-inf`` not):
    query ``r`` of chunk ``j`` may see key ``s`` of the (chunk ``j-1``, chunk ``j``) pair iff
    same segment and ``s <= r + c``. Padding positions are segment ``-1`` (they see
    each other, so no row is empty); the missing chunk before a stream's first is ``-2``.
    """
    device = segments.device
    grids = []
    for start, length in zip(starts, lengths):
        if length <= 0:
            continue
        n = -(-length // c)
        grid = segments.new_full((n * c,), -1)
        grid[:length] = segments[start : start + length]
        grid = grid.view(n, c)
        prev = torch.cat([grid.new_full((1, c), -2), grid[:-1]], dim=0)
        grids.append(torch.cat([prev, grid], dim=1))  # [n, 2c]: keys
    keys = torch.cat(grids, dim=0)
    queries = keys[:, c:]
    pos = torch.arange(2 * c, device=device)
    causal = pos.view(1, 2 * c) <= (torch.arange(c, device=device) + c).view(c, 1)
    allowed = (queries.unsqueeze(2) == keys.unsqueeze(1)) & causal
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
