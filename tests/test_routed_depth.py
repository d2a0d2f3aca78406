"""The routed depth: host layout, sync-free routing and the two block executors against each other.

The routing pieces (:mod:`megatron_lol.model.static_routing` on the host layout) are checked
against plain per-window computations written here (``DocumentLayout`` / ``WindowLayout`` /
``window_noise`` measured on the device, the router's and the balancing losses' definitions);
the grouped GEMMs' executor against the per-block calls' (``Core.forward`` with the CPU backend
off). Values and gradients must agree to 1e-6 in fp32, and routing and the grouped executor
must not read anything back to the host (``megatron_lol.perf.op_count``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lol.model.host_layout import build_host_layout, window_capacity
from megatron_lol.model.windows import DocumentLayout, WindowLayout
from megatron_lol.perf.op_count import OpCounter

TOL = dict(rtol=1e-6, atol=1e-6)


def _tokens(b, s, seed, eod_rate=0.08, short_docs=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    tokens[torch.rand(b, s, generator=g) < eod_rate] = 0
    if short_docs:  # a run of one- and two-token documents, and a row ending in EOD
        tokens[0, 3:12:2] = 0
        tokens[-1, -1] = 0
    return tokens


# ---------------------------------------------------------------- host layout
@pytest.mark.parametrize("b,s,W,S,short", [(3, 45, 8, 4, True), (2, 64, 16, 5, False), (4, 33, 8, 0, True)])
def test_host_layout_equals_the_device_layout(b, s, W, S, short):
    from megatron_lol.model.library import thd_params
    from megatron_lol.model.router import window_noise

    tokens = _tokens(b, s, b * s, short_docs=short)
    seeds = torch.randint(0, 2**40, (b,), generator=torch.Generator().manual_seed(s))
    L, depths = 5, range(1, 5)
    layout = build_host_layout(tokens, 0, W, S, depths, L, seeds)
    docs = DocumentLayout.from_tokens(tokens, 0)
    assert torch.equal(layout.positions, docs.positions) and torch.equal(layout.doc_index, docs.doc_index)
    assert layout.num_docs == docs.num_docs and float(layout.doc_count) == docs.num_docs
    base = window_capacity(b, s, W)
    assert layout.capacity % base == 0 and layout.capacity >= max(docs.num_docs, base)
    cu_docs, _ = thd_params(docs.doc_index, s)
    assert torch.equal(layout.doc_cu_seqlens[: docs.num_docs + 1], cu_docs.cu_seqlens_q)
    assert bool((layout.doc_cu_seqlens[docs.num_docs :] == b * s).all())
    for depth in depths:
        ref = WindowLayout.build(docs, depth, W, S)
        win = layout.for_depth(depth)
        n, C = ref.num_windows, layout.capacity
        assert win.num_windows == n and win.window_ordinal.shape == (C,)
        assert torch.equal(win.token_window, ref.token_window)
        for name in ("window_ordinal", "window_doc", "window_first_token", "window_length"):
            assert torch.equal(getattr(win, name)[:n], getattr(ref, name)), name
        assert bool((win.window_length[n:] == 0).all()) and int(win.window_valid.sum()) == n
        cu, _ = thd_params(ref.token_window, W)
        assert torch.equal(win.cu_seqlens[: n + 1], cu.cu_seqlens_q) and bool((win.cu_seqlens[n:] == b * s).all())
        first = ref.window_first_token.index_select(0, ref.token_window)
        assert torch.equal(win.token_position, torch.arange(b * s) - first)
        assert int(win.token_is_first.sum()) == n
        docs_of = torch.repeat_interleave(torch.arange(C), win.doc_window_offsets[1:] - win.doc_window_offsets[:-1])
        assert torch.equal(docs_of, ref.window_doc)
        noise = window_noise(ref, seeds, depth, L, s)
        assert torch.equal(layout.noise[depth][:n], noise), "noise must be bit for bit the device's draw"
    moved = layout.pin_memory().to("cpu")
    assert torch.equal(moved.for_depth(2).cu_seqlens, layout.for_depth(2).cu_seqlens)


def test_host_layout_capacity_is_static_for_long_documents_and_grows_for_short_ones():
    long_docs = build_host_layout(_tokens(4, 64, 1, eod_rate=0.0), 0, 8, 4, [1, 2])
    assert long_docs.capacity == window_capacity(4, 64, 8) == 36
    many = torch.ones(4, 64, dtype=torch.long)
    many[:, ::2] = 0  # two-token documents, and a one-token one at each end of a row
    short = build_host_layout(many, 0, 8, 4, [1, 2])
    assert short.capacity == 4 * 36 and short.num_docs == 132  # 33 per row: the EOD at 0 is a document
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        build_host_layout(torch.ones(8, dtype=torch.long), 0, 8, 4, [1])
    with pytest.raises(ValueError, match="num_blocks"):
        build_host_layout(many, 0, 8, 4, [1], row_seeds=torch.zeros(4, dtype=torch.long))


def test_host_layout_for_a_trainer_batch_draws_the_trainers_noise():
    """What the trainer will attach to a micro-batch: every windowed depth of the plan, and the noise of
    the seeds the trainer derives (``sample_id + run_seed * 1,000,000,007``)."""
    from conftest import tiny_config

    from megatron_lol.model.host_layout import host_layout_for_batch, routed_depths
    from megatron_lol.model.router import window_noise

    cfg = tiny_config(routed_depth=3)
    tokens = _tokens(2, 24, 3)
    batch = {"tokens": tokens, "sample_ids": torch.tensor([40, 41])}
    plan = cfg.execution_plan()
    layout = host_layout_for_batch(batch, cfg, plan, 0, run_seed=7, pin=False)
    assert routed_depths(plan) == [1, 2, 3] and sorted(layout.noise) == [1, 2, 3]
    ref = WindowLayout.build(DocumentLayout.from_tokens(tokens, 0), 3, cfg.plan.windows.size, cfg.plan.windows.shift)
    seeds = batch["sample_ids"] + 7 * 1_000_000_007
    assert torch.equal(layout.noise[3][: ref.num_windows], window_noise(ref, seeds, 3, cfg.plan.num_blocks, 24))
    assert host_layout_for_batch({"tokens": tokens}, cfg, plan, 0, run_seed=7, pin=False).noise == {}
    quiet = tiny_config(routed_depth=3, router_noise=False)
    assert host_layout_for_batch(batch, quiet, quiet.execution_plan(), 0, run_seed=7, pin=False).noise == {}


# ---------------------------------------------------------------- sync-free routing functions
def _depth_case(depth=2, L=4, seed=0, dtype=torch.float32):
    tokens = _tokens(3, 45, seed, short_docs=True)
    layout = build_host_layout(tokens, 0, 8, 3, [depth], L, torch.tensor([5, 6, 7]))
    win = layout.for_depth(depth)
    ref = WindowLayout.build(DocumentLayout.from_tokens(tokens, 0), depth, 8, 3)
    states = torch.randn(3 * 45, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return layout, win, ref, states


def _values_and_grads(fn, *leaves, weights_seed=9):
    """``fn(*leaves)`` (a tensor or tuple) and the gradients of a random projection of it."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(weights_seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs if o.is_floating_point())
    loss.backward()
    return [o.detach() for o in outs], [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]


