"""LoLGPTModel end to end (docs/model.md): causality, packed documents, grouped dispatch
against a naive per-window loop, path forcing, truncated backprop, FiLM, input injection."""

from __future__ import annotations

import pytest
import torch

from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.core import ForcedPath
from megatron_lol.model.core_steps import RoutedStep
from megatron_lol.model.router import choose_blocks
from megatron_lol.model.windows import DocumentLayout, WindowLayout

V = 97
CAUSAL = dict(window_size=8, window_shift=4, routed_depth=4, num_blocks=3, n_prelude=1, n_coda=1)


def _tokens(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (b, s), generator=g)  # never the EOD id 0


def _forward(model, x, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)  # same router noise in training mode
    return model(x, **kw)


def _block(core, index):
    """Library block ``index`` (blocks may be keyed by global index, see Core.block)."""
    return core.block(index) if hasattr(core, "block") else core.blocks[index]


def _all_blocks(core):
    return list(core.blocks.values()) if isinstance(core.blocks, torch.nn.ModuleDict) else list(core.blocks)


def _blocks_used(core):
    """Blocks any window chose in a forward (its ``CoreOutput``, recorded)."""
    return set(torch.cat([r.choice for r in core.records]).tolist())


# ------------------------------------------------------------------------ causality
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_causality_changing_token_t_changes_nothing_before_t(make_model, mode):
    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    model.train(mode == "train")
    x = _tokens(2, 48)
    x[1, 13] = 0  # a second document in row 1
    with torch.no_grad():
        base, core = _forward(model, x, seed=11, record=True, return_core=True)
        assert len(_blocks_used(core)) >= 2  # routing is not trivial
        for t in (1, 7, 8, 21, 30, 47):
            y = x.clone()
            y[:, t] = (y[:, t] + 17) % (V - 1) + 1
            out = _forward(model, y, seed=11)
            diff = (out - base).abs().amax(-1)  # [b, s]
            assert diff[:, :t].max() <= 1e-6, f"token {t} changed earlier logits by {diff[:, :t].max()}"
            assert (diff[:, t] > 1e-4).all()


# ----------------------------------------------------------------- packed documents
def _packed_rows():
    a = _tokens(1, 12, seed=1)[0].tolist() + [0]  # A: 13 tokens including its EOD
    b = _tokens(1, 21, seed=2)[0].tolist() + [0]  # B: 22 tokens including its EOD
    c = _tokens(1, 11, seed=3)[0].tolist()  # C: 11 tokens
    row = torch.tensor([a + b + c])
    return row, torch.tensor([b]), torch.tensor([c]), len(a), len(a) + len(b)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_packed_documents_equal_documents_alone(make_model, mode):
    # training mode without router noise: the noise draws depend on the windows of the whole batch
    kw = dict(router_noise=False) if mode == "train" else {}
    model = make_model(router_std=10.0, seed=3, **CAUSAL, **kw)
    model.train(mode == "train")
    row, b_alone, c_alone, b0, c0 = _packed_rows()
    with torch.no_grad():
        packed, core = model(row, record=True, return_core=True)
        assert len(_blocks_used(core)) >= 2
        out_b = model(b_alone)
        out_c = model(c_alone)
    torch.testing.assert_close(packed[:, b0:c0], out_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, c0:], out_c, rtol=0, atol=1e-5)
    # and the per-token loss (labels shifted inside each document)
    if mode == "eval":
        with torch.no_grad():
            loss_row = model(row, labels=torch.roll(row, -1, 1))
            loss_b = model(b_alone, labels=torch.roll(b_alone, -1, 1))
        torch.testing.assert_close(loss_row[:, b0 : c0 - 1], loss_b[:, :-1], rtol=0, atol=1e-5)


def test_packed_documents_see_no_previous_document(make_model):
    """The control: without the EOD the same tokens give different logits for B."""
    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    row, b_alone, _, b0, c0 = _packed_rows()
    glued = row.clone()
    glued[0, b0 - 1] = 5  # A no longer ends with EOD: A and B are one document
    with torch.no_grad():
        out = model(glued)
        alone = model(b_alone)
    assert (out[:, b0:c0] - alone).abs().max() > 1e-3


