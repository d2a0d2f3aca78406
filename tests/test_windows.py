"""Windows (docs/model.md, "Windows"): windows, reach, attention pairs, document restarts, window-blocked attention."""

from __future__ import annotations

import pytest
import torch

from megatron_lol.model.windows import (
    DocumentLayout,
    WindowLayout,
    allowed_pairs,
    earliest_reach,
    window_groups,
)


def _groups_from_layout(layout: WindowLayout) -> list[tuple[int, int]]:
    first = layout.window_first_token.tolist()
    length = layout.window_length.tolist()
    return [(f, f + n - 1) for f, n in zip(first, length)]


def _core_allowed(n: int, depth: int, W: int, S: int) -> torch.Tensor:
    """(query, key) pairs core attention allows at one depth, from the model's own WindowLayout."""
    tw = WindowLayout.build(DocumentLayout.single(1, n), depth, W, S).token_window
    idx = torch.arange(n)
    return (tw.view(n, 1) == tw.view(1, n)) & (idx.view(1, n) <= idx.view(n, 1))


# ----------------------------------------------------------------------- golden facts
def test_golden_groups_n8_w4_s2():
    assert window_groups(8, 1, 4, 2) == [(0, 3), (4, 7)]
    assert window_groups(8, 2, 4, 2) == [(0, 1), (2, 5), (6, 7)]
    assert window_groups(8, 3, 4, 2) == window_groups(8, 1, 4, 2)
    docs = DocumentLayout.single(1, 8)
    for depth, want in [(1, [(0, 3), (4, 7)]), (2, [(0, 1), (2, 5), (6, 7)]), (3, [(0, 3), (4, 7)])]:
        layout = WindowLayout.build(docs, depth, 4, 2)
        assert _groups_from_layout(layout) == want
        assert layout.window_ordinal.tolist() == list(range(len(want)))


def test_golden_earliest_reach():
    assert earliest_reach(8, 4, 3, 4, 2) == [4, 0, 0]
    # the same recurrence through the model's window masks
    reach = torch.arange(8)
    got = []
    for depth in (1, 2, 3):
        allowed = _core_allowed(8, depth, 4, 2)
        reach = torch.where(allowed, reach.view(1, 8), torch.full((8, 8), 99)).min(dim=1).values
        got.append(int(reach[4]))
    assert got == [4, 0, 0]


def test_golden_pair_counts_n1024_w128():
    assert allowed_pairs(1024, 128) == 66_048
    assert allowed_pairs(1024, 128, offset=64) == 61_952
    assert allowed_pairs(1024, None) == 524_800
    # through the masks the core actually builds (depth 2 is shifted by S=64)
    assert int(_core_allowed(1024, 1, 128, 64).sum()) == 66_048
    assert int(_core_allowed(1024, 2, 128, 64).sum()) == 61_952
    assert int(_core_allowed(1024, 3, 128, 64).sum()) == 66_048


def test_shift_zero_every_depth_identical():
    for depth in range(1, 5):
        assert window_groups(20, depth, 8, 0) == [(0, 7), (8, 15), (16, 19)]
        assert torch.equal(_core_allowed(20, depth, 8, 0), _core_allowed(20, 1, 8, 0))


def test_offsets_wrap_modulo_window():
    # delta_l = ((l-1) * S) mod W: with W=8, S=6 depth 3 is shifted by 12 mod 8 = 4
    assert window_groups(12, 3, 8, 6) == [(0, 3), (4, 11)]
    assert window_groups(12, 5, 8, 6) == [(0, 7), (8, 11)]  # 24 mod 8 = 0


# ----------------------------------------------------------------------- documents
def test_document_layout_eod_ends_its_document():
    eod = 0
    row = torch.tensor([[5, 6, 7, eod, 8, 9, eod, eod, 3]])
    docs = DocumentLayout.from_tokens(row, eod)
    assert docs.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 0]]
    assert docs.doc_index.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 3]]
    assert docs.num_docs == 4
    two = DocumentLayout.from_tokens(torch.tensor([[1, 2, eod], [eod, 4, 5]]), eod)
    # every row starts a document; indices are global over the micro-batch
    assert two.doc_index.tolist() == [[0, 0, 0], [1, 2, 2]]
    assert two.positions.tolist() == [[0, 1, 2], [0, 0, 1]]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_windows_restart_at_document_boundaries(depth):
    eod, W, S = 0, 4, 2
    lens = [7, 10, 3]  # not multiples of W
    tokens = []
    for n in lens:
        tokens += [1] * (n - 1) + [eod]
    docs = DocumentLayout.from_tokens(torch.tensor([tokens]), eod)
    layout = WindowLayout.build(docs, depth, W, S)
    want, start = [], 0
    want_ord, want_doc = [], []
    for d, n in enumerate(lens):
        groups = window_groups(n, depth, W, S)
        want += [(start + a, start + b) for a, b in groups]
        want_ord += list(range(len(groups)))
        want_doc += [d] * len(groups)
        start += n
    assert _groups_from_layout(layout) == want
    assert layout.window_ordinal.tolist() == want_ord
    assert layout.window_doc.tolist() == want_doc
    assert layout.num_docs == 3
    # no window spans two documents
    tok_doc = docs.doc_index.reshape(-1)
    for w in range(layout.num_windows):
        assert tok_doc[layout.token_window == w].unique().numel() == 1