def _plain_summaries(ref, states, depth_vector):
    """The router's summaries as their definition, one window at a time (docs/model.md, "Router"):
    ``r_0 = (e + s_first) / 2``, ``r_k`` the mean of the document's earlier window means."""
    means = [
        states[int(f) : int(f) + int(n)].float().mean(0) for f, n in zip(ref.window_first_token, ref.window_length)
    ]
    out = []
    for j in range(ref.num_windows):
        k = int(ref.window_ordinal[j])
        if k == 0:
            out.append(0.5 * (depth_vector.float() + states[int(ref.window_first_token[j])].float()))
        else:
            out.append(torch.stack(means[j - k : j]).sum(0) / k)
    return torch.stack(means), torch.stack(out)


def test_router_inputs_summaries_and_choice_equal_the_plain_definition():
    from megatron_lol.model import router as ref_router
    from megatron_lol.model import static_routing as sr
    from megatron_lol.model.core import ForcedPath

    layout, win, ref, states = _depth_case()
    n = ref.num_windows
    depth_vector = torch.randn(16)
    with OpCounter() as count:
        (means, first), g_new = _values_and_grads(lambda x: tuple(t[:n] for t in sr.window_inputs(win, x)), states)
        (summ,), gs_new = _values_and_grads(lambda x, e: sr.router_summaries(win, x, e)[:n], states, depth_vector)
    assert count.syncs == 0, count.sync_names
    (means_r,), g_ref = _values_and_grads(lambda x: _plain_summaries(ref, x, depth_vector)[0], states)
    torch.testing.assert_close(means, means_r, **TOL)
    torch.testing.assert_close(first, states.index_select(0, ref.window_first_token), rtol=0, atol=0)
    (summ_r,), gs_ref = _values_and_grads(lambda x, e: _plain_summaries(ref, x, e)[1], states, depth_vector)
    torch.testing.assert_close(summ, summ_r, **TOL)
    torch.testing.assert_close(gs_new[0], gs_ref[0], **TOL)
    torch.testing.assert_close(gs_new[1], gs_ref[1], **TOL)

    router = ref_router.WindowRouter(16, 4).train()
    with torch.no_grad():
        router.logits.weight.normal_(generator=torch.Generator().manual_seed(3))
    bias = torch.tensor([0.0, 0.05, -0.02, 0.0])
    eps_ref = ref_router.window_noise(ref, torch.tensor([5, 6, 7]), 2, 4, 45)
    forced = ForcedPath(ids=torch.tensor([[-1, 2, -1], [3, -1, 1]]), gates=torch.tensor([[0.0, 0.5, 0], [0.7, 0, 0.2]]))
    new = sr.decide(router, sr.router_summaries(win, states, depth_vector), layout.noise[2], bias, forced, 2, win)
    probs = router.probabilities(summ_r.detach(), eps_ref)
    biased = probs + bias
    ids_r = forced.ids[1]
    torch.testing.assert_close(new.probs[:n], probs, **TOL)
    for j in range(n):
        k = min(int(ref.window_ordinal[j]), 2)
        forced_id = int(ids_r[k]) if int(ref.window_ordinal[j]) < 3 else -1
        want = forced_id if forced_id >= 0 else int(torch.argmax(biased[j]))
        assert int(new.choice[j]) == want, j
        want_gate = float(forced.gates[1][k]) if forced_id >= 0 else float(probs[j, want])
        assert abs(float(new.gate[j]) - want_gate) < 1e-6, j


def _plain_losses(ref, probs, choice, L):
    """Both balancing losses as their definition (docs/model.md, "Load balancing"), per document."""
    seq = 0.0
    for d in range(ref.num_docs):
        sel = ref.window_doc == d
        f = torch.bincount(choice[sel], minlength=L).float() / sel.sum()
        seq = seq + L * (f * probs[sel].mean(0)).sum()
    f = torch.bincount(choice, minlength=L).float() / choice.numel()
    return seq, L * (f * probs.mean(0)).sum()


def test_grouping_combine_loads_and_losses_equal_the_plain_definition():
    from megatron_lol.model import static_routing as sr
    from megatron_lol.model.router import RoutingDecision

    L = 4
    layout, win, ref, states = _depth_case(L=L)
    n, C, t = ref.num_windows, layout.capacity, states.shape[0]
    g = torch.Generator().manual_seed(4)
    choice = torch.randint(0, L - 1, (C,), generator=g)  # block L-1 unused: an empty group
    logits = torch.randn(C, L, generator=g)
    token_choice = choice.index_select(0, win.token_window)
    with OpCounter() as count:
        grouping = sr.group_tokens(token_choice, win.token_window, L)
        loads = sr.window_loads(win, choice, L)
    order = torch.sort(token_choice, stable=True).indices
    assert torch.equal(grouping.order, order) and torch.equal(grouping.segments, ref.token_window[order])
    assert torch.equal(grouping.group_offsets.diff(), torch.bincount(token_choice, minlength=L))
    assert torch.equal(grouping.order.index_select(0, grouping.inverse), torch.arange(t))
    assert torch.equal(loads, torch.bincount(choice[:n], minlength=L)) and int(loads[L - 1]) == 0

    # gated combine through the grouped order, with and without truncated backprop
    out_w = torch.randn(t, 16, generator=g)
    for first_window in (None, True, False):

        def new(x, gate_w):
            gate = sr.token_gates(win, gate_w)
            block_out = sr.permute_rows(
                sr.permute_rows(x, grouping.order, grouping.inverse) * 1.5 + out_w.index_select(0, grouping.order),
                grouping.inverse,
                grouping.order,
            )
            keep = None if first_window is None else sr.truncation_keep(win, first_window)
            if first_window is False:
                with torch.no_grad():
                    update = gate.unsqueeze(1) * (block_out - x)
                return x + update
            return sr.gated_combine(x, block_out, gate, keep)

        def plain(x, gate_w):  # s + alpha (E(s) - s) per token, constants where truncated
            gate = gate_w.index_select(0, ref.token_window).unsqueeze(1)
            update = x * 1.5 + out_w - x
            if first_window is None:
                return x + gate * update
            keep = (ref.window_ordinal.index_select(0, ref.token_window) == 0).unsqueeze(1)
            if not first_window:
                keep = torch.zeros_like(keep)
            return x + torch.where(keep, gate * update, (gate * update).detach())

        gates = torch.rand(C, generator=g)
        with OpCounter() as count_c:
            (v_new,), g_new = _values_and_grads(new, states, gates)
        (v_old,), g_old = _values_and_grads(lambda x, gw: plain(x, gw[:n]), states, gates)
        assert count_c.syncs == 0, count_c.sync_names
        torch.testing.assert_close(v_new, v_old, **TOL)
        torch.testing.assert_close(g_new[0], g_old[0], **TOL)
        torch.testing.assert_close(g_new[1], g_old[1], **TOL)
        assert bool((g_new[1][n:] == 0).all())

    # balancing losses: values and the router probabilities' gradients
    def seq_new(lg):
        decision = RoutingDecision(probs=torch.softmax(lg, -1), choice=choice, gate=None)
        return sr.sequence_aux_loss(win, decision), sr.global_aux_loss(win, decision)

    with OpCounter() as count_l:
        v_new, g_new = _values_and_grads(seq_new, logits)
    v_old, g_old = _values_and_grads(lambda lg: _plain_losses(ref, torch.softmax(lg[:n], -1), choice[:n], L), logits)
    assert count.syncs == 0 and count_l.syncs == 0, (count.sync_names, count_l.sync_names)
    torch.testing.assert_close(v_new, v_old, **TOL)
    torch.testing.assert_close(g_new[0], g_old[0], **TOL)
    assert bool((g_new[0][n:] == 0).all())