# ---------------------------------------------------- grouped dispatch == naive loop
class NaiveRoutedStep(RoutedStep):
    """Each window alone: its chosen block on [len, 1, h] with a plain causal mask, gated."""

    def update(self, flat, windows, decision, ctx):
        assert not ctx.truncated(self.step)
        pieces, expect_first = [], 0
        for w in range(windows.num_windows):
            first, n = int(windows.window_first_token[w]), int(windows.window_length[w])
            assert first == expect_first  # windows tile the flat tokens in order
            expect_first += n
            x = flat[first : first + n]
            y = self.core.call(
                self.step,
                int(decision.choice[w]),
                x.unsqueeze(1),
                SegmentMask(),
                ctx.token_rope[first : first + n],
                ctx,
            ).squeeze(1)
            pieces.append(x + decision.gate[w].to(x.dtype) * (y - x))
        assert expect_first == flat.shape[0]
        return torch.cat(pieces, 0)


@pytest.mark.parametrize("extra", [{}, {"film": "depth_block", "input_injection": True}])
def test_grouped_dispatch_equals_naive_window_loop(make_model, extra):
    grouped = make_model(router_std=10.0, seed=3, **CAUSAL, **extra).train()
    naive = make_model(router_std=10.0, seed=4, **CAUSAL, **extra).train()
    naive.load_state_dict(grouped.state_dict())
    if extra:  # make FiLM and injection non-trivial
        with torch.no_grad():
            for m in (grouped, naive):
                torch.manual_seed(0)
                m.core.film_gamma.add_(0.3 * torch.randn_like(m.core.film_gamma))
                m.core.film_beta.add_(0.3 * torch.randn_like(m.core.film_beta))
                m.core.injection_logit.add_(torch.randn_like(m.core.injection_logit))
    naive.core.routed_step_class = NaiveRoutedStep
    x = _tokens(2, 40, seed=5)
    x[0, 18] = 0
    labels = _tokens(2, 40, seed=6)
    losses, cores = [], []
    for m in (grouped, naive):
        loss, core = _forward(m, x, seed=9, labels=labels, record=True, return_core=True)
        loss.sum().backward()
        losses.append(loss.detach())
        cores.append(core)
    assert len(_blocks_used(cores[0])) >= 2
    for rg, rn in zip(cores[0].records, cores[1].records):
        assert torch.equal(rg.choice, rn.choice)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    pn = dict(naive.named_parameters())
    checked = 0
    for name, p in grouped.named_parameters():
        q = pn[name]
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked > 20
    for blk in range(3):  # every used block received gradient
        if blk in _blocks_used(cores[0]):
            assert _block(grouped.core, blk).mlp.linear_fc1.weight.grad.abs().sum() > 0
    assert grouped.core.routers[0].logits.weight.grad.abs().sum() > 0  # through the gate


