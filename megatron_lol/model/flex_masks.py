"""Segment-causal attention off the CPU: FlexAttention block masks built on the device.

Every masked attention of a LoL model (documents, a sliding window, a depth's
windows, packed THD sequences) allows ``j <= i`` inside a *contiguous run* of
equal segment ids, and maybe ``i - j < sliding``. FlexAttention
(``torch.nn.attention.flex_attention``) computes exactly that from a ``mask_mod``
and a :class:`~torch.nn.attention.flex_attention.BlockMask` that lists, per
128-query tile, the key tiles with at least one allowed pair (partial tiles run
the ``mask_mod``, full tiles skip it). Its kernel never holds a ``[s, s]`` mask
or scores, and it skips the tiles outside the segments, so a depth's windows cost
at most about ``T * (W + 2 * 128)`` scores instead of ``T^2`` (docs/gpu.md, "Attention kernels").

Why the block mask is not ``create_block_mask``: in eager mode that function
evaluates ``mask_mod`` on the whole ``[B, H, Q, KV]`` grid (``create_mask``) before
reducing it to tiles, i.e. it materialises the ``[s, s]`` mask once per call.
Because the segments are contiguous runs, the allowed keys of query ``q`` are the
interval ``[lo(q), q]`` with ``lo(q) = max(run_start(q), q - sliding + 1)``
non-decreasing in ``q``: a query tile ``i`` needs the key tiles from
``lo(first query) // 128`` to ``i``, and key tile ``j < i`` is full iff
``lo(last query) <= 128 j``. :func:`segment_block_mask` computes these
``[B, n, n]`` tile tables with device tensor operations only (``cummax``,
comparisons, a stable ``argsort``; no ``.item()``, ``nonzero`` or ``tolist``) and
hands them to ``BlockMask.from_kv_blocks``, which derives the query-side tables
for the backward the same way (``_transpose_ordered``: ``vmap`` + index writes).

The ``mask_mod`` compares run starts rather than segment ids, so it says "same
contiguous run": the same as "same id" for every caller here (document indices
are a cumulative sum, window ids and THD sequences are contiguous by
construction; see :class:`~.attention.SegmentMask`).

On CUDA the kernel is ``torch.compile(flex_attention)`` (compiled once per process;
torch.compile's default policy recompiles a second stream length once with dynamic lengths,
a new dtype or head size again); elsewhere the eager ``flex_attention``,
its math reference, which applies only the ``mask_mod`` (not the tile tables) and
has no backward on the CPU. :func:`implied_mask` is what the kernel computes
from both, the tables included; :func:`masked_reference` (softmax under that mask,
differentiable) stands in for the kernel where FlexAttention cannot run: a CPU
forced onto the GPU algorithm with gradients (``SegmentCausalAttention.fused``),
a device outside :data:`FLEX_DEVICES` (the tests' fake GPU).
"""

from __future__ import annotations

from typing import Optional

import torch

#: FlexAttention's default tile (``_DEFAULT_SPARSE_BLOCK_SIZE``): query and key tiles of 128 tokens
BLOCK = 128

#: where ``flex_attention`` runs (its ``_validate_device``); other devices (the tests' fake GPU) take
#: :func:`masked_reference`
FLEX_DEVICES = ("cuda", "cpu", "xpu", "hpu", "mps")

#: the smallest head dimension of FlexAttention's CUDA kernel (``tl.dot``: "embedding dimension ... must be
#: at least 16", torch/_inductor/kernel/flex/flex_attention.py); smaller heads are zero-padded to it
MIN_HEAD_DIM = 16

_compiled_flex = None


def flex_kernel(device: torch.device):
    """``flex_attention``, compiled on CUDA (once per process), eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # default dynamic-shape policy: a second stream length (the per-block core's streams follow the
        # routing) recompiles once with dynamic lengths instead of once per length
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def run_starts(segments: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: the index of the first token of each token's contiguous run of equal ids."""
    b, s = segments.shape
    idx = torch.arange(s, device=segments.device).expand(b, s)
    change = torch.ones((b, s), dtype=torch.bool, device=segments.device)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(change, idx, torch.zeros_like(idx)).cummax(dim=1).values