# ---------------------------------------------------------------- the grouped routed core
def _lol(monkeypatch, packed=False, routed_core="auto", **model):
    from conftest import ensure_megatron

    from megatron_lol.config.schema import ParallelConfig

    monkeypatch.setenv("MEGATRON_LOL_CPU_BACKEND", "0")  # the reference: per-block layer calls
    ensure_megatron()
    torch.set_num_threads(1)
    return _build_lol(packed, ParallelConfig(routed_core=routed_core), **model)


def _build_lol(packed, parallel, vocab=97, **model):
    from conftest import tiny_config

    from megatron_lol.model.lol_model import LoLGPTModel

    net = LoLGPTModel(tiny_config(**model), vocab, 0, parallel=parallel, init_seed=3, packed_sequences=packed)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # routes spread over the blocks (zero-initialised routers tie everywhere)
        for router in net.core.routers:
            router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen))
    return net


def _use(net, impl):
    """Give the core the executor ``impl`` names (``grouped``: the grouped GEMMs; else per-block calls)."""
    from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls

    net.core.executor = GroupedGEMMs() if impl == "grouped" else PerBlockCalls()


def _run_core(net, impl, x0, layout, seeds, forced, backprop_depth, first_window, record):
    """One forward and backward of the core with executor ``impl``: ``grouped`` given the host layout,
    the per-block calls given only the seeds (the core builds its layout from the documents)."""
    core = net.core
    _use(net, impl)
    core.zero_grad(set_to_none=True)
    if core.balancer is not None:
        core.balancer.loads.zero_()
    steps = core.plan.steps()
    x = x0.clone().requires_grad_(True)
    rope = net.rotary(layout.row_length)
    with OpCounter() as count:
        if impl == "grouped":
            out = core(
                x,
                layout.document_layout(),
                rope,
                steps,
                depth=len(steps),
                forced_path=forced,
                record=record,
                backprop_depth=backprop_depth,
                first_window_full_backprop=first_window,
                layout=layout,
            )
        else:
            out = core(
                x,
                layout.document_layout(),
                rope,
                steps,
                depth=len(steps),
                forced_path=forced,
                record=record,
                backprop_depth=backprop_depth,
                first_window_full_backprop=first_window,
                noise_seeds=seeds,
            )
        loss = (out.states * torch.randn(out.states.shape, generator=torch.Generator().manual_seed(8))).sum()
        if out.aux_loss is not None:
            loss = loss + 100 * out.aux_loss
        if torch.is_grad_enabled():
            loss.backward()
    grads = {name: p.grad for name, p in core.named_parameters() if p.grad is not None}
    loads = core.balancer.loads.clone() if core.balancer is not None else None
    return out, x.grad, grads, loads, count