def test_grouping_runs_whole_windows_in_order():
    """group_tokens sorts tokens by block stably (windows whole and in order); the per-block executor
    calls each block once on its rows, with their windows as segments and their RoPE positions."""
    from types import SimpleNamespace

    from megatron_lol.model.executors import PerBlockCalls, group_sizes
    from megatron_lol.model.static_routing import group_tokens, permute_rows
    from megatron_lol.plan.windows import WindowOptions

    token_window = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])
    choice_w = torch.tensor([2, 0, 2, 1, 0])
    grouping = group_tokens(choice_w[token_window], token_window, 3)
    assert group_sizes(grouping) == [3, 4, 4]
    assert grouping.order.tolist() == [3, 4, 10, 6, 7, 8, 9, 0, 1, 2, 5]
    assert grouping.segments.tolist() == [1, 1, 4, 3, 3, 3, 3, 0, 0, 0, 2]
    assert grouping.group_ends.tolist() == [3, 7, 11] and grouping.inverse[grouping.order].tolist() == list(range(11))
    flat = torch.arange(11.0).view(11, 1)
    calls = []

    def call(step, block, x, mask, rope, ctx, pad_to=1):
        calls.append(block)
        rows = grouping.order[grouping.block_of_row == block]
        assert torch.equal(x.squeeze(1), flat[rows]) and torch.equal(mask.segments.view(-1), token_window[rows])
        assert torch.equal(rope.view(-1), (rows % 6).float())  # row positions of a 6-token row
        return x * (block + 2)

    core = SimpleNamespace(
        cfg=SimpleNamespace(plan=SimpleNamespace(windows=WindowOptions(4, 2))), packed=True, row_multiple=1, call=call
    )
    ctx = SimpleNamespace(rope=torch.arange(6.0).view(6, 1, 1, 1))
    core.packed = False
    rows = permute_rows(flat, grouping.order, grouping.inverse)
    positions = (torch.arange(11) % 6).index_select(0, grouping.order)
    out = PerBlockCalls().run(core, None, ctx, rows, grouping, positions)
    assert calls == [0, 1, 2]  # one call per block
    back = permute_rows(out, grouping.inverse, grouping.order)
    torch.testing.assert_close(back, flat * (choice_w[token_window] + 2).view(11, 1).float())


# -------------------------------------------------------------------- path forcing
def _per_doc_path(records, num_docs):
    D = len(records)
    K = 1 + max(int(r.window_ordinal.max()) for r in records)
    ids = torch.full((D, num_docs, K), -1, dtype=torch.long)
    gates = torch.zeros(D, num_docs, K)
    for d, r in enumerate(records):
        ids[d, r.window_doc, r.window_ordinal] = r.choice
        gates[d, r.window_doc, r.window_ordinal] = r.gate
    return ids, gates


def test_forcing_own_choices_reproduces_logits_per_document(make_model):
    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    x = _tokens(2, 40, seed=7)
    x[0, 14] = 0
    x[1, 25] = 0  # 4 documents
    with torch.no_grad():
        base, core = model(x, record=True, return_core=True)
        rec = core.records
        assert len(_blocks_used(core)) >= 2
        ids, gates = _per_doc_path(rec, 4)
        forced = model(x, forced_path=ForcedPath(ids, gates), record=True)
        assert torch.equal(forced, base)
        # other blocks: different logits, and the records show the forced blocks
        other, core = model(x, forced_path=ForcedPath((ids + 1) % 3, gates), record=True, return_core=True)
        assert (other - base).abs().max() > 1e-4
        for d, r in enumerate(core.records):
            assert torch.equal(r.choice, (ids[d] + 1)[r.window_doc, r.window_ordinal] % 3)
        # per-document: change only document 2's path; documents 0, 1, 3 are unchanged
        ids2 = ids.clone()
        ids2[:, 2] = (ids2[:, 2] + 1) % 3
        out = model(x, forced_path=ForcedPath(ids2, gates))
        docs = DocumentLayout.from_tokens(x, 0).doc_index
        diff = (out - base).abs().amax(-1)
        # (other documents may differ in rounding only: the packed stream changes shape)
        assert diff[docs != 2].max() <= 1e-6 and diff[docs == 2].max() > 1e-4


