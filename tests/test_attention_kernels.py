"""The local spec's attention kernels on the CPU: every mask kind against the written-out masked softmax,
for the CPU's algorithms and for the GPU's (FlexAttention block masks, checked here through FlexAttention's
eager path and the mask the block tables imply). The fake-GPU dispatch check (which kernel each mask kind
selects off the CPU) is ``tests/test_gpu_path.py::test_attention_takes_the_fused_kernels_on_a_fake_gpu``.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import inputs, make_cases, reference, run_case

CASES = make_cases()


def _values_and_grads(layout, q, k, v, upstream):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = run_case(layout, q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    return out.detach(), grads


@pytest.fixture
def gpu_algorithm():
    """The GPU's attention algorithm on the CPU (``SegmentCausalAttention.fused``)."""
    from megatron_lol.model.attention import SegmentCausalAttention

    saved = SegmentCausalAttention.fused
    SegmentCausalAttention.fused = True
    yield
    SegmentCausalAttention.fused = saved


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_attention_equals_the_masked_softmax(megatron_env, name):
    """The CPU path (explicit dense / chunked algorithms; SDPA ``is_causal`` for plain causal attention):
    values and gradients within 1e-6 of ``softmax(q k^T * scale + mask) v`` for every mask kind."""
    layout, shape, allowed = CASES[name]
    q, k, v, up = inputs(shape)
    out, grads = _values_and_grads(layout, q, k, v, up)
    ref, ref_grads = _values_and_grads_reference(q, k, v, up, allowed)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def _values_and_grads_reference(q, k, v, up, allowed):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = reference(q, k, v, allowed)
    return out.detach(), torch.autograd.grad(out, (q, k, v), up)


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_algorithm_on_the_cpu_equals_the_masked_softmax(megatron_env, gpu_algorithm, name):
    """The GPU's algorithm for every mask kind, run on the CPU: FlexAttention's own eager kernel for the
    values (it applies the ``mask_mod``; no gradients on the CPU), and, for values and gradients, the
    softmax under the mask that the block tables and the ``mask_mod`` together let through (what the
    compiled kernel computes: tiles outside the tables are skipped, full tiles skip the ``mask_mod``).
    Both within 1e-6 of the written-out masked softmax (plain causal: SDPA ``is_causal`` here too)."""
    layout, shape, allowed = CASES[name]
    q, k, v, up = inputs(shape)
    ref, ref_grads = _values_and_grads_reference(q, k, v, up, allowed)
    with torch.no_grad():
        eager_flex = run_case(layout, q, k, v)
    torch.testing.assert_close(eager_flex, ref, rtol=1e-6, atol=1e-6)
    out, grads = _values_and_grads(layout, q, k, v, up)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sliding", [None, 37, 128, 300])