CASES = {
    # local layout; FiLM per depth, input injection, per-depth bias, forced ordinals, truncated with first windows
    "local-film-injection-forced-truncated": dict(
        packed=False,
        model=dict(film="depth", input_injection=True, per_depth_bias=True, seq_aux_loss_coeff=0.01),
        forced="ordinal",
        backprop_depth=2,
        first_window=True,
    ),
    # packed (THD) layout; FiLM per block, GQA, global aux loss, untied routers, forced per document, frozen depths
    "packed-filmblock-gqa-auxloss-forced-frozen": dict(
        packed=True,
        model=dict(film="depth_block", num_query_groups=2, balancing="aux_loss", router_tied=False),
        forced="document",
        backprop_depth=1,
        first_window=False,
    ),
    # evaluation: no noise, routing records
    "local-eval-records": dict(packed=False, model=dict(routed_depth=3), train=False, record=True),
    # PyTorch's fused attention (SDPA), as both paths run it off the CPU, forced here
    "packed-fused-attention": dict(packed=True, model=dict(film="depth"), fused_attention=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_core_equals_the_per_block_reference(monkeypatch, case):
    from megatron_lol.model.core import ForcedPath
    from megatron_lol.model.grouped_core import grouped_core_support

    spec = CASES[case]
    net = _lol(monkeypatch, spec["packed"], **spec["model"])
    core = net.core.train(spec.get("train", True))
    flex_calls = []
    if spec.get("fused_attention"):  # the GPU's attention algorithm (FlexAttention block masks) on the CPU
        from megatron_lol.model import flex_masks
        from megatron_lol.model.attention import SegmentCausalAttention

        monkeypatch.setattr(SegmentCausalAttention, "fused", True)
        real_flex = flex_masks.flex_segment_attention
        monkeypatch.setattr(flex_masks, "flex_segment_attention", lambda *a: flex_calls.append(1) or real_flex(*a))
    assert grouped_core_support(core) is None
    b, s, h, L, D = 2, 40, net.cfg.hidden_size, core.plan.num_stored_blocks, core.plan.depth
    tokens = _tokens(b, s, 11, short_docs=True)
    seeds = torch.tensor([21, 22])
    layout = build_host_layout(
        tokens, 0, net.cfg.plan.windows.size, net.cfg.plan.windows.shift, range(1, D + 1), L, seeds
    )
    forced = None
    if spec.get("forced") == "ordinal":
        ids = torch.full((D, 6), -1)
        ids[0, 1], ids[2, 0], ids[3, 2] = 2, 1, 0
        forced = ForcedPath(ids=ids, gates=torch.full((D, 6), 0.75))
    elif spec.get("forced") == "document":
        ids = torch.full((D, layout.num_docs, 6), -1)
        ids[1, 0, 1], ids[0, 2, 0] = 1, 2
        forced = ForcedPath(ids=ids, gates=torch.full((D, layout.num_docs, 6), 0.5))
    x0 = torch.randn(s, b, h, generator=torch.Generator().manual_seed(5))
    if spec["packed"]:
        x0 = x0.transpose(0, 1).reshape(b * s, 1, h)
    args = (
        x0,
        layout,
        seeds,
        forced,
        spec.get("backprop_depth"),
        spec.get("first_window", True),
        spec.get("record", False),
    )
    with torch.set_grad_enabled(spec.get("train", True)):
        ref, ref_dx, ref_grads, ref_loads, _ = _run_core(net, "ref", *args)
        ref_flex_calls = len(flex_calls)
        new, new_dx, new_grads, new_loads, count = _run_core(net, "grouped", *args)
    assert count.syncs == 0, count.sync_names  # block masks included
    if spec.get("fused_attention"):  # the grouped attention went through FlexAttention, once per routed depth
        assert ref_flex_calls > 0 and len(flex_calls) - ref_flex_calls == D, (ref_flex_calls, len(flex_calls))
    torch.testing.assert_close(new.states, ref.states, **TOL)
    assert torch.equal(new.block_loads, ref.block_loads)
    assert int((ref.block_loads > 0).sum(dim=1).min()) > 1, "every depth should use several blocks"
    if ref_loads is not None:
        assert torch.equal(new_loads, ref_loads)
    if ref.aux_loss is not None:
        torch.testing.assert_close(new.aux_loss, ref.aux_loss, **TOL)
    for r_ref, r_new in zip(ref.records, new.records, strict=True):
        assert torch.equal(r_new.choice, r_ref.choice) and torch.equal(r_new.window_ordinal, r_ref.window_ordinal)
        torch.testing.assert_close(r_new.probs, r_ref.probs, **TOL)
        torch.testing.assert_close(r_new.gate, r_ref.gate, **TOL)
    if spec.get("train", True):
        torch.testing.assert_close(new_dx, ref_dx, **TOL)
        assert set(new_grads) == set(ref_grads)
        for name in ref_grads:
            torch.testing.assert_close(new_grads[name], ref_grads[name], **TOL, msg=name)


def test_model_with_the_grouped_core_equals_the_reference_model(monkeypatch):
    """The whole model (prelude, core, coda, loss) with the grouped core and the host layout's documents."""
    net = _lol(monkeypatch, False, film="depth").train()
    b, s = 2, 40
    tokens = _tokens(b, s, 12)
    labels = torch.roll(tokens, -1, dims=1)
    seeds = torch.tensor([3, 4])
    layout = build_host_layout(tokens, 0, 8, 4, range(1, net.plan.depth + 1), net.plan.num_stored_blocks, seeds)

    results = []
    for impl in ("ref", "grouped"):
        net.zero_grad(set_to_none=True)
        _use(net, impl)
        grouped = {"layout": layout} if impl == "grouped" else {"docs": layout.document_layout()}
        loss, core = net(tokens, labels=labels, noise_seeds=seeds, return_core=True, **grouped)
        loss.mean().backward()
        results.append((loss.detach(), core.block_loads, {n: p.grad for n, p in net.named_parameters()}))
    (loss_r, loads_r, grads_r), (loss_g, loads_g, grads_g) = results
    torch.testing.assert_close(loss_g, loss_r, **TOL)
    assert torch.equal(loads_g, loads_r)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_g[name], grad, **TOL, msg=name)
    # a broadcast gradient (loss = states.sum()) reaches the grouped GEMMs with zero strides
    x = torch.randn(s, b, net.cfg.hidden_size, requires_grad=True)
    out = net.core(x, layout.document_layout(), net.rotary(s), net.plan.steps(), depth=net.plan.depth, layout=layout)
    out.states.sum().backward()
    assert bool(torch.isfinite(x.grad).all())


def test_the_executor_is_chosen_when_the_core_is_built(monkeypatch):
    """``parallel.routed_core``: ``grouped`` builds the grouped GEMMs' executor, ``auto`` on the CPU and
    ``reference`` the per-block calls, and a forward runs the executor the core holds, layout or not."""
    from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls

    assert isinstance(_lol(monkeypatch, False).core.executor, PerBlockCalls)  # auto, on the CPU
    net = _lol(monkeypatch, False, routed_core="grouped").eval()
    assert isinstance(net.core.executor, GroupedGEMMs) and net.core.grouped_refusal is None
    ran = []

    class Spy(GroupedGEMMs):
        def run(self, *args, **kwargs):
            ran.append(args[1].depth)
            return super().run(*args, **kwargs)

    net.core.executor = Spy()
    tokens = _tokens(2, 40, 12)
    depths = list(range(1, net.plan.depth + 1))
    layout = build_host_layout(tokens, 0, 8, 4, depths, net.plan.num_stored_blocks)
    with torch.no_grad():
        grouped = net(tokens, layout=layout)
        assert ran == depths
        ran.clear()
        without = net(tokens)  # the core builds the layout from the documents
        assert ran == depths
        _use(net, "ref")
        reference = net(tokens, layout=layout)
    assert ran == depths
    torch.testing.assert_close(grouped, reference, **TOL)
    torch.testing.assert_close(without, grouped, rtol=0, atol=0)


def _tensor_parallel_check():
    """Rank side of the TP=2 (+SP) test: grouped vs reference core per layout, and the collectives each makes."""
    import os

    import torch.distributed as dist
    from distributed import model_parallel

    from megatron_lol.config.schema import ParallelConfig
    from megatron_lol.model.grouped_core import grouped_core_support

    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"
    results = {}
    with model_parallel(tp=2, seed=1):
        for packed in (False, True):
            net = _build_lol(
                packed,
                ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                vocab=98,
                film="depth_block",
                input_injection=True,
                num_query_groups=2,
            ).train()
            assert grouped_core_support(net.core) is None
            b, s, h, D = 2, 40, net.cfg.hidden_size, net.plan.depth
            tokens = _tokens(b, s, 13, short_docs=True)
            seeds = torch.tensor([1, 2])
            layout = build_host_layout(tokens, 0, 8, 4, range(1, D + 1), net.plan.num_stored_blocks, seeds)
            x0 = torch.randn(s, b, h, generator=torch.Generator().manual_seed(5))
            if packed:
                x0 = x0.transpose(0, 1).reshape(b * s, 1, h)
            runs = {}
            for impl in ("ref", "grouped"):
                calls = []
                real = dist.all_reduce

                def counting(tensor, *args, **kwargs):
                    calls.append(tuple(tensor.shape))
                    return real(tensor, *args, **kwargs)

                dist.all_reduce = counting
                try:
                    runs[impl] = _run_core(net, impl, x0, layout, seeds, None, 2, True, False)[:4] + (len(calls),)
                finally:
                    dist.all_reduce = real
            ref, ref_dx, ref_grads, _, ref_calls = runs["ref"]
            new, new_dx, new_grads, _, new_calls = runs["grouped"]
            worst = max(
                [(new.states - ref.states).abs().max().item(), (new_dx - ref_dx).abs().max().item()]
                + [(new_grads[k] - g).abs().max().item() for k, g in ref_grads.items()]
            )
            results[packed] = dict(
                worst=worst,
                same_params=set(new_grads) == set(ref_grads),
                ref_calls=ref_calls,
                new_calls=new_calls,
                depths=D,
                blocks_used=int((ref.block_loads > 0).sum()),
            )
    return results


@pytest.mark.multiprocess
def test_grouped_core_under_tensor_parallelism_matches_with_one_collective_per_projection():
    from distributed import run_distributed

    for rank in run_distributed(_tensor_parallel_check, 2, timeout=300):
        for packed, r in rank.items():
            assert r["same_params"] and r["worst"] < 1e-6, (packed, r)
            # row-parallel outputs (proj, fc2) forward and column-parallel input gradients (qkv, fc1)
            # backward: 4 all-reduces per depth, whatever the number of blocks the depth used (the
            # reference: 4 per block call and more at truncated depths, whose frozen windows run apart)
            assert r["new_calls"] == 4 * r["depths"], (packed, r)
            assert r["ref_calls"] >= 4 * r["blocks_used"] > r["new_calls"], (packed, r)


def _expert_parallel_check():
    """Rank side of the EP=2 test: one process's core (whole library), the per-block reference under
    expert parallelism and the grouped core under it, on this rank's own tokens, in both layouts."""
    import os

    import torch.distributed as dist
    from distributed import model_parallel

    from megatron_lol.config.schema import ParallelConfig
    from megatron_lol.model.core import ForcedPath
    from megatron_lol.model.grouped_core import grouped_core_support

    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"
    rank = dist.get_rank()
    model = dict(num_blocks=4, film="depth_block", input_injection=True, num_query_groups=2)
    results = {}
    # the third case sends every window to block 0: rank 1 receives nothing at any depth
    for case, packed, first_window in (("local", False, True), ("packed", True, False), ("all-to-0", False, True)):
        b, s = 2, 40
        tokens = _tokens(b, s, 30 + rank, short_docs=True)
        seeds = torch.tensor([1 + 2 * rank, 2 + 2 * rank])
        forced = None
        if case == "all-to-0":
            forced = ForcedPath(ids=torch.zeros(4, 8, dtype=torch.long), gates=torch.full((4, 8), 0.5))
        runs = {}
        for impl, ep in (("single", 1), ("ref", 2), ("grouped", 2)):
            with model_parallel(ep=ep, seed=1):
                parallel = ParallelConfig(expert_model_parallel_size=ep)
                net = _build_lol(packed, parallel, vocab=98, **model).train()
                h, D, L = net.cfg.hidden_size, net.plan.depth, net.plan.num_stored_blocks
                layout = build_host_layout(tokens, 0, 8, 4, range(1, D + 1), L, seeds)
                x0 = torch.randn(s, b, h, generator=torch.Generator().manual_seed(5 + rank))
                if packed:
                    x0 = x0.transpose(0, 1).reshape(b * s, 1, h)
                if impl == "grouped":
                    assert grouped_core_support(net.core) is None
                out, dx, grads, _, count = _run_core(
                    net, "ref" if impl == "single" else impl, x0, layout, seeds, forced, 2, first_window, False
                )
                # the data-parallel sum every replicated parameter's gradient gets (a block's: over the
                # ranks holding it, so all ranks for one process, itself alone under expert parallelism)
                # (every parameter, zero where this rank computed no gradient: the ranks' calls must match)
                summed = {}
                for name, p in sorted(net.core.named_parameters()):
                    g = grads[name].clone() if name in grads else torch.zeros_like(p)
                    if ep == 1 or not name.startswith("blocks."):
                        dist.all_reduce(g)
                    summed[name] = g
                runs[impl] = dict(
                    states=out.states.detach(),
                    dx=dx,
                    grads=grads,
                    summed=summed,
                    loads=out.block_loads,
                    syncs=dict(count.sync_names),
                    blocks=net.core.local_block_ids(),
                )
        single, ref, new = runs["single"], runs["ref"], runs["grouped"]

        def nonzero(run):
            return {k for k, g in run["grads"].items() if bool(g.abs().sum() > 0)}

        def worst(a, b):
            diffs = [(a["states"] - b["states"]).abs().max(), (a["dx"] - b["dx"]).abs().max()]
            diffs += [(a["summed"][k] - b["summed"][k]).abs().max() for k in a["summed"]]
            return float(max(diffs))

        results[case] = dict(
            blocks=new["blocks"],
            same_loads=torch.equal(new["loads"], ref["loads"]) and torch.equal(ref["loads"], single["loads"]),
            used=int((new["loads"] > 0).sum()),
            # per rank, unsummed: the same blocks' gradients from the same exchange
            grouped_vs_ref=max(
                worst(new, ref), *(float((new["grads"][k] - g).abs().max()) for k, g in ref["grads"].items())
            ),
            ref_vs_single=worst(ref, single),
            grouped_vs_single=worst(new, single),
            # the parameters that got a gradient (the grouped GEMMs give a block that got no rows a zero one)
            same_params=nonzero(new) == nonzero(ref) and nonzero(ref) <= nonzero(single) and bool(nonzero(ref)),
            grouped_syncs=new["syncs"],
            depths=D,
        )
    return results


@pytest.mark.multiprocess
def test_grouped_core_under_expert_parallelism_equals_the_reference_and_one_process():
    """EP=2, each rank holding half of the library: the grouped depth (one exchange per depth, the ranks'
    blocks as one grouped computation) equals the per-block expert-parallel reference and one process
    holding the whole library, in the local and the packed layout (positions in the window: the
    per-token RoPE through the exchange), with truncated backprop (first windows kept / all frozen), and
    with every window forced to block 0 (rank 1 receives nothing and still takes part in every exchange).
    The only host read is the exchange's split sizes, once per depth."""
    from distributed import run_distributed

    results = run_distributed(_expert_parallel_check, 2, timeout=240)  # a hang fails the test
    assert [r["local"]["blocks"] for r in results] == [[0, 1], [2, 3]]
    for rank, by_layout in enumerate(results):
        for case, r in by_layout.items():
            assert r["same_loads"] and r["same_params"], (rank, case, r)
            assert r["used"] == r["depths"] if case == "all-to-0" else r["used"] > r["depths"], (rank, case, r)
            worst = max(r["grouped_vs_ref"], r["ref_vs_single"], r["grouped_vs_single"])
            assert worst < 1e-6, (rank, case, r)
            assert r["grouped_syncs"] == {"tolist": r["depths"]}, (rank, case, r)


def _tensor_and_expert_parallel_check():
    """Rank side of the TP=2 (+SP) x EP=2 test: grouped vs the per-block reference, both layouts."""
    import os

    from distributed import model_parallel
    from megatron.core import parallel_state

    from megatron_lol.config.schema import ParallelConfig
    from megatron_lol.model.grouped_core import grouped_core_support

    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"
    results = {}
    with model_parallel(tp=2, ep=2, seed=1):
        dp = parallel_state.get_data_parallel_rank()  # the two TP ranks of a TP group share their tokens
        parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True)
        for packed in (False, True):
            net = _build_lol(packed, parallel, vocab=98, num_blocks=4, film="depth_block", num_query_groups=2).train()
            D, L, h = net.plan.depth, net.plan.num_stored_blocks, net.cfg.hidden_size
            tokens = _tokens(2, 40, 30 + dp, short_docs=True)
            seeds = torch.tensor([1 + 2 * dp, 2 + 2 * dp])
            layout = build_host_layout(tokens, 0, 8, 4, range(1, D + 1), L, seeds)
            x0 = torch.randn(40, 2, h, generator=torch.Generator().manual_seed(5 + dp))
            if packed:
                x0 = x0.transpose(0, 1).reshape(80, 1, h)
            runs = {impl: _run_core(net, impl, x0, layout, seeds, None, 2, True, False) for impl in ("ref", "grouped")}
            (ref, ref_dx, ref_grads, _, _), (new, new_dx, new_grads, _, count) = runs["ref"], runs["grouped"]
            results[packed] = dict(
                support=grouped_core_support(net.core),
                blocks=net.core.local_block_ids(),
                same_params=set(new_grads) == set(ref_grads),
                worst=max(
                    [float((new.states - ref.states).abs().max()), float((new_dx - ref_dx).abs().max())]
                    + [float((new_grads[k] - g).abs().max()) for k, g in ref_grads.items()]
                ),
                syncs=dict(count.sync_names),
                depths=D,
            )
    return results