def test_forcing_shared_path_and_missing_entries(make_model):
    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    bias = torch.tensor([[0.0, 0.02, -0.01]])
    with torch.no_grad():
        model.core.balancer.bias.copy_(bias)
    x = _tokens(1, 48, seed=8)  # one document: a [D, K] path
    with torch.no_grad():
        base, core = model(x, record=True, return_core=True)
        rec = core.records
        ids, gates = (t[:, 0] for t in _per_doc_path(rec, 1))
        assert ids.dim() == 2
        assert torch.equal(model(x, forced_path=ForcedPath(ids, gates)), base)
        # no entries at all: routed normally
        none = ForcedPath(torch.full_like(ids, -1), torch.zeros_like(gates))
        assert torch.equal(model(x, forced_path=none), base)
        # force some windows to another block; -1 elsewhere and ordinals beyond K are routed
        K = 4
        part = torch.full((len(rec), K), -1, dtype=torch.long)
        part_g = torch.zeros(len(rec), K)
        part[:, 1] = (ids[:, 1] + 1) % 3
        part_g[:, 1] = 0.3
        part[0, 3] = 2
        part_g[0, 3] = 0.9
        out, core = model(x, forced_path=ForcedPath(part, part_g), record=True, return_core=True)
        assert (out - base).abs().max() > 1e-4
        for d, r in enumerate(core.records):
            entry = torch.where(r.window_ordinal < K, part[d, r.window_ordinal.clamp(max=K - 1)], -1)
            is_forced = entry >= 0
            assert is_forced.any() and (~is_forced).any()
            assert torch.equal(r.choice[is_forced], entry[is_forced])
            assert torch.equal(r.gate[is_forced], part_g[d, r.window_ordinal[is_forced]])
            routed_choice, routed_gate = choose_blocks(r.probs, bias[0])
            assert torch.equal(r.choice[~is_forced], routed_choice[~is_forced])
            assert torch.equal(r.gate[~is_forced], routed_gate[~is_forced])


def test_mode_path_from_model_records_forces_the_model(make_model):
    from megatron_lol.analysis.mode_path import mode_path_from_records

    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    examples = []
    with torch.no_grad():
        for seed in range(3):
            _, core = model(_tokens(2, 40, seed=20 + seed), record=True, return_core=True)
            examples.append(core.records)
        ids, gates = mode_path_from_records(examples)
        D = CAUSAL["routed_depth"]
        assert ids.shape == (D, 6)
        assert (ids[:, :5] >= 0).all()  # 40 tokens: ordinals 0..4 at every depth
        assert torch.equal(ids[:, 5] >= 0, torch.tensor([False, True, False, True]))  # shifted depths reach 5
        probs = torch.stack([torch.stack([r.probs[r.window_ordinal == 1].mean(0) for r in ex]) for ex in examples])
        torch.testing.assert_close(gates[:, 1], probs.mean(0).max(-1).values)  # 2 windows per example
        _, core = model(_tokens(1, 40, seed=30), forced_path=ForcedPath(ids, gates), record=True, return_core=True)
        for d, r in enumerate(core.records):
            assert torch.equal(r.choice, ids[d, r.window_ordinal])
            assert torch.equal(r.gate, gates[d, r.window_ordinal])


# ------------------------------------------------------------ growing depth (1.4)
def test_shallower_core_runs_first_depths_with_full_offsets(make_model):
    model = make_model(router_std=10.0, seed=3, **CAUSAL)
    x = _tokens(1, 40, seed=3)
    with torch.no_grad():
        _, core = model(x, depth=2, record=True, return_core=True)
    rec = core.records
    assert [r.depth for r in rec] == [1, 2]
    docs = DocumentLayout.from_tokens(x, 0)
    for r in rec:
        assert torch.equal(r.window_ordinal, WindowLayout.build(docs, r.depth, 8, 4).window_ordinal)
    loads = core.block_loads
    assert loads[:2].sum(1).tolist() == [r.choice.numel() for r in rec]
    assert loads[2:].sum() == 0  # depths 3, 4 did not run (rows may be absent)


# ------------------------------------------------------------- truncated backprop
TRUNC = dict(window_size=8, window_shift=4, routed_depth=3, num_blocks=3, n_prelude=1, n_coda=1)


def _trunc_path(block0_first_window: bool):
    # depth 1: ordinal 0 -> block (0 or 1), ordinals >= 1 -> block 0; depth 2 -> 1; depth 3 -> 2
    K = 5
    ids = torch.tensor([[0 if block0_first_window else 1] + [0] * (K - 1), [1] * K, [2] * K])
    return ForcedPath(ids, torch.full((3, K), 0.8))


def _block_grad(model, blk):
    grads = [p.grad for p in _block(model.core, blk).parameters()]
    return sum(0.0 if g is None else float(g.abs().sum()) for g in grads)


