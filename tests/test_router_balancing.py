"""Router choice, router size, balancing bias, auxiliary losses, mode path, growing depth,
distinct blocks per path (docs/model.md, "Router" to "Parameter accounting")."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lol.config import bias_updates_allowed
from megatron_lol.model.balancing import BalancingBias
from megatron_lol.model.host_layout import build_host_layout
from megatron_lol.model.router import RoutingDecision, WindowRouter, choose_blocks
from megatron_lol.model.static_routing import global_aux_loss, sequence_aux_loss
from megatron_lol.model.windows import DocumentLayout, WindowLayout


def _loads(choice, bias):
    """The window loads ``[L]`` a depth adds to ``bias`` for these choices."""
    return torch.bincount(choice, minlength=bias.bias.shape[1])


# ------------------------------------------------------------------------- router (1.2)
def test_golden_biased_choice_unbiased_gate():
    probs = torch.tensor([[0.45, 0.40, 0.15]])
    choice, gate = choose_blocks(probs, torch.tensor([0.0, 0.08, 0.0]))
    assert choice.tolist() == [1]
    assert gate.item() == probs[0, 1].item()  # the unbiased probability, 0.40
    choice, gate = choose_blocks(probs, None)
    assert choice.tolist() == [0] and gate.item() == probs[0, 0].item()


def test_ties_go_to_lowest_index():
    third = torch.full((1, 3), 1 / 3)
    assert choose_blocks(third, None)[0].tolist() == [0]
    assert choose_blocks(third, torch.zeros(3))[0].tolist() == [0]
    probs = torch.tensor([[0.2, 0.4, 0.4], [0.1, 0.3, 0.6]])
    assert choose_blocks(probs, None)[0].tolist() == [1, 2]
    # a tie created by the bias: 0.5 + 0.0 == 0.25 + 0.25
    assert choose_blocks(torch.tensor([[0.25, 0.5, 0.25]]), torch.tensor([0.25, 0.0, 0.0]))[0].tolist() == [0]


def test_gate_carries_gradient_choice_does_not():
    logits = torch.tensor([[0.3, 0.1, -0.2]], requires_grad=True)
    probs = torch.softmax(logits, -1)
    choice, gate = choose_blocks(probs, torch.tensor([0.0, 1.0, 0.0]))
    assert not choice.requires_grad and choice.item() == 1
    gate.sum().backward()
    p = probs.detach()[0]
    want = p[1] * (torch.eye(3)[1] - p)  # d a_1 / d z
    torch.testing.assert_close(logits.grad[0], want)


def test_router_init_and_noise():
    router = WindowRouter(16, 5)
    assert sum(p.numel() for p in router.parameters()) == 16 * 5 + 5 * 5 + 2 * 5
    assert all(torch.count_nonzero(p) == 0 for p in router.parameters())  # zero init: ties
    r = torch.randn(7, 16)
    router.eval()
    torch.testing.assert_close(router.probabilities(r), torch.full((7, 5), 0.2))
    router.train()
    torch.manual_seed(3)
    noisy = router.probabilities(r)
    torch.manual_seed(3)
    eps = torch.randn(7, 5)
    # z = 0, std = softplus(0) = log 2 = 0.69
    torch.testing.assert_close(noisy, torch.softmax(eps * math.log(2.0), -1))
    assert router.logits.weight.dtype == torch.float32


def _router_params(model):
    return sum(p.numel() for p in model.core.routers.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_router_parameter_count(make_model, tied):
    d, L, D = 32, 3, 4
    model = make_model(hidden_size=d, num_blocks=L, routed_depth=D, router_tied=tied)
    per_router = d * L + L * L + 2 * L
    n_routers = 1 if tied else D
    assert len(model.core.routers) == n_routers
    assert _router_params(model) == n_routers * per_router
    assert tuple(model.core.depth_vectors.shape) == (D, d)  # e^(l) exist either way
    router_like = [n for n, _ in model.named_parameters() if "router" in n or "depth_vectors" in n]
    assert sum(dict(model.named_parameters())[n].numel() for n in router_like) == n_routers * per_router + D * d
    if tied:
        assert model.core.router_for(1) is model.core.router_for(D)
    else:
        assert len({id(model.core.router_for(l)) for l in range(1, D + 1)}) == D


def test_golden_router_size_1b_math():
    # docs/model.md, "Golden facts": width 2048, L = 8: d*L + L^2 + 2L = 16,464
    assert sum(p.numel() for p in WindowRouter(2048, 8).parameters()) == 16_464


def test_untied_routers_route_each_depth_separately(make_model):
    model = make_model(router_tied=False, routed_depth=3, num_blocks=3)
    with torch.no_grad():
        model.core.routers[1].logits.bias.copy_(torch.tensor([0.0, 0.0, 5.0]))
    x = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        _, core = model(x, record=True, return_core=True)
    rec = core.records
    assert (rec[0].choice == 0).all() and (rec[2].choice == 0).all()  # zero routers tie -> block 0
    assert (rec[1].choice == 2).all()


# ------------------------------------------------------------------ bias update (1.3)
def _bias(L=4, D=3, per_depth=False, speed=1e-3, clamp=16.0, stop=0.966):
    return BalancingBias(L, D, per_depth, speed, clamp, stop)


def test_bias_sign_rule_and_mean_block_keeps_bias():
    bb = _bias()
    bb.record(1, _loads(torch.tensor([0, 0, 0, 1]), bb))  # loads after depth 1: [3, 1, 0, 0]
    bb.record(2, _loads(torch.tensor([1, 2, 0]), bb))  # + [1, 1, 1, 0] -> [4, 2, 1, 0]
    bb.record(3, _loads(torch.tensor([3, 3, 3, 1, 2]), bb))  # + [0, 1, 1, 3] -> [4, 3, 2, 3], mean 3
    assert bb.loads.tolist() == [[4, 3, 2, 3]]
    assert bb.update(step=0, train_iters=100)
    assert torch.equal(bb.bias, torch.tensor([[-1e-3, 0.0, 1e-3, 0.0]]))
    assert bb.bias[0, 1].item() == 0.0 and bb.bias[0, 3].item() == 0.0  # exactly at the mean
    assert bb.loads.sum() == 0  # loads are reset after an update
    # a second step with the same loads moves by another u
    bb.record(1, _loads(torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3]), bb))
    bb.update(step=1, train_iters=100)
    torch.testing.assert_close(bb.bias, torch.tensor([[-2e-3, 0.0, 2e-3, 0.0]]))


def test_bias_speed_and_clamp():
    bb = _bias(L=2, speed=0.5, clamp=16.0)
    for step in range(40):
        bb.record(1, _loads(torch.tensor([0, 0, 1]), bb))
        bb.update(step, 1000)
    assert bb.bias.tolist() == [[-16.0, 16.0]]
    bb = _bias(L=2)
    with torch.no_grad():
        bb.bias.copy_(torch.tensor([[-15.9995, 15.9995]]))
    bb.record(1, _loads(torch.tensor([0, 0, 1]), bb))
    bb.update(0, 1000)
    assert bb.bias.tolist() == [[-16.0, 16.0]]


def test_bias_stop_fraction_exact():
    assert bias_updates_allowed(965, 1000, 0.966)
    assert not bias_updates_allowed(966, 1000, 0.966)
    assert bias_updates_allowed(0, 1, 0.966) and not bias_updates_allowed(1, 1, 0.966)
    for step, applied in [(965, True), (966, False), (999, False)]:
        bb = _bias(L=2)
        bb.record(1, _loads(torch.tensor([0]), bb))
        assert bb.update(step, 1000) is applied
        assert torch.equal(bb.bias, torch.tensor([[-1e-3, 1e-3]] if applied else [[0.0, 0.0]]))
        assert bb.loads.sum() == 0


def test_bias_per_depth_rows():
    bb = _bias(L=3, D=2, per_depth=True)
    assert tuple(bb.bias.shape) == (2, 3)
    bb.record(1, _loads(torch.tensor([0, 0, 1]), bb))  # depth 1: [2, 1, 0] mean 1
    bb.record(2, _loads(torch.tensor([2, 2, 2]), bb))  # depth 2: [0, 0, 3] mean 1
    bb.update(0, 10)
    torch.testing.assert_close(bb.bias, torch.tensor([[-1e-3, 0.0, 1e-3], [1e-3, 1e-3, -1e-3]]))
    assert torch.equal(bb.for_depth(2), bb.bias[1])
    glob = _bias(L=3, D=2)
    glob.record(1, _loads(torch.tensor([0, 0, 1]), glob))
    glob.record(2, _loads(torch.tensor([2, 2, 2]), glob))  # summed: [2, 1, 3] mean 2
    glob.update(0, 10)
    torch.testing.assert_close(glob.bias, torch.tensor([[0.0, 1e-3, -1e-3]]))
    assert torch.equal(glob.for_depth(1), glob.for_depth(2))


@pytest.mark.parametrize("per_depth", [False, True])
def test_model_loads_count_windows_not_tokens(make_model, per_depth):
    model = make_model(per_depth_bias=per_depth, routed_depth=3, router_std=10.0, seed=3).train()
    x = torch.randint(1, 97, (2, 44))
    x[0, 17] = 0  # two documents in row 0
    _, core = model(x, record=True, return_core=True)
    rec = core.records
    counts = torch.stack([torch.bincount(r.choice, minlength=3) for r in rec])  # [D, L] windows
    docs = DocumentLayout.from_tokens(x, 0)
    n_windows = [WindowLayout.build(docs, l, 8, 4).num_windows for l in (1, 2, 3)]
    assert counts.sum(1).tolist() == n_windows  # every window counted once, whatever its length
    want = counts.double() if per_depth else counts.sum(0, keepdim=True).double()
    assert torch.equal(model.core.balancer.loads, want)
    assert torch.equal(core.block_loads, counts)
    assert int(counts.sum()) < x.numel() * 3  # windows, not tokens
    bias = model.core.balancer
    bias.update(0, 100)
    expect = -1e-3 * torch.sign(want - want.mean(1, keepdim=True))
    torch.testing.assert_close(bias.bias, expect.float(), rtol=0, atol=0)


def test_model_bias_used_only_to_choose(make_model):
    model = make_model(router_std=10.0, seed=3)
    with torch.no_grad():
        model.core.balancer.bias.copy_(torch.tensor([[0.0, 0.0, 2.0]]))  # beats any prob difference
    x = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        _, core = model(x, record=True, return_core=True)
    for r in core.records:
        assert (r.choice == 2).all()
        torch.testing.assert_close(r.gate, r.probs[:, 2], rtol=0, atol=0)
        assert (r.probs.sum(-1) - 1).abs().max() < 1e-5


# -------------------------------------------------------------------- aux losses (1.3)
def _two_doc_windows():
    # doc 0: 8 tokens -> 2 windows of W=4; doc 1: 3 tokens -> 1 window (then padding windows)
    eod = 0
    row = torch.tensor([[1, 1, 1, 1, 1, 1, 1, eod, 1, 1, 1]])
    return build_host_layout(row, eod, 4, 2, [1]).for_depth(1)


def _padded(windows, probs, choice):
    """A decision over the layout's ``C`` windows: the three real ones, then padding rows."""
    c = windows.capacity
    full = torch.cat([probs, torch.full((c - 3, 2), 0.5)])
    return RoutingDecision(probs=full, choice=torch.cat([choice, torch.ones(c - 3, dtype=torch.long)]), gate=None)