@pytest.mark.multiprocess
def test_grouped_core_under_tensor_and_expert_parallelism_equals_the_reference():
    """TP=2 with SP inside EP=2 (4 ranks): the exchange between EP peers of one TP rank, then the grouped
    projections' TP collectives, equal the per-block reference in both layouts; one read per depth."""
    from distributed import run_distributed

    results = run_distributed(_tensor_and_expert_parallel_check, 4, timeout=400)
    assert sorted(tuple(r[False]["blocks"]) for r in results) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for rank, by_layout in enumerate(results):
        for packed, r in by_layout.items():
            assert r["support"] is None and r["same_params"] and r["worst"] < 1e-6, (rank, packed, r)
            assert r["syncs"] == {"tolist": r["depths"]}, (rank, packed, r)


def test_routed_depth_compiles_with_fullgraph(monkeypatch):
    """A depth's routing, grouping and combine are each one graph: no data-dependent shape, no host
    read. ``aot_eager`` traces forward and backward without code generation (cheap). The grouped
    blocks compile in bf16 (torch's meta function of ``_grouped_mm`` takes bf16 only, so fp32, which
    the CPU kernel runs, cannot be traced)."""
    from megatron_lol.model import static_routing as sr
    from megatron_lol.model.attention import window_mask
    from megatron_lol.model.grouped_blocks import RowRope, grouped_blocks, part_rows, stack_library

    net = _lol(monkeypatch, False, film="depth_block").train()
    core = net.core
    L, depth = core.plan.num_stored_blocks, 2
    layout = build_host_layout(_tokens(2, 40, 14, short_docs=True), 0, 8, 4, [depth], L, torch.tensor([1, 2]))
    windows = layout.for_depth(depth)
    rope_table = net.rotary(40)
    positions = torch.arange(80) % 40
    step = core.plan.step(depth)
    per_block = [core.step_hooks(step, b) for b in range(L)]  # FiLM per (depth, block)
    library = stack_library([core.block(i) for i in range(L)])

    def route(flat, depth_vector, eps, bias):
        decision = sr.decide(core.routers[0], sr.router_summaries(windows, flat, depth_vector), eps, bias)
        grouping = sr.group_tokens(decision.choice.index_select(0, windows.token_window), windows.token_window, L)
        rope = RowRope.from_table(rope_table, positions.index_select(0, grouping.order), flat.dtype)
        grouped = dict(
            grouping=grouping,
            rows=sr.permute_rows(flat, grouping.order, grouping.inverse),
            gate=sr.token_gates(windows, decision.gate),
            rope=rope,
            attention_bias=window_mask(grouping.segments, 8),
        )
        aux = sr.sequence_aux_loss(windows, decision)
        return grouped, sr.window_loads(windows, decision.choice.detach(), L), aux

    def combine(flat, grouped_out, grouped):
        grouping = grouped["grouping"]
        block_out = sr.permute_rows(grouped_out, grouping.inverse, grouping.order)
        return sr.gated_combine(flat, block_out, grouped["gate"], sr.truncation_keep(windows, True))

    x = torch.randn(80, net.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    args = (core.depth_vectors[depth - 1], layout.noise[depth], core.balancer.for_depth(depth))
    torch._dynamo.reset()
    compiled = (
        torch.compile(route, fullgraph=True, backend="aot_eager"),
        torch.compile(combine, fullgraph=True, backend="aot_eager"),
    )
    outs = []
    for run_route, run_combine in ((route, combine), compiled):
        leaf = x.clone().requires_grad_(True)
        grouped, loads, aux = run_route(leaf, *args)
        new = run_combine(
            leaf,
            grouped_blocks(
                library,
                grouped["rows"],
                grouped["grouping"],
                grouped["rope"],
                grouped["attention_bias"],
                8,
                part_rows(per_block, grouped["grouping"], core.cfg),
            ),
            grouped,
        )
        (new.square().sum() + aux).backward()
        outs.append((new.detach(), loads, aux.detach(), leaf.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(
            got, want, rtol=0, atol=0
        ) if not got.is_floating_point() else torch.testing.assert_close(got, want, **TOL)

    # the grouped blocks, in bf16
    bf16 = stack_library([core.block(i).to(torch.bfloat16) for i in range(L)])
    with torch.no_grad():
        grouped, _, _ = route(x, *args)
    rows = grouped["rows"].to(torch.bfloat16)
    rows_rope = RowRope(cos=grouped["rope"].cos.to(torch.bfloat16), sin=grouped["rope"].sin.to(torch.bfloat16))
    run = lambda r: grouped_blocks(bf16, r, grouped["grouping"], rows_rope, grouped["attention_bias"], 8)  # noqa: E731
    want = run(rows)
    got = torch.compile(run, fullgraph=True, backend="aot_eager")(rows)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)


def test_the_whole_grouped_core_compiles_as_one_graph(monkeypatch):
    """Every routed depth of a forward (injection, FiLM per block, truncated backprop, the balancing terms)
    given the host layout: one ``torch.compile(fullgraph=True)`` graph, forward and backward, with the eager
    values (BF16: torch's meta function of ``_grouped_mm`` takes BF16 only). Static shapes: nothing in the
    core depends on the routes' values."""
    net = _lol(monkeypatch, True, num_blocks=4, params_dtype="bf16", film="depth_block", input_injection=True).train()
    _use(net, "grouped")
    layout = build_host_layout(_tokens(2, 40, 3), 0, 8, 4, range(1, 5), 4, torch.tensor([1, 2]))
    rope, steps = net.rotary(40), net.core.plan.steps()

    def core(x):
        out = net.core(x, layout.document_layout(), rope, steps, depth=4, backprop_depth=2, layout=layout)
        return out.states, out.aux_loss

    x0 = torch.randn(80, 1, net.cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    torch._dynamo.reset()
    runs = []
    for fn in (core, torch.compile(core, fullgraph=True, backend="aot_eager")):
        net.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        states, aux = fn(x)
        (states.float().square().sum() + aux).backward()
        runs.append([states, x.grad] + [p.grad for p in net.core.parameters() if p.grad is not None])
    torch._dynamo.reset()
    assert len(runs[0]) == len(runs[1]) > 10
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got.float(), want.float(), **TOL)


# ------------------------------------------------------------------ the trainer builds the layout
def _grouped_trainer(routed_core: str, parallel=None, **model):
    from test_parallel_lol import SEQ, SyntheticTokens, TinyTokenizer

    from megatron_lol.config import config_from_dict
    from megatron_lol.training.trainer import Trainer

    shape = dict(num_blocks=3, routed_depth=3, film="depth")
    shape.update(model)
    cfg = config_from_dict(
        {
            "model": dict(
                hidden_size=32,
                num_attention_heads=4,
                ffn_hidden_size=64,
                n_prelude=1,
                n_coda=1,
                window_size=8,
                window_shift=4,
                vocab_size=128,
                **{k: v for k, v in shape.items() if v is not None},
            ),
            "training": {
                "train_iters": 3,
                "micro_batch_size": 2,
                "global_batch_size": 4,
                "seq_length": SEQ,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 7,
            },
            "optimizer": {"lr": 1e-2, "min_lr": 1e-3, "lr_warmup_iters": 0},
            "parallel": {**(parallel or {}), "routed_core": routed_core},
        }
    )
    return Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(16, 0), None, None)).setup()