@pytest.mark.parametrize(
    "block0_first, backprop_depth, first_full, expect_grad",
    [
        (False, 1, True, False),  # block 0 only at depth 1, windows with ordinal >= 1: no gradient
        (False, None, True, True),  # control: full backprop
        (False, 2, True, False),  # depth 1 is still truncated with k=2
        (True, 1, True, True),  # ordinal-0 windows keep full gradients
        (True, 1, False, False),  # ... unless first_window_full_backprop is off
    ],
)
def test_truncated_backprop_through_depth(make_model, block0_first, backprop_depth, first_full, expect_grad):
    model = make_model(seed=3, **TRUNC).train()
    x = _tokens(2, 32, seed=4)
    x[1, 11] = 0  # document starts inside a row: its ordinal-0 windows too
    loss = _forward(
        model,
        x,
        seed=1,
        labels=_tokens(2, 32, seed=5),
        forced_path=_trunc_path(block0_first),
        backprop_depth=backprop_depth,
        first_window_full_backprop=first_full,
    )
    loss.sum().backward()
    assert (_block_grad(model, 0) > 0) is expect_grad
    assert _block_grad(model, 2) > 0  # the last depth always learns
    # truncation changes gradients only, never the forward pass
    model.zero_grad()
    with torch.no_grad():
        ref = _forward(model, x, seed=1, labels=_tokens(2, 32, seed=5), forced_path=_trunc_path(block0_first))
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-6)


def test_truncated_backprop_keeps_router_gradient_of_last_depths_only(make_model):
    model = make_model(seed=3, router_tied=False, **TRUNC).train()
    x = _tokens(2, 32, seed=4)
    loss = _forward(model, x, seed=1, labels=_tokens(2, 32, seed=5), backprop_depth=1, first_window_full_backprop=False)
    loss.sum().backward()
    g = [0.0 if r.logits.weight.grad is None else float(r.logits.weight.grad.abs().sum()) for r in model.core.routers]
    # the LM loss reaches router l only through the gates of depth l; the aux loss still
    # reaches every router, so compare with the aux loss switched off
    model2 = make_model(seed=3, router_tied=False, seq_aux_loss_coeff=0.0, **TRUNC).train()
    loss2 = _forward(
        model2, x, seed=1, labels=_tokens(2, 32, seed=5), backprop_depth=1, first_window_full_backprop=False
    )
    loss2.sum().backward()
    g2 = [0.0 if r.logits.weight.grad is None else float(r.logits.weight.grad.abs().sum()) for r in model2.core.routers]
    assert g2[0] == 0 and g2[1] == 0 and g2[2] > 0
    assert all(v > 0 for v in g)


# ------------------------------------------------------------ a route that ignores the input
@pytest.mark.parametrize("router_input", ["windows", "depth"])
def test_depth_only_route_ignores_the_input(make_model, router_input):
    """``router_input: depth`` (the control run): every window of a depth takes the block the
    depth vector picks, whatever the tokens; the window router's choices follow the tokens."""
    model = make_model(router_std=10.0, seed=3, router_input=router_input, **CAUSAL)
    with torch.no_grad():
        _, cx = model(_tokens(2, 48, seed=1), record=True, return_core=True)
        _, cy = model(_tokens(2, 48, seed=2), record=True, return_core=True)
    same = all(torch.equal(a.choice, b.choice) for a, b in zip(cx.records, cy.records))
    one_per_depth = all(len(set(r.choice.tolist())) == 1 for r in cx.records)
    if router_input == "depth":
        assert same and one_per_depth
        assert len(_blocks_used(cx)) >= 2  # the depths still differ: a learned route, not one block
    else:
        assert not same and not one_per_depth
    model.train()
    loss = _forward(model, _tokens(2, 48, seed=1), seed=4, labels=_tokens(2, 48, seed=5))
    loss.sum().backward()
    # the route is learned: the LM loss reaches the depth vectors and the router through the gates
    assert model.core.depth_vectors.grad.abs().sum() > 0
    assert model.core.routers[0].logits.weight.grad.abs().sum() > 0


