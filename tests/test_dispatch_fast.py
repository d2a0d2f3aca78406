"""The fast dispatch / router paths against the plain formulation.

``run_grouped_gated`` on its torch path (gather with an inverse-permutation backward, split views,
one buffer of block updates, gated ``index_add``) gives ``s + alpha[window] * scatter(cat(E(s_m)) -
s[order])`` written with plain autograd ops bit for bit, values and gradients. Its fused CPU path
(``megatron_lol/kernels/routing_cpu.c``, float32 plans covering every token) gives the same values
bit for bit and the same gradients up to summation order. ``router.window_inputs`` against the
plain window means and ``states[rows]``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lol.kernels import cpu as cpu_kernels
from megatron_lol.model.dispatch import (
    apply_gated_updates,
    gather_planned,
    plan_dispatch,
    run_grouped,
    run_grouped_gated,
)
from megatron_lol.model.router import window_inputs
from megatron_lol.model.windows import DocumentLayout, WindowLayout


@pytest.fixture(params=["torch", "fused"])
def combine_path(request, monkeypatch):
    """Run a test on the torch path (kernels disabled) and on the fused CPU kernels."""
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0" if request.param == "torch" else "1")
    cpu_kernels.reset()
    if request.param == "fused":
        assert cpu_kernels.routing_kernels() is not None, "the C kernels must build here (CI has a compiler)"
    yield request.param
    cpu_kernels.reset()


def _case(dtype, seed=0, T=97, h=12, L=3):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 8, 8, 3, 8, 8, 8, 1, 8, 8, 8, 8, 8, 8]
    token_window = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:T]
    n_windows = int(token_window.max()) + 1
    choice_w = torch.randint(0, L, (n_windows,), generator=g)
    flat = torch.randn(T, h, generator=g).to(dtype)
    weights = [torch.randn(h, h, generator=g).to(dtype) for _ in range(L)]
    gate = torch.rand(n_windows, generator=g)  # fp32, like the router's
    grad_out = torch.randn(T, h, generator=g).to(dtype)
    return token_window, choice_w, flat, weights, gate, grad_out


def _leaves(flat, weights, gate):
    return (flat.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in weights],
            gate.clone().requires_grad_(True))


def _block_fn(weights):
    def call(block, packed, segments, idx):
        return torch.tanh(packed @ weights[block]) + packed  # a residual block
    return call


def _plain(flat, weights, gate, token_window, choice_w, L, subset=None):
    """The formulation before the fast path: index gather, slices, cat, scatter into zeros, multiply-add."""
    token_choice = choice_w[token_window]
    idx = torch.arange(flat.shape[0]) if subset is None else subset
    perm = torch.sort(token_choice[idx], stable=True)[1]
    order = idx[perm]
    counts = torch.bincount(token_choice[order], minlength=L).tolist()
    packed = flat[order]
    outs, lo = [], 0
    for block, n in enumerate(counts):
        if n:
            x = packed[lo:lo + n]
            outs.append(torch.tanh(x @ weights[block]) + x)
        lo += n
    upd = torch.cat(outs) - packed
    updates = upd.new_zeros(flat.shape).index_copy(0, order, upd)
    token_gate = gate[token_window]
    return flat + token_gate.unsqueeze(1).to(flat.dtype) * updates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("subset", [False, True])
def test_run_grouped_gated_is_the_plain_formulation(dtype, subset, combine_path):
    L = 3
    token_window, choice_w, flat0, weights0, gate0, grad_out = _case(dtype)
    sub = torch.nonzero(token_window % 3 != 1).squeeze(1) if subset else None

    flat, weights, gate = _leaves(flat0, weights0, gate0)
    want = _plain(flat, weights, gate, token_window, choice_w, L, sub)
    want.backward(grad_out)
    want_grads = [flat.grad] + [w.grad for w in weights] + [gate.grad]

    flat, weights, gate = _leaves(flat0, weights0, gate0)
    plan = plan_dispatch(choice_w[token_window], token_window, L, subset=sub)
    assert (plan.inverse is None) == subset
    got = run_grouped_gated(plan, flat, _block_fn(weights), gate)
    fused = type(got.grad_fn).__name__ == "_FusedGatedCombineBackward"
    # the kernels run exactly where they apply: float32, every token planned
    assert fused == (combine_path == "fused" and dtype == torch.float32 and not subset)
    got.backward(grad_out)
    got_grads = [flat.grad] + [w.grad for w in weights] + [gate.grad]

    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        if fused:  # the gate's dot products and the state's gradient terms are summed in another order
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b)

    # the generic pair (used with expert parallelism) gives the same too
    flat, weights, gate = _leaves(flat0, weights0, gate0)
    again = apply_gated_updates(flat, plan, run_grouped(plan, flat, _block_fn(weights)), gate)
    again.backward(grad_out)
    assert torch.equal(again, want)
    for a, b in zip([flat.grad] + [w.grad for w in weights] + [gate.grad], want_grads):
        assert torch.equal(a, b)


def test_gather_planned_backward_puts_rows_back():
    token_window, choice_w, flat0, _, _, _ = _case(torch.float32, seed=1)
    for sub in (None, torch.arange(0, flat0.shape[0], 2)):
        plan = plan_dispatch(choice_w[token_window], token_window, 3, subset=sub)
        flat = flat0.clone().requires_grad_(True)
        packed = gather_planned(plan, flat)
        assert torch.equal(packed, flat0[plan.order])
        g = torch.randn(packed.shape)
        packed.backward(g)
        want = torch.zeros_like(flat0)
        want[plan.order] = g
        assert torch.equal(flat.grad, want)


def test_gated_paths_refuse_double_backward(combine_path):
    token_window, choice_w, flat0, weights0, gate0, _ = _case(torch.float32, seed=2)
    flat, weights, gate = _leaves(flat0, weights0, gate0)
    plan = plan_dispatch(choice_w[token_window], token_window, 3)
    out = run_grouped_gated(plan, flat, _block_fn(weights), gate)
    (g,) = torch.autograd.grad(out.square().sum(), gate, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_inputs_equal_plain_means_and_rows(dtype):
    g = torch.Generator().manual_seed(3)
    docs = DocumentLayout.from_starts(torch.tensor([[0] * 30 + [1] + [0] * 9, [0] * 40], dtype=torch.bool))
    windows = WindowLayout.build(docs, depth=2, window_size=8, window_shift=3)
    base = torch.randn(80, 6, generator=g).to(dtype)
    first = windows.window_first_token
    w_means, w_rows = (torch.randn(windows.num_windows, 6, generator=g) for _ in range(2))
    w_dense = torch.randn(80, 6, generator=g).to(dtype)

    def plain(x):
        sums = torch.zeros(windows.num_windows, 6).index_add(0, windows.token_window, x.float())
        return sums / windows.window_length.unsqueeze(1).float(), x[first].float()

    outs, grads = [], []
    for fn in (plain, lambda x: window_inputs(windows, x)):
        leaf = base.clone().requires_grad_(True)
        x = leaf * 2  # the gradient accumulates in a non-leaf, like a depth's input
        means, rows = fn(x)
        ((means * w_means).sum() + (rows * w_rows).sum() + (x * w_dense).float().sum()).backward()
        outs.append((means.detach(), rows.detach()))
        grads.append(leaf.grad)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # the state's three gradient terms are summed in another order; in bf16 the router's two
    # are also summed in fp32 before the cast (autograd casts each, then adds)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)


def _window_noise_per_row_tensors(windows, row_seeds, depth, num_blocks, row_length):
    """The former formulation: one generator and one randn tensor per row, concatenated."""
    rows = torch.div(windows.window_first_token, row_length, rounding_mode="floor")
    per_row = torch.bincount(rows, minlength=len(row_seeds)).tolist()
    parts = []
    for seed, n in zip(row_seeds.tolist(), per_row):
        gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + depth) % (2**63 - 1))
        parts.append(torch.randn(n, num_blocks, generator=gen))
    return torch.cat(parts)


@pytest.mark.parametrize("b,s,L,W,S", [(4, 512, 4, 64, 32), (3, 45, 3, 8, 4), (2, 7, 5, 8, 4), (5, 100, 7, 16, 5)])
def test_window_noise_draws_what_per_row_generators_drew(b, s, L, W, S):
    from megatron_lol.model.router import window_noise
    from megatron_lol.model.windows import DocumentLayout, WindowLayout

    g = torch.Generator().manual_seed(b * s)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    tokens[tokens < 5] = 0  # EOD: several documents per row
    docs = DocumentLayout.from_tokens(tokens, 0)
    seeds = torch.randint(0, 2**40, (b,), generator=g)
    for depth in range(1, 5):
        windows = WindowLayout.build(docs, depth, W, S)
        got = window_noise(windows, seeds, depth, L, s)
        assert torch.equal(got, _window_noise_per_row_tensors(windows, seeds, depth, L, s))


def test_routed_core_runs_outside_the_device_mode_only_when_safe(make_model):
    """On one rank the core's forward leaves the CPU device mode; results are unchanged."""
    from megatron_lol.platform import device_mode_suspended

    net = make_model(router_std=0.5)
    seen = []
    block = net.core.block(0)
    block.register_forward_pre_hook(lambda m, a: seen.append(torch._C._len_torch_function_stack()))
    tokens = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    depth_outside = torch._C._len_torch_function_stack()
    with torch.no_grad():
        out = net(tokens)
    assert depth_outside >= 1 and seen and set(seen) == {0}
    assert not net.core._needs_device_mode()
    # the same forward inside the mode gives the same logits
    net.core._needs_device_mode = lambda: True
    seen.clear()
    with torch.no_grad():
        again = net(tokens)
    assert set(seen) == {depth_outside}
    assert torch.equal(out, again)
    # a CUDA device used without the mode raises instead of running elsewhere
    with device_mode_suspended():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(2, device=0)
    assert torch.empty(2, device=0).device.type == "cpu"