def test_training_with_the_grouped_core_equals_the_reference(megatron_env, monkeypatch):
    """parallel.routed_core: grouped trains with the per-block executor's losses, both on the layouts the trainer
    builds on the host (router noise included: drawn from the samples' seeds); auto runs per block on CPU."""
    monkeypatch.setenv("MEGATRON_LOL_CPU_BACKEND", "0")  # the reference: per-block layer calls
    losses = {}
    for mode in ("reference", "grouped", "auto"):
        trainer = _grouped_trainer(mode)
        assert trainer.grouped_core == (mode == "grouped")
        batches = trainer.data_iterator(trainer.train_ds, 0)
        assert "layout" in next(trainer.data_iterator(trainer.train_ds, 0))  # every routed plan's batches
        losses[mode] = [trainer.train_step(batches).loss for _ in range(3)]
    torch.testing.assert_close(torch.tensor(losses["grouped"]), torch.tensor(losses["reference"]), rtol=1e-5, atol=1e-5)
    assert losses["auto"] == losses["reference"]


def test_bf16_training_with_the_grouped_core_follows_the_reference(megatron_env, monkeypatch):
    """BF16 weights with FP32 main grads under megatron-core's DDP (fused gradient accumulation): the grouped
    core trains with the reference's losses and gradient norms up to BF16 rounding, its library gradients
    arriving through ``main_grad`` (the BF16 ``.grad`` placeholders are skipped by the DDP)."""
    monkeypatch.setenv("MEGATRON_LOL_CPU_BACKEND", "0")
    runs = {}
    for mode in ("reference", "grouped"):
        trainer = _grouped_trainer(mode, params_dtype="bf16")
        batches = trainer.data_iterator(trainer.train_ds, 0)
        steps = [trainer.train_step(batches) for _ in range(3)]
        weight = trainer.model_chunks[0].module.core.block(0).mlp.linear_fc1.weight
        assert weight.dtype == torch.bfloat16 and weight.main_grad.dtype == torch.float32
        runs[mode] = (torch.tensor([s.loss for s in steps]), torch.tensor([s.grad_norm for s in steps]))
    torch.testing.assert_close(runs["grouped"][0], runs["reference"][0], rtol=2e-2, atol=0)
    torch.testing.assert_close(runs["grouped"][1], runs["reference"][1], rtol=5e-2, atol=0)