RO = dict(CAUSAL, router_only_tokens=[90, 91, 92], router_only_filler=89)


def _strategy_batch(strategy: int):
    x = _tokens(2, 48, seed=8)
    x = torch.where(x >= 89, 7, x)  # no stray router-only / filler ids
    x[1, 20] = 0  # a second document in row 1
    x[0, 2] = strategy  # the field: early in row 0's document and in row 1's second one
    x[1, 22] = strategy
    return x


def test_router_only_tokens_reach_the_router_only(make_model):
    """A router-only token changes the routes (windows starting at or after it) and, only through
    them, the logits; with the routes forced, changing it changes nothing; tokens before it are untouched."""
    model = make_model(router_std=10.0, seed=3, **RO)
    x, y = _strategy_batch(90), _strategy_batch(92)
    with torch.no_grad():
        base, core_x = model(x, record=True, return_core=True)
        other, core_y = model(y, record=True, return_core=True)
        assert any(not torch.equal(a.choice, b.choice) for a, b in zip(core_x.records, core_y.records))
        assert (other - base).abs().max() > 1e-4
        diff = (other - base).abs().amax(-1)
        assert diff[0, :2].max() == 0 and diff[1, :22].max() == 0  # nothing before the field changes
        ids, gates = _per_doc_path(core_x.records, 3)
        forced_x = model(x, forced_path=ForcedPath(ids, gates))
        forced_y = model(y, forced_path=ForcedPath(ids, gates))
        assert torch.equal(forced_x, forced_y)  # the blocks never saw which strategy it was
        # the layers see the filler: the same logits as the filler itself on the forced routes
        filler = x.clone()
        filler[0, 2], filler[1, 22] = 89, 89
        plain = make_model(router_std=10.0, seed=3, **CAUSAL)
        assert torch.equal(plain(filler, forced_path=ForcedPath(ids, gates)), forced_x)


def test_router_only_tokens_keep_ordinary_tokens_causal_and_carry_no_loss(make_model):
    model = make_model(router_std=10.0, seed=3, **RO).train()
    x = _strategy_batch(91)
    with torch.no_grad():
        base = _forward(model, x, seed=11)
        for t in (1, 9, 30):
            y = x.clone()
            y[:, t] = (y[:, t] + 17) % 80 + 1
            diff = (_forward(model, y, seed=11) - base).abs().amax(-1)
            assert diff[:, :t].max() <= 1e-6 and (diff[:, t] > 1e-4).all()
    labels = torch.roll(x, -1, dims=1)
    loss = _forward(model, x, seed=11, labels=labels)
    assert loss[0, 1] == 0 and loss[1, 21] == 0 and (loss[0, 3:] > 0).all()
    loss.sum().backward()
    assert model.core.router_only_embeddings.grad[1].abs().sum() > 0  # the used strategy's row learns
    assert model.core.router_only_embeddings.grad[0].abs().sum() == 0


@pytest.mark.parametrize(
    "model, message",
    [
        (dict(router_only_tokens=[5]), "router_only_filler"),
        (dict(router_only_tokens=[5], router_only_filler=5), "router_only_filler"),
        (dict(router_only_tokens=[5, 5], router_only_filler=6), "router_only_tokens"),
        (dict(router_only_filler=6), "router_only_filler"),
        (
            dict(plan="dense", core_layers=2, router_only_tokens=[5], router_only_filler=6),
            "plan dense has no window router",
        ),
    ],
)
def test_router_only_config_is_validated(model, message):
    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError

    if model.get("plan") == "dense":
        model = dict(model, num_blocks=None, routed_depth=None)
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": model}, check_data=False)


def test_router_input_is_validated():
    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError

    with pytest.raises(ConfigError, match="model.plan.routing.router_input"):
        config_from_dict({"model": {"router_input": "tokens"}}, check_data=False)