def _ordered(tiles: torch.Tensor) -> tuple:
    """``(count, indices)`` of a boolean ``[b, n, n]`` tile table: what ``BlockMask`` stores, ``[b, 1, n, n]``."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count.unsqueeze(1).contiguous(), order.unsqueeze(1).contiguous()


def segment_block_mask(
    segments: Optional[torch.Tensor],
    seq_len: int,
    *,
    sliding: Optional[int] = None,
    batch: int = 1,
    device: Optional[torch.device] = None,
):
    """The :class:`BlockMask` of segment-causal attention over ``seq_len`` tokens.

    ``segments``: ``[b, s]`` ids, each id one contiguous run (None: one segment per row);
    ``sliding``: also ``i - j < sliding``. Built on ``segments``' device without a host read.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if segments is not None:
        device, batch = segments.device, segments.shape[0]
        start = run_starts(segments)
    else:
        start = torch.zeros((batch, seq_len), dtype=torch.long, device=device)
    idx = torch.arange(seq_len, device=device)
    lo = start if sliding is None else torch.maximum(start, idx - (sliding - 1))
    n = -(-seq_len // BLOCK)
    tile = torch.arange(n, device=device)
    first = lo[:, tile * BLOCK]  # [b, n]: lo of each query tile's first query
    last = lo[:, torch.clamp(tile * BLOCK + BLOCK - 1, max=seq_len - 1)]  # ... and of its last
    below = tile.view(1, n) <= tile.view(n, 1)  # [q tile, kv tile]: causal
    needed = below & (tile.view(1, 1, n) >= torch.div(first, BLOCK, rounding_mode="floor").unsqueeze(2))
    full = (tile.view(1, n) < tile.view(n, 1)) & (tile.view(1, 1, n) * BLOCK >= last.unsqueeze(2))
    partial = needed & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)

    def mask_mod(b, h, q, kv):
        allowed = (kv <= q) & (start[b, q] == start[b, kv])
        if sliding is not None:
            allowed = allowed & (q - kv < sliding)
        return allowed

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len)
    )


def flex_segment_attention(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """``[b, h, s, d]`` queries, keys, values (as many key as query heads) under ``block_mask``."""
    if q.device.type not in FLEX_DEVICES or (
        q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    ):
        return masked_reference(q, k, v, block_mask, scale)  # no FlexAttention there (or no CPU backward)
    d = q.shape[-1]
    if d < MIN_HEAD_DIM:  # zero columns: the same dot products and outputs, sliced off after
        q, k, v = (torch.nn.functional.pad(t, (0, MIN_HEAD_DIM - d)) for t in (q, k, v))
    return flex_kernel(q.device)(q, k, v, block_mask=block_mask, scale=scale)[..., :d]


def _tiles(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Boolean ``[b, 1, n_q, n_kv]`` tile table from BlockMask's ``(count, indices)``."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    cols = torch.where(valid, idx, n_kv).long()
    dense = torch.zeros((*idx.shape[:-1], n_kv + 1), dtype=torch.bool, device=idx.device)
    return dense.scatter_(-1, cols, True)[..., :n_kv]


def implied_mask(block_mask) -> torch.Tensor:
    """``[b, 1, s, s]``: the pairs FlexAttention's kernel lets through, ``mask_mod`` on the partial
    tiles and every pair of the full ones (the whole ``[s, s]`` grid: for tests and the CPU only)."""
    q_len, kv_len = block_mask.seq_lengths
    n_kv = block_mask.kv_indices.shape[-1]
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv)
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv)

    def tokens(t):
        return t.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :q_len, :kv_len]

    device = partial.device
    b = torch.arange(partial.shape[0], device=device).view(-1, 1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    allowed = block_mask.mask_mod(b, torch.zeros_like(b), q, kv)
    return (tokens(partial) & allowed) | tokens(full)


def masked_reference(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale)`` under :func:`implied_mask`, times ``v`` (FP32 scores), differentiable."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~implied_mask(block_mask), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