def test_grouped_core_refuses_what_it_cannot_run(megatron_env):
    from megatron_lol.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.routed_core: grouped runs routed depths, and plan 'dense'"):
        _grouped_trainer("grouped", plan="dense", core_layers=2, num_blocks=None, routed_depth=None, film=None)
    with pytest.raises(ConfigError, match=r"parallel.routed_core: grouped cannot run this model: .*(MoE|expert)"):
        _grouped_trainer("grouped", moe_layers="all", num_experts=2, moe_ffn_hidden_size=16)


def _train_both(parallel: dict, **model) -> dict:
    """Rank side: three trainer steps with ``parallel.routed_core: reference``, then ``grouped`` (one launch)."""
    import os

    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"
    out = {}
    for routed_core in ("reference", "grouped"):
        trainer = _grouped_trainer(routed_core, parallel, num_blocks=4, routed_depth=4, **model)
        batches = trainer.data_iterator(trainer.train_ds, 0)
        steps = [trainer.train_step(batches) for _ in range(3)]
        out[routed_core] = dict(
            grouped=trainer.grouped_core,
            loss=[s.loss for s in steps],
            grad_norm=[s.grad_norm for s in steps],
            blocks=trainer.model_chunks[0].module.core.local_block_ids(),
        )
    return out


@pytest.mark.multiprocess
def test_training_with_the_grouped_core_under_expert_parallelism_equals_the_reference():
    """EP=2 through the trainer (host layouts, megatron-core's DDP with the library sharded like experts):
    three steps of the grouped core have the reference's losses and gradient norms."""
    from distributed import run_distributed

    runs = run_distributed(_train_both, 2, {"expert_model_parallel_size": 2}, timeout=400)
    assert [run["grouped"]["blocks"] for run in runs] == [[0, 1], [2, 3]]
    for r, n in ((run["reference"], run["grouped"]) for run in runs):
        assert not r["grouped"] and n["grouped"]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(n[key]), torch.tensor(r[key]), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_training_with_the_grouped_core_under_pipeline_parallelism_equals_the_reference():
    """PP=2 through the trainer: each stage runs its share of the routed depths grouped, from the layout
    built with its micro-batch; three steps with the reference's losses and gradient norms."""
    from distributed import run_distributed

    runs = run_distributed(_train_both, 2, {"pipeline_model_parallel_size": 2}, timeout=400)
    for r, n in ((run["reference"], run["grouped"]) for run in runs):
        assert not r["grouped"] and n["grouped"]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(n[key]), torch.tensor(r[key]), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_bf16_training_with_the_grouped_core_overlaps_the_gradient_reduction():
    """DP=2, BF16, ``--overlap-grad-reduce`` and the distributed optimizer (a Megatron-LM user's GPU flags):
    the grouped core's per-depth gradient placeholders fire megatron-core's DDP hooks D times per block
    weight; the run keeps the reference's losses and gradient norms up to BF16 rounding."""
    from distributed import run_distributed

    flags = {"overlap_grad_reduce": True, "use_distributed_optimizer": True}
    runs = run_distributed(_train_both, 2, flags, params_dtype="bf16", timeout=400)
    for r, n in ((run["reference"], run["grouped"]) for run in runs):
        assert not r["grouped"] and n["grouped"]
        # the first step's gradients come from the same weights: equal up to the BF16 GEMMs' rounding; after
        # updates BF16 differences can flip a near-tied route, so later steps only stay close
        assert n["grad_norm"][0] == pytest.approx(r["grad_norm"][0], rel=1e-3)
        torch.testing.assert_close(torch.tensor(n["loss"]), torch.tensor(r["loss"]), rtol=2e-2, atol=0)
        torch.testing.assert_close(torch.tensor(n["grad_norm"]), torch.tensor(r["grad_norm"]), rtol=5e-2, atol=0)


