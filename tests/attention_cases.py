"""Every mask kind of the local spec's attention, as small cases shared by the CPU tests
(tests/test_attention_kernels.py) and the fake-GPU dispatch check (tests/fake_gpu_check.py).

A case is inputs on the CPU plus a call that runs :class:`SegmentCausalAttention` (or the grouped
core's :func:`chunked_attention`) the way the model does, on whatever device the inputs were moved
to, and the reference mask ``allowed[b, i, j]`` of ``softmax(q k^T * scale + mask) v``.
"""

from __future__ import annotations

import torch

HEADS, GROUPS, DIM, W = 4, 2, 8, 24
#: sequence lengths above the 128-token tile, not multiples of it (FlexAttention pads the last tile)
ROWS, SEQ = 2, 200
SCALE = DIM**-0.5


def attention_module(window_size=None):
    from conftest import tiny_config

    from megatron_lol.model.attention import SegmentCausalAttention
    from megatron_lol.model.library import transformer_config

    config = transformer_config(
        tiny_config(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS)
    )
    config.window_size = window_size
    return SegmentCausalAttention(config, 1).eval()


def _documents(g):
    """``[ROWS, SEQ]`` document ids (a cumulative sum, as ``DocumentLayout.doc_index``): one long document
    (full 128-tiles) and short ones."""
    starts = torch.rand(ROWS, SEQ, generator=g) < 0.04
    starts[:, 0] = True
    starts[0, 1:150] = False
    return torch.cumsum(starts.reshape(-1).long(), 0).view(ROWS, SEQ) - 1


def _windows(g, total):
    """Flat window ids of a packed stream, windows of 1..W tokens (a depth's shifted windows)."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(1, W + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - total
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), lengths


def _causal(n, sliding=None):
    i = torch.arange(n)
    allowed = i.view(1, n) <= i.view(n, 1)
    if sliding is not None:
        allowed = allowed & (i.view(n, 1) - i.view(1, n) < sliding)
    return allowed


def _same(seg):  # [b, s] -> [b, s, s]
    return seg.unsqueeze(2) == seg.unsqueeze(1)


def make_cases(seed: int = 0) -> dict:
    """``name -> (layout, qkv shape, allowed [b, s, s])``; ``layout`` says how :func:`run_case` calls."""
    g = torch.Generator().manual_seed(seed)
    docs = _documents(g)
    total = ROWS * SEQ
    windows, lengths = _windows(g, total)
    # the grouped core's stream: windows grouped by block, so ids are contiguous runs but not sorted
    perm = torch.randperm(len(lengths), generator=g)
    grouped = torch.repeat_interleave(perm, torch.tensor(lengths)[perm])
    cu = torch.cumsum(torch.tensor([0] + lengths), 0).to(torch.int32)
    return {
        "causal": (dict(kind="mask"), (SEQ, ROWS), _causal(SEQ).expand(ROWS, SEQ, SEQ)),
        "document": (dict(kind="mask", segments=docs), (SEQ, ROWS), _causal(SEQ) & _same(docs)),
        "sliding": (dict(kind="mask", segments=docs, sliding=W), (SEQ, ROWS), _causal(SEQ, W) & _same(docs)),
        "strided": (
            dict(kind="mask", segments=windows.view(1, -1), chunk=W),
            (total, 1),
            (_causal(total) & _same(windows.view(1, -1))),
        ),
        "window": (dict(kind="grouped", segments=grouped), (total, 1), _causal(total) & _same(grouped.view(1, -1))),
        "packed": (
            dict(kind="thd", cu_seqlens=cu, max_seqlen=W),
            (total, 1),
            _causal(total) & _same(windows.view(1, -1)),
        ),
        "packed-sliding": (
            dict(
                kind="thd", cu_seqlens=torch.tensor([0, 150, 320, total], dtype=torch.int32), max_seqlen=170, sliding=W
            ),
            (total, 1),
            _causal(total, W)
            & _same(torch.repeat_interleave(torch.arange(3), torch.tensor([150, 170, total - 320])).view(1, -1)),
        ),
    }


def inputs(shape, seed: int = 1):
    """``q [s, b, HEADS, DIM]``, ``k, v [s, b, GROUPS, DIM]`` (grouped-query attention) and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    s, b = shape
    q = torch.randn(s, b, HEADS, DIM, generator=g)
    k, v = (torch.randn(s, b, GROUPS, DIM, generator=g) for _ in range(2))
    return q, k, v, torch.randn(s, b, HEADS * DIM, generator=g)


def run_case(layout: dict, q, k, v, device=None):
    """The attention output ``[s, b, HEADS * DIM]`` the model's call of this mask kind computes."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_lol.model.attention import SegmentMask, chunked_attention, window_mask

    dev = q.device
    kind = layout["kind"]
    if kind == "mask":
        seg = layout.get("segments")
        mask = SegmentMask(
            segments=None if seg is None else seg.to(dev), chunk=layout.get("chunk"), sliding=layout.get("sliding")
        )
        return attention_module()(q, k, v, mask)
    if kind == "grouped":  # grouped_blocks: key / value heads repeated, then the stream's window mask
        rep = HEADS // GROUPS
        flat = [t.reshape(t.shape[0], t.shape[2], DIM) for t in (q, k, v)]
        key, value = (t.repeat_interleave(rep, dim=1) for t in flat[1:])
        out = chunked_attention(flat[0], key, value, window_mask(layout["segments"].to(dev), W), W, SCALE)
        return out.reshape(q.shape[0], 1, HEADS * DIM)
    sliding = layout.get("sliding")
    attn = attention_module(window_size=(sliding - 1, 0) if sliding else None)
    cu = layout["cu_seqlens"].to(dev)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=layout["max_seqlen"],
        max_seqlen_kv=layout["max_seqlen"],
    )
    return attn(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=params)


def reference(q, k, v, allowed):
    """``softmax(q k^T * scale + mask) v`` written out (FP32), keys / values shared by query groups."""
    s, b = q.shape[:2]
    rep = HEADS // GROUPS
    q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    scores = (q_ @ k_.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v_
    return out.permute(2, 0, 1, 3).reshape(s, b, HEADS * DIM)