# ------------------------------------------------------------ FiLM and injection
@pytest.mark.parametrize("film, shape", [("depth", (4, 2, 32)), ("depth_block", (4, 3, 2, 32))])
def test_film_parameters_init_gradients_and_identity_at_init(make_model, film, shape):
    plain = make_model(router_std=10.0, seed=3, **CAUSAL)
    model = make_model(router_std=10.0, seed=3, film=film, **CAUSAL)
    core = model.core
    assert tuple(core.film_gamma.shape) == shape and tuple(core.film_beta.shape) == shape
    assert torch.equal(core.film_gamma, torch.ones(shape)) and torch.equal(core.film_beta, torch.zeros(shape))
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["core.film_beta", "core.film_gamma"] and not unexpected
    x = _tokens(2, 40, seed=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model.train()
    _forward(model, x, seed=2, labels=_tokens(2, 40, seed=13), record=True).sum().backward()
    for p in (core.film_gamma, core.film_beta):
        assert p.grad is not None
        per_depth = p.grad.flatten(1).abs().sum(1)
        assert (per_depth > 0).all()  # every depth's (gamma, beta) is used
    model.eval()
    with torch.no_grad():  # FiLM of depth 3 acts at depth 3 only
        before3, before2 = model(x, depth=3), model(x, depth=2)
        core.film_gamma[2] += 0.5
        assert (model(x, depth=3) - before3).abs().max() > 1e-4
        assert torch.equal(model(x, depth=2), before2)
    # FiLM is an argument of each block call, never state on the norms: fixed layers cannot see it
    assert not any(
        hasattr(n, "film") for blk in _all_blocks(core) for n in (blk.input_layernorm, blk.pre_mlp_layernorm)
    )


def test_input_injection_parameter_and_effect(make_model):
    plain = make_model(router_std=10.0, seed=3, **CAUSAL)
    model = make_model(router_std=10.0, seed=3, input_injection=True, **CAUSAL)
    theta = model.core.injection_logit
    assert tuple(theta.shape) == (32,) and torch.equal(theta, torch.zeros(32))
    missing, _ = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["core.injection_logit"]
    x = _tokens(2, 40, seed=12)
    with torch.no_grad():
        # at depth 1, s = s0: sigmoid(0) s + (1 - sigmoid(0)) s0 == s exactly
        torch.testing.assert_close(model(x, depth=1), plain(x, depth=1), rtol=0, atol=0)
        assert (model(x) - plain(x)).abs().max() > 1e-5  # it mixes s0 back in at depths 2..D
    model.train()
    _forward(model, x, seed=2, labels=_tokens(2, 40, seed=13)).sum().backward()
    assert theta.grad is not None and theta.grad.abs().sum() > 0


def test_input_injection_formula_and_router_reads_injected_state(make_model, monkeypatch):
    """Hand-check s <- sig(theta) s + (1 - sig(theta)) s0 at the input of depth 2, as the router sees it."""
    import megatron_lol.model.core_steps as core_mod

    model = make_model(
        router_std=10.0, seed=3, input_injection=True, routed_depth=2, num_blocks=3, window_size=8, window_shift=4
    )
    with torch.no_grad():
        model.core.injection_logit.copy_(torch.linspace(-2, 2, 32))
    seen = []
    real = core_mod.router_summaries

    def spy(windows, states, depth_vector):
        seen.append(states.detach().clone())
        return real(windows, states, depth_vector)

    monkeypatch.setattr(core_mod, "router_summaries", spy)
    outs = []

    class KeepOutputs(RoutedStep):
        def update(self, *a, **k):
            out = super().update(*a, **k)
            outs.append(out.detach().clone())
            return out

    model.core.routed_step_class = KeepOutputs
    with torch.no_grad():
        model(_tokens(1, 24, seed=1))
    s0 = seen[0]  # depth 1 input: sig(t) s0 + (1 - sig(t)) s0 == s0
    mix = torch.sigmoid(torch.linspace(-2, 2, 32))
    torch.testing.assert_close(seen[1], mix * outs[0] + (1 - mix) * s0, rtol=1e-6, atol=1e-7)