def test_auto_runs_the_library_grouped_under_the_transformer_engine_spec(monkeypatch):
    """``routed_core: auto`` on CUDA with the Transformer Engine spec: the prelude and coda are TE layers, the
    library is built from the local spec so its routed depths run grouped (``torch._grouped_mm``), with FP8
    (when configured) left to the fixed layers. TE is stood in on the CPU: its layer spec by a subclass of
    the local layer (so the prelude shows which spec built it), CUDA by the build-time flag. The model then
    equals the plain local model run per block, values and gradients."""
    from conftest import ensure_megatron, tiny_config

    import megatron_lol.model.library as library
    import megatron_lol.model.lol_model as lol_model
    from megatron_lol.model.block_call import LoLTransformerLayer
    from megatron_lol.model.grouped_core import grouped_core_support, routes_grouped

    class StandInTELayer(LoLTransformerLayer):
        """The TE spec's layer, stood in (TE does not build on a CPU)."""

    def stand_in_te_spec(num_experts=None, film=False):
        spec = library.block_spec(False, num_experts=num_experts, film=film)
        return dataclasses.replace(spec, module=StandInTELayer)

    monkeypatch.setenv("MEGATRON_LOL_CPU_BACKEND", "0")
    ensure_megatron()
    torch.set_num_threads(1)
    cfg = tiny_config(film="depth_block", routed_depth=3)
    assert routes_grouped(cfg, cuda=True) and not routes_grouped(cfg, cuda=False)
    assert not routes_grouped(cfg, cuda=True, mode="reference")
    assert routes_grouped(tiny_config(router_input="depth"), cuda=True)  # routing is the same for both executors
    assert routes_grouped(tiny_config(router_only_tokens=[90], router_only_filler=89), cuda=True)
    assert routes_grouped(cfg, cuda=False, mode="grouped")
    tconfig = library.transformer_config(cfg)  # the stand-in layers run megatron's unfused RoPE on the CPU

    reference = lol_model.LoLGPTModel(cfg, 97, 0, tconfig=tconfig, init_seed=3, packed_sequences=True)
    monkeypatch.setattr(lol_model, "use_te_for", lambda model: True)
    monkeypatch.setattr(lol_model, "cuda_available", lambda: True)
    monkeypatch.setattr(library, "te_block_spec", stand_in_te_spec)
    net = lol_model.LoLGPTModel(cfg, 97, 0, tconfig=tconfig, init_seed=3)
    assert net.use_te and net.packed and net.grouped_library
    assert all(type(layer) is StandInTELayer for layer in [*net.prelude.values(), *net.coda.values()])
    assert all(type(block) is LoLTransformerLayer for block in net.core.blocks.values())
    assert grouped_core_support(net.core) is None and net.core.executor.grouped, "chosen when the core was built"
    assert not reference.core.executor.grouped
    assert net.core.tconfig.fp8 is None and not net.core.tconfig.apply_rope_fusion

    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        weights = [torch.randn(r.logits.weight.shape, generator=gen) for r in net.core.routers]
        for model in (reference, net):
            for router, w in zip(model.core.routers, weights):
                router.logits.weight.copy_(w)
    tokens = _tokens(2, 40, 5)
    labels = torch.roll(tokens, -1, dims=1)
    seeds = torch.tensor([3, 4])
    layout = build_host_layout(tokens, 0, 8, 4, range(1, 4), net.plan.num_stored_blocks, seeds)
    results = []
    for model, forward in ((reference, {"docs": layout.document_layout()}), (net, {"layout": layout})):
        model.train()
        loss = model(tokens, labels=labels, noise_seeds=seeds, **forward)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_r, grads_r), (loss_g, grads_g) = results
    torch.testing.assert_close(loss_g, loss_r, **TOL)
    assert set(grads_g) == set(grads_r)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_g[name], grad, **TOL, msg=name)


def test_segment_offsets_are_the_thd_offsets_without_a_read():
    """The per-block executor's THD offsets of a block's rows (packed layout): the offsets
    ``thd_params`` finds with a read, then zero-length sequences up to the bound."""
    from megatron_lol.model.library import segment_offsets, thd_params

    g = torch.Generator().manual_seed(2)
    for n, runs in ((1, 1), (17, 5), (40, 40), (64, 9)):
        cuts = torch.sort(torch.randperm(n - 1, generator=g)[: runs - 1] + 1).values
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
        ids = torch.sort(torch.randperm(3 * runs, generator=g)[:runs]).values  # increasing, with gaps
        segments = torch.repeat_interleave(ids, lengths)
        found, _ = thd_params(segments, 8)
        for bound in (runs, runs + 3, n):
            with OpCounter() as count:
                cu = segment_offsets(segments, bound)
            assert count.syncs == 0, count.sync_names
            assert cu.dtype == torch.int32 and cu.shape == (bound + 1,)
            assert torch.equal(cu[: runs + 1], found.cu_seqlens_q) and bool((cu[runs:] == n).all())


@pytest.mark.parametrize("packed", [False, True])
def test_a_forward_given_the_host_layout_builds_none_and_reads_no_documents(monkeypatch, packed):
    """``model(tokens, layout=model.host_layout(tokens))`` (the layout built with the batch, as the
    trainer, evaluation, analysis and the benches do) never reaches the core's fallback, which copies
    the documents to the host; the per-block executor then reads its group sizes, one per depth."""
    from megatron_lol.model.core import Core

    net = _lol(monkeypatch, packed, film="depth").eval()
    tokens = _tokens(2, 40, 21)
    with torch.no_grad(), OpCounter() as fallback:
        expected = net(tokens)
    assert fallback.sync_names["cpu"] >= 2, fallback.sync_names  # positions and document ids to the host

    def no_layout(*args, **kwargs):
        raise AssertionError("the forward built a host layout")

    monkeypatch.setattr(Core, "_layout", no_layout)
    layout = net.host_layout(tokens)
    with torch.no_grad(), OpCounter() as given:
        got = net(tokens, layout=layout)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert dict(given.sync_names) == {"tolist": net.plan.depth}, given.sync_names