def test_prefix_means_restart_per_document():
    """r_k of document B in a packed row equals r_k of B alone (docs/model.md, "Router": cumsum restarts)."""
    from megatron_lol.model.host_layout import build_host_layout
    from megatron_lol.model.static_routing import router_summaries

    eod, W, S, h = 0, 4, 2, 5
    a = torch.tensor([3, 4, 5, 6, 7, eod])
    b = torch.tensor([8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    row = torch.cat([a, b]).view(1, -1)
    torch.manual_seed(0)
    states = torch.randn(row.numel(), h)
    e = torch.randn(h)
    for depth in (1, 2):
        packed = build_host_layout(row, eod, W, S, [depth]).for_depth(depth)
        alone = build_host_layout(b.view(1, -1), eod, W, S, [depth]).for_depth(depth)
        real = packed.window_valid & (packed.window_doc == 1)
        r_packed = router_summaries(packed, states, e)[real]
        r_alone = router_summaries(alone, states[len(a) :], e)[: alone.num_windows]
        torch.testing.assert_close(r_packed, r_alone, rtol=0, atol=1e-6)
        # hand check of r_2 for B alone: mean of the means of windows 0 and 1
        g = window_groups(len(b), depth, W, S)
        mu = [states[len(a) + s : len(a) + t + 1].mean(0) for s, t in g]
        torch.testing.assert_close(r_alone[2], (mu[0] + mu[1]) / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(r_alone[0], 0.5 * (e + states[len(a)]), rtol=0, atol=1e-6)


# ------------------------------------------------- window-blocked attention (the real mask)
def _attention():
    from conftest import tiny_config

    from megatron_lol.model.attention import SegmentCausalAttention
    from megatron_lol.model.library import transformer_config

    return SegmentCausalAttention(transformer_config(tiny_config(hidden_size=32, num_attention_heads=4)), 1)


def test_chunked_window_attention_matches_dense_and_stays_in_window(megatron_env):
    from megatron_lol.model.attention import SegmentMask

    attn = _attention()
    torch.manual_seed(0)
    W = 8
    lens = [8, 3, 5, 8, 1, 7, 2, 8]  # packed windows of at most W tokens
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    T = seg.numel()
    q, k, v = (torch.randn(T, 1, 4, 8) for _ in range(3))
    chunked = attn(q, k, v, SegmentMask(segments=seg.view(1, -1), chunk=W))
    dense = attn(q, k, v, SegmentMask(segments=seg.view(1, -1)))
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-6)
    # and each window alone with a plain causal mask gives the same rows
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        alone = attn(q[sl], k[sl], v[sl], SegmentMask())
        torch.testing.assert_close(chunked[sl], alone, rtol=1e-5, atol=1e-6)
        start += n
    # changing keys/values of one window changes no other window's output
    k2, v2 = k.clone(), v.clone()
    k2[seg == 3] += 1.0
    v2[seg == 3] -= 2.0
    other = attn(q, k2, v2, SegmentMask(segments=seg.view(1, -1), chunk=W))
    assert torch.equal(other[seg != 3], chunked[seg != 3])
    assert not torch.allclose(other[seg == 3], chunked[seg == 3])


def _forced_everywhere(D, K, block_of):
    ids = torch.tensor([[block_of(d, k) for k in range(K)] for d in range(D)], dtype=torch.long)
    return ids, torch.full((D, K), 0.75)


@pytest.mark.parametrize("shift", [0, 4])
def test_shift_zero_nothing_crosses_a_window_in_the_model(make_model, shift):
    """With S=0, no prelude/coda and routing forced (constant gates), changing a token of
    window k changes no logit outside window k; with S=4 it does (the control)."""
    from megatron_lol.model.core import ForcedPath

    W, D, n = 8, 4, 32
    model = make_model(
        n_prelude=0, n_coda=0, routed_depth=D, num_blocks=3, window_size=W, window_shift=shift, router_std=10.0
    )
    ids, gates = _forced_everywhere(D, n // W + 1, lambda d, k: (d + k) % 3)
    forced = ForcedPath(ids, gates)
    torch.manual_seed(1)
    x = torch.randint(1, 97, (1, n))
    with torch.no_grad():
        base = model(x, forced_path=forced)
        for t in (3, 10, 17):  # windows 0, 1, 2
            y = x.clone()
            y[0, t] = (y[0, t] % 96) + 1
            out = model(y, forced_path=forced)
            k = t // W
            window = torch.arange(n) // W == k
            changed = (out - base).abs().amax(-1)[0] > 0
            assert changed[t : (k + 1) * W].all()  # the window itself from t on
            if shift == 0:
                assert not changed[~window].any(), f"S=0: token {t} leaked out of window {k}"
            elif k < n // W - 1:
                assert changed[(k + 1) * W :].any(), "S=4: shifted windows must carry information"