def test_sequence_aux_loss_hand_example():
    windows = _two_doc_windows()
    assert windows.window_doc[:3].tolist() == [0, 0, 1] and windows.num_windows == 3 and windows.capacity > 3
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2]], requires_grad=True)
    dec = _padded(windows, probs, torch.tensor([0, 1, 0]))
    # doc 0: f=(1/2,1/2), abar=(0.45,0.55) -> 2*(0.225+0.275) = 1.0
    # doc 1: f=(1,0),     abar=(0.8,0.2)   -> 2*0.8 = 1.6 ; summed over documents = 2.6 (padding: none)
    loss = sequence_aux_loss(windows, dec)
    assert loss.item() == pytest.approx(2.6, abs=1e-6)
    loss.backward()
    # d/d a_{w,m} = L * f_m(doc) / n_windows(doc); f carries no gradient
    want = torch.tensor([[2 * 0.5 / 2, 2 * 0.5 / 2], [2 * 0.5 / 2, 2 * 0.5 / 2], [2 * 1.0, 0.0]])
    torch.testing.assert_close(probs.grad, want)


def test_global_aux_loss_hand_example():
    windows = _two_doc_windows()
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2]], requires_grad=True)
    dec = _padded(windows, probs, torch.tensor([0, 1, 0]))
    # f = (2/3, 1/3), abar = (1.7/3, 1.3/3): 2 * (3.4/9 + 1.3/9) = 9.4/9 (padding windows count nowhere)
    loss = global_aux_loss(windows, dec)
    assert loss.item() == pytest.approx(9.4 / 9, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(probs.grad, torch.tensor([[4 / 9, 2 / 9]] * 3))


def _hand_seq_aux(records, L):
    total, docs = 0.0, None
    for r in records:
        docs = int(r.window_doc.max()) + 1
        for d in range(docs):
            sel = r.window_doc == d
            f = torch.bincount(r.choice[sel], minlength=L).double() / sel.sum()
            abar = r.probs[sel].double().mean(0)
            total += L * float((f * abar).sum())
    return total / docs


def test_model_sequence_aux_loss_summed_over_depths_averaged_over_documents(make_model):
    model = make_model(router_std=10.0, seed=3, seq_aux_loss_coeff=1e-4).train()
    x = torch.randint(1, 97, (2, 40))
    x[1, 9] = 0  # 3 documents in the batch
    torch.manual_seed(5)
    _, core = model(x, record=True, return_core=True)
    assert int(core.records[0].window_doc.max()) + 1 == 3
    want = 1e-4 * _hand_seq_aux(core.records, 3)
    assert core.aux_loss.item() == pytest.approx(want, rel=1e-5)
    model.eval()
    with torch.no_grad():
        _, core = model(x, return_core=True)
    assert core.aux_loss is None  # training only


def test_model_global_aux_loss(make_model):
    model = make_model(router_std=10.0, seed=3, balancing="aux_loss", aux_loss_coeff=0.02).train()
    assert model.core.balancer is None
    x = torch.randint(1, 97, (2, 40))
    _, core = model(x, record=True, return_core=True)
    want = 0.0
    for r in core.records:
        f = torch.bincount(r.choice, minlength=3).double() / r.choice.numel()
        want += 3 * float((f * r.probs.double().mean(0)).sum())
    assert core.aux_loss.item() == pytest.approx(0.02 * want, rel=1e-5)


# ---------------------------------------------------------------- mode path (1.4)
class _Rec:
    def __init__(self, probs, ordinal):
        self.probs = torch.tensor(probs)
        self.window_ordinal = torch.tensor(ordinal)


def test_golden_mode_path():
    from megatron_lol.analysis.mode_path import mode_path_from_records

    examples = [[_Rec([[p, 1 - p]], [0])] for p in (0.51, 0.51, 0.01)]
    ids, gates = mode_path_from_records(examples)
    assert ids.tolist() == [[1]]
    assert gates[0, 0].item() == pytest.approx(0.6567, abs=1e-4)
    # each example alone would have picked block 0 twice: the mode is not the majority vote
    assert [mode_path_from_records([e])[0].item() for e in examples] == [0, 0, 1]


def test_mode_path_shapes_ties_and_missing_ordinals():
    from megatron_lol.analysis.mode_path import mode_path_from_records

    ex1 = [_Rec([[0.5, 0.5], [0.2, 0.8], [0.9, 0.1]], [0, 1, 2]), _Rec([[0.3, 0.7]], [0])]
    ex2 = [_Rec([[0.5, 0.5], [0.6, 0.4]], [0, 1]), _Rec([[0.1, 0.9], [0.4, 0.6]], [0, 2])]
    ids, gates = mode_path_from_records([ex1, ex2])
    assert ids.dtype == torch.long and tuple(ids.shape) == (2, 3)
    assert ids.tolist() == [[0, 1, 0], [1, -1, 1]]  # tie -> 0; nobody reached (depth 2, ordinal 1)
    torch.testing.assert_close(gates, torch.tensor([[0.5, 0.6, 0.9], [0.8, 0.0, 0.6]]))


# ------------------------------------------------------------- growing depth (1.4)
def test_golden_growing_depth_exact():
    from megatron_lol.plan import depth_at_step

    assert depth_at_step(5, 9, 1, 16) == 6
    assert math.ceil(1 + 15 * (1 - math.sqrt(1 - 5 / 9))) == 7  # why exact arithmetic matters
    assert depth_at_step(0, 9, 1, 16) == 1
    assert depth_at_step(9, 9, 1, 16) == 16 and depth_at_step(100, 9, 1, 16) == 16
    seq = [depth_at_step(t, 9, 1, 16) for t in range(9)]
    assert seq == sorted(seq) and seq[-1] < 16


def test_growing_depth_matches_exact_formula():
    from fractions import Fraction

    from megatron_lol.plan import depth_at_step

    def exact(t, T, d0, d):
        # smallest integer k with k >= d0 + (d-d0)(1 - sqrt(1 - t/T)), i.e. (d - k) <= (d-d0) sqrt((T-t)/T)
        for k in range(d0, d + 1):
            lhs = Fraction(d - k) ** 2
            if k >= d0 and d - k >= 0 and lhs <= Fraction((d - d0) ** 2 * (T - t), T):
                return k
        return d

    for T in (7, 9, 75, 120):
        for d0, d in ((1, 16), (2, 8), (4, 4), (3, 24)):
            for t in range(T):
                assert depth_at_step(t, T, d0, d) == exact(t, T, d0, d), (t, T, d0, d)
    assert depth_at_step(30, 0.75 * 100, 2, 8) == depth_at_step(30, 75, 2, 8)


# ------------------------------------------------------ distinct blocks per path (1.5)
def test_golden_expected_distinct_blocks():
    from megatron_lol.analysis.paths import expected_distinct_blocks

    assert round(expected_distinct_blocks(8, 16), 2) == 7.06
    assert round(expected_distinct_blocks(24, 16), 2) == 11.85
    assert expected_distinct_blocks(5, 1) == pytest.approx(1.0)
    assert expected_distinct_blocks(1, 16) == pytest.approx(1.0)


@pytest.mark.parametrize("L", [8, 24])
def test_expected_distinct_blocks_monte_carlo(L):
    from megatron_lol.analysis.paths import expected_distinct_blocks

    g = torch.Generator().manual_seed(L)
    paths = torch.randint(0, L, (40_000, 16), generator=g)
    distinct = torch.zeros(paths.shape[0], L).scatter_(1, paths, 1.0).sum(1)
    # std of U is below 1.5, so the standard error is below 0.01
    assert distinct.mean().item() == pytest.approx(expected_distinct_blocks(L, 16), abs=0.04)