@pytest.mark.parametrize("seq", [128, 257, 700])
def test_block_tables_cover_exactly_the_segment_mask_without_host_reads(sliding, seq):
    """The tile tables built from segment runs (no ``[s, s]`` mask, no host read) with the ``mask_mod``
    let through exactly ``j <= i``, same segment (and ``i - j < sliding``); full tiles exist where a
    document spans several tiles; tiles outside the segments are skipped."""
    from megatron_lol.model.flex_masks import BLOCK, implied_mask, segment_block_mask
    from megatron_lol.perf.op_count import OpCounter

    g = torch.Generator().manual_seed(seq)
    starts = torch.rand(3, seq, generator=g) < 0.02
    starts[:, 0] = True
    starts[1, :] = False  # one document per row
    starts[1, 0] = True
    starts[2, 1:] = torch.arange(1, seq) % 5 == 0  # short runs: most tiles skipped
    segments = torch.cumsum(starts.reshape(-1).long(), 0).view(3, seq)
    with OpCounter() as count:
        mask = segment_block_mask(segments, seq, sliding=sliding)
    assert count.syncs == 0, count.sync_names
    i = torch.arange(seq)
    want = (i.view(1, -1) <= i.view(-1, 1)) & (segments.unsqueeze(2) == segments.unsqueeze(1))
    if sliding is not None:
        want = want & (i.view(-1, 1) - i.view(1, -1) < sliding)
    assert torch.equal(implied_mask(mask)[:, 0], want)
    # tile by tile: the listed tiles are those with an allowed pair, the full ones have only allowed pairs
    n = -(-seq // BLOCK)
    pad = n * BLOCK - seq
    any_ = torch.nn.functional.pad(want, (0, pad, 0, pad)).view(3, n, BLOCK, n, BLOCK).any(4).any(2)
    real_rows = torch.nn.functional.pad(want, (0, pad, 0, pad), value=True)  # padded queries / keys: no constraint
    all_ = real_rows.view(3, n, BLOCK, n, BLOCK).all(4).all(2)
    partial, full = (
        _tile_table(mask.kv_num_blocks, mask.kv_indices, n),
        _tile_table(mask.full_kv_num_blocks, mask.full_kv_indices, n),
    )
    assert torch.equal(partial | full, any_) and not (partial & full).any()
    assert not (full & ~all_).any()
    if seq > BLOCK and (sliding is None or sliding > BLOCK):
        assert int(full[1].sum()) > 0  # the one-document row has full tiles
    if seq >= 700:
        assert int((partial | full)[2].sum()) < 2 * n  # short segments: the diagonal and at most the tile before


def _tile_table(num, idx, n):
    table = torch.zeros(num.shape[0], n, n, dtype=torch.bool)
    for b in range(num.shape[0]):
        for i in range(n):
            table[b, i, idx[b, 0, i, : int(num[b, 0, i])].long()] = True
    return table


def test_block_masks_are_built_once_per_mask(megatron_env, gpu_algorithm):
    """A :class:`SegmentMask` shared by several layers (a micro-batch's documents) builds its block mask
    once; a replaced mask (other segments) builds its own."""
    import dataclasses

    from megatron_lol.model import flex_masks
    from megatron_lol.model.attention import SegmentMask

    layout, shape, _ = CASES["document"]
    q, k, v, _ = inputs(shape)
    mask = SegmentMask(segments=layout["segments"])
    built = []
    real = flex_masks.segment_block_mask
    flex_masks.segment_block_mask = lambda *a, **kw: built.append(1) or real(*a, **kw)
    try:
        from attention_cases import attention_module

        attn = attention_module()
        with torch.no_grad():
            first = attn(q, k, v, mask)
            second = attention_module()(q, k, v, mask)
            assert len(built) == 1 and torch.equal(first, second)
            attn(q, k, v, dataclasses.replace(mask, segments=layout["segments"].flip(1)))
    finally:
        flex_masks.segment_block_mask = real
    assert len(built) == 2


@pytest.mark.parametrize("recompute", [False, True])
def test_a_forward_builds_one_block_mask_per_document_layout(megatron_env, gpu_algorithm, recompute):
    """A dense model (prelude, two full core layers, coda) builds two block masks per forward: one shared
    by the prelude and coda (the micro-batch's documents), one by the core layers; the same under full
    activation recomputation of the prelude and coda (the checkpointed calls keep the mask's block
    masks), whose recomputation in the backward builds one per recomputed layer."""
    from conftest import tiny_config

    from megatron_lol.model import flex_masks
    from megatron_lol.model.lol_model import LoLGPTModel

    cfg = tiny_config(plan="dense", core_layers=2, num_blocks=None, routed_depth=None)
    net = LoLGPTModel(cfg, 97, 0, init_seed=3).train()
    if recompute:
        net.config.recompute_granularity = "full"  # the prelude's and coda's calls (call_block)
    tokens = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    tokens[0, 9] = 0
    built = []
    real = flex_masks.segment_block_mask
    flex_masks.segment_block_mask = lambda *a, **kw: built.append(1) or real(*a, **kw)
    try:
        loss = net(tokens, labels=tokens).sum()
        in_forward = len(built)
        loss.backward()
    finally:
        flex_masks.segment_block_mask = real
    assert in_forward == 2
    # recomputation is a second forward of the prelude's and coda's layers, from detached segments
    assert len(built) == (4 if recompute else 2)


def test_the_dense_gpt_baseline_calls_sdpa_causal_without_a_mask(megatron_env):
    """The GPU proof's dense baseline (megatron-core's ``GPTModel`` on ``library.block_spec(False)``, as
    ``bench/gpu/gpt_baseline.py`` builds it, called with ``attention_mask=None``): every attention call is
    ``F.scaled_dot_product_attention(is_causal=True)`` with no mask tensor, the flash-eligible call."""
    import torch.nn.functional as F
    from conftest import tiny_config
    from megatron.core.models.gpt import GPTModel

    from megatron_lol.model.library import block_spec, transformer_config

    cfg = tiny_config(plan="dense", core_layers=1, num_blocks=None, routed_depth=None)
    model = GPTModel(
        config=transformer_config(cfg, None, 3),
        transformer_layer_spec=block_spec(False),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="rope",
    )
    calls = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask is None, bool(kwargs.get("is_causal"))))
        return real(q, k, v, attn_mask, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum().backward()
    finally:
        F.scaled_dot_product_attention = real
    assert calls == [(True, True)] * 3
