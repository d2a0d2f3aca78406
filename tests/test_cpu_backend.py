"""The CPU backend against the reference computation of ``megatron_lol.model``.

* the reference block call (``block_call.reference_layer``) is megatron-core's
  ``TransformerLayer.forward`` bit for bit;
* the backend's short layer halves give the reference's outputs, input and
  parameter gradients bit for bit (fp32 and bf16, chunked windows, dense
  documents, sliding windows, GQA, FiLM, no RoPE, Accordion's gated halves),
  and decline where megatron's generality is needed or a hook must fire;
* the fused gated combine gives the per-block executor's update (per-block calls
  on the grouped rows, then ``static_routing.gated_combine``) bit for bit and its
  gradients within 1e-6 (only summation orders differ), and runs exactly where
  it applies;
* a whole LoL training step: loss and every gradient, backend on vs off;
* the routed core leaves the platform's device mode only when that is safe.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_config

from megatron_lol.backends import BACKEND_ENV, select_backend
from megatron_lol.backends.cpu import CpuBackend
from megatron_lol.backends.cpu import kernels as cpu_kernels
from megatron_lol.backends.cpu.combine import fused_gated_update
from megatron_lol.convert.hf_modeling.parts_lol import FiLM, LoopGates
from megatron_lol.model.attention import SegmentMask
from megatron_lol.model.block_call import BlockParts, call_block
from megatron_lol.model.executors import HostGroups, group_sizes
from megatron_lol.model.static_routing import gated_combine, group_tokens, permute_rows, window_inputs
from megatron_lol.model.windows import DocumentLayout, WindowLayout

CPU = CpuBackend()


# ------------------------------------------------------------------ layer halves
def _layer(dtype=torch.float32, **model):
    from megatron_lol.model.library import block_spec, build_layer, transformer_config

    cfg = tiny_config(**model)
    if dtype == torch.bfloat16:
        cfg = dataclasses.replace(cfg, params_dtype="bf16")
    torch.manual_seed(5)
    layer = build_layer(block_spec(False), transformer_config(cfg), 1).train()
    return layer, cfg


def _run(layer, hidden, mask, rope, parts=None, backend=None):
    parts = BlockParts() if parts is None else parts
    for p in layer.parameters():
        p.grad = None
    x = hidden.clone().requires_grad_(True)
    out, _ = call_block(layer, x, mask, rope, parts, backend=backend)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def _assert_same(a, b):
    out_a, gx_a, gp_a = a
    out_b, gx_b, gp_b = b
    assert torch.equal(out_a, out_b)
    assert torch.equal(gx_a, gx_b)
    assert len(gp_a) == len(gp_b) > 0
    for ga, gb in zip(gp_a, gp_b):
        assert torch.equal(ga, gb)


def _rope(n, head_dim, seed=0):
    return torch.randn(n, 1, 1, head_dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def short_path_calls(monkeypatch):
    """Counts the halves the backend ran (returned a value for)."""
    import megatron_lol.backends.cpu.layer as layer_mod

    counts = {"attention": 0, "mlp": 0}
    for name in counts:
        real = getattr(layer_mod, f"{name}_half")

        def counted(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            counts[_name] += out is not None
            return out

        monkeypatch.setattr(CpuBackend, f"{name}_half", staticmethod(counted))
    return counts


def test_reference_layer_is_megatrons_transformer_layer(megatron_env):
    layer, cfg = _layer()
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(18, 2, cfg.hidden_size, generator=g)
    mask = SegmentMask(segments=torch.cumsum(torch.rand(2, 18, generator=g) < 0.2, dim=1))
    rope = _rope(18, layer.self_attention.hidden_size_per_attention_head)
    ours = _run(layer, hidden, mask, rope)
    for p in layer.parameters():
        p.grad = None
    from megatron.core.transformer.transformer_layer import TransformerLayer

    x = hidden.clone().requires_grad_(True)
    out, _ = TransformerLayer.forward(layer, hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    _assert_same(ours, (out.detach(), x.grad, [p.grad.clone() for p in layer.parameters() if p.grad is not None]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [None, 2])
def test_chunked_windows_bit_identical(megatron_env, short_path_calls, dtype, groups):
    layer, cfg = _layer(dtype, num_query_groups=groups)
    T, W = 45, 8
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, 1, cfg.hidden_size, generator=g).to(dtype)
    mask = SegmentMask(segments=(torch.arange(T) // 6).view(1, -1), chunk=W)  # windows of 6 in chunks of 8
    rope = _rope(T, layer.self_attention.hidden_size_per_attention_head)
    fast = _run(layer, hidden, mask, rope, backend=CPU)
    assert short_path_calls == {"attention": 1, "mlp": 1}
    _assert_same(fast, _run(layer, hidden, mask, rope))


@pytest.mark.parametrize("sliding", [None, 5])
def test_dense_documents_and_film_bit_identical(megatron_env, short_path_calls, sliding):
    layer, cfg = _layer()
    s, b = 20, 3
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(s, b, cfg.hidden_size, generator=g)
    mask = SegmentMask(segments=torch.cumsum(torch.rand(b, s, generator=g) < 0.2, dim=1), sliding=sliding)
    film = (torch.rand(2, cfg.hidden_size, generator=g) + 0.5, torch.randn(2, cfg.hidden_size, generator=g))
    rope = _rope(s, layer.self_attention.hidden_size_per_attention_head)
    for r in (rope, None):
        fast = _run(layer, hidden, mask, r, BlockParts(hooks=((FiLM, film),)), CPU)
        _assert_same(fast, _run(layer, hidden, mask, r, BlockParts(hooks=((FiLM, film),))))
    assert short_path_calls == {"attention": 2, "mlp": 2}
    # FiLM changes the result (the modulation is really applied on both paths)
    assert not torch.equal(fast[0], _run(layer, hidden, mask, None, backend=CPU)[0])


def test_gated_second_pass_bit_identical(megatron_env, short_path_calls):
    layer, cfg = _layer()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, 2, cfg.hidden_size, generator=g)
    gates = (torch.rand(cfg.hidden_size, generator=g), torch.rand(cfg.hidden_size, generator=g))
    rope = _rope(16, layer.self_attention.hidden_size_per_attention_head)
    parts = BlockParts(hooks=((LoopGates, (torch.stack(gates),)),))
    fast = _run(layer, hidden, SegmentMask(), rope, parts, CPU)
    assert short_path_calls == {"attention": 1, "mlp": 1}
    _assert_same(fast, _run(layer, hidden, SegmentMask(), rope, parts))


def test_short_path_only_where_nothing_needs_megatron(megatron_env):
    from megatron_lol.backends.cpu.layer import _attention_eligible, _mlp_eligible
    from megatron_lol.model.library import block_spec, build_layer, transformer_config

    layer, _ = _layer()
    assert (_attention_eligible(layer), _mlp_eligible(layer)) == (True, True)
    # an MoE block: the attention half qualifies, the MoE MLP does not
    moe_cfg = tiny_config(
        num_experts=4, moe_layers="all", plan="looped", num_blocks=None, routed_depth=None, loop_layers=2, loop_count=1
    )
    moe_layer = build_layer(block_spec(False, num_experts=4), transformer_config(moe_cfg), 1)
    assert (_attention_eligible(moe_layer), _mlp_eligible(moe_layer)) == (True, False)
    for name, value in (
        ("sequence_parallel", True),
        ("add_bias_linear", True),
        ("tensor_model_parallel_size", 2),
        ("hidden_dropout", 0.1),
    ):
        fresh, _ = _layer()
        config = copy.copy(fresh.config)
        setattr(config, name, value)
        fresh.self_attention.config = fresh.mlp.config = config
        assert (_attention_eligible(fresh), _mlp_eligible(fresh)) == (False, False), name
    fresh, _ = _layer()
    fresh.self_attention.config = copy.copy(fresh.config)
    fresh.self_attention.config.rotary_interleaved = True
    assert (_attention_eligible(fresh), _mlp_eligible(fresh)) == (False, True)


def test_hooks_on_skipped_modules_take_the_reference(megatron_env, short_path_calls):
    """A hook on the attention / MLP (or their linears) fires: that half takes the reference path."""
    layer, cfg = _layer()
    hidden = torch.randn(12, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    rope = _rope(12, layer.self_attention.hidden_size_per_attention_head)
    fired = []
    handle = layer.self_attention.register_forward_hook(lambda *a: fired.append("attention"))
    fast = _run(layer, hidden, SegmentMask(), rope, backend=CPU)
    assert fired == ["attention"] and short_path_calls == {"attention": 0, "mlp": 1}
    handle.remove()
    handle = layer.mlp.linear_fc2.register_forward_pre_hook(lambda *a: fired.append("fc2"))
    again = _run(layer, hidden, SegmentMask(), rope, backend=CPU)
    assert fired == ["attention", "fc2"] and short_path_calls == {"attention": 1, "mlp": 1}
    handle.remove()
    _assert_same(fast, again)


# ---------------------------------------------------------------- gated combine
@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "1")
    cpu_kernels.reset()
    assert cpu_kernels.routing_kernels() is not None, "the C kernels must build here (CI has a compiler)"
    yield
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
    return (
        flat.clone().requires_grad_(True),
        [w.clone().requires_grad_(True) for w in weights],
        gate.clone().requires_grad_(True),
    )


def _block_fn(weights):
    def call(block, packed, segments, idx):
        return torch.tanh(packed @ weights[block]) + packed  # a residual block

    return call


def _plain(flat, weights, gate, token_window, choice_w, L, subset=None):
    """The definition with plain indexing: per block, its tokens, its update, scattered back and gated."""
    token_choice = choice_w[token_window]
    idx = torch.arange(flat.shape[0]) if subset is None else subset
    updates = torch.zeros_like(flat)
    for block in range(L):
        rows = idx[token_choice[idx] == block]
        x = flat[rows]
        updates = updates.index_copy(0, rows, torch.tanh(x @ weights[block]) + x - x)
    return flat + gate[token_window].unsqueeze(1).to(flat.dtype) * updates


def _grouped(token_window, choice_w, L):
    grouping = group_tokens(choice_w[token_window], token_window, L)
    return grouping, HostGroups(order=grouping.order, segments=grouping.segments, counts=group_sizes(grouping))


def _generic(flat, weights, gate, token_window, choice_w, L):
    """The per-block executor's update: the grouped rows through their blocks, then the gated combine."""
    grouping, groups = _grouped(token_window, choice_w, L)
    pieces = permute_rows(flat, grouping.order, grouping.inverse).split(groups.counts)
    call = _block_fn(weights)
    outs = [
        call(block, pieces[block], groups.segments[lo:hi], groups.order[lo:hi]) for block, lo, hi in groups.slices()
    ]
    block_out = permute_rows(torch.cat(outs), grouping.inverse, grouping.order)
    return gated_combine(flat, block_out, gate.index_select(0, token_window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generic_and_fused_gated_update(kernels_on, dtype):
    L = 3
    token_window, choice_w, flat0, weights0, gate0, grad_out = _case(dtype)

    def grads_of(fn):
        flat, weights, gate = _leaves(flat0, weights0, gate0)
        out = fn(flat, weights, gate)
        out.backward(grad_out)
        return out.detach(), [flat.grad] + [w.grad for w in weights] + [gate.grad]

    plain, plain_grads = grads_of(lambda f, w, g: _plain(f, w, g, token_window, choice_w, L))
    ref, ref_grads = grads_of(lambda f, w, g: _generic(f, w, g, token_window, choice_w, L))
    torch.testing.assert_close(ref, plain, rtol=0, atol=0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the same terms summed in another order
    for a, b in zip(ref_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    flat, weights, gate = _leaves(flat0, weights0, gate0)
    fused = fused_gated_update(flat, _grouped(token_window, choice_w, L)[1], gate, _block_fn(weights))
    # the kernels run exactly where they apply: float32
    assert (fused is not None) == (dtype == torch.float32)
    if fused is None:
        return
    assert type(fused.grad_fn).__name__ == "_FusedGatedCombineBackward"
    fused.backward(grad_out)
    assert torch.equal(fused.detach(), ref)
    for a, b in zip([flat.grad] + [w.grad for w in weights] + [gate.grad], ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # summation orders differ
    partial = dataclasses.replace(_grouped(token_window, choice_w, L)[1], covers_all=False)
    assert fused_gated_update(flat, partial, gate, _block_fn(weights)) is None  # not every row written: declines


def test_fused_path_refuses_double_backward(kernels_on):
    token_window, choice_w, flat0, weights0, gate0, _ = _case(torch.float32, seed=2)
    flat, weights, gate = _leaves(flat0, weights0, gate0)
    out = fused_gated_update(flat, _grouped(token_window, choice_w, 3)[1], gate, _block_fn(weights))
    (g,) = torch.autograd.grad(out.square().sum(), gate, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


# ------------------------------------------------------------------ whole model
def test_lol_training_step_backend_on_equals_reference(make_model, monkeypatch, kernels_on):
    """A whole LoL model (prelude, routed blocks with FiLM, coda): loss bit for bit, gradients
    within 1e-6 (the fused combine sums the gate's dot products in another order)."""
    net = make_model(router_std=0.5, film="depth").train()
    tokens = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(4))

    def step():
        net.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # router noise
        loss = net(tokens, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    assert select_backend(torch.device("cpu")) is not None
    loss, grads = step()
    monkeypatch.setenv(BACKEND_ENV, "0")
    assert select_backend(torch.device("cpu")) is None
    loss_ref, grads_ref = step()
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and len(grads) > 10
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-6, msg=name)


def test_no_backend_for_cuda_tensors():
    assert select_backend(torch.device("cuda", 0)) is None
    assert select_backend(torch.device("meta")) is None


def test_routed_core_runs_outside_the_device_mode_only_when_safe(make_model):
    """On one rank the CPU backend runs the core outside the CPU device mode; results are unchanged."""
    from megatron_lol.platform import device_mode_suspended

    net = make_model(router_std=0.5)
    seen = []
    net.core.block(0).input_layernorm.register_forward_pre_hook(
        lambda m, a: seen.append(torch._C._len_torch_function_stack())
    )
    tokens = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    depth_outside = torch._C._len_torch_function_stack()
    with torch.no_grad():
        out = net(tokens)
    assert depth_outside >= 1 and seen and set(seen) == {0}
    from megatron_lol.backends.cpu import CpuBackend

    assert not CpuBackend.needs_device_mode(net.core)
    seen.clear()
    with pytest.MonkeyPatch.context() as mp:  # the same forward inside the mode: the same logits
        mp.setattr(CpuBackend, "needs_device_mode", staticmethod(lambda core: True))
        with torch.no_grad():
            again = net(tokens)
    assert set(seen) == {depth_outside}
    assert torch.equal(out, again)
    with device_mode_suspended():  # a CUDA device used without the mode raises instead of running elsewhere
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(2, device=0)
    assert torch.empty(2, device=0).device.type == "cpu"


# ---------------------------------------------------------------- router inputs
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
    from megatron_lol.model.host_layout import layout_from_documents

    padded = layout_from_documents(docs, 8, 3, [2]).for_depth(2)  # the routed depth's windows, padded
    assert padded.capacity > windows.num_windows

    def routed(x):
        return tuple(t[: windows.num_windows] for t in window_inputs(padded, x))

    for fn in (plain, routed):
        leaf = base.clone().requires_grad_(True)
        x = leaf * 2  # the gradient accumulates in a non-leaf, like a depth's input
        means, rows = fn(x)
        ((means * w_means).sum() + (rows * w_rows).sum() + (x * w_dense).float().sum()).backward()
        outs.append((means.detach(), rows.detach()))
        grads.append(leaf.grad)
    # window sums are ordered (a padded layout summed along it), not index_add's sequential order
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(outs[0][1], outs[1][1])
    # the state's three gradient terms are summed in another order; in bf16 the router's two
    # are also summed in fp32 before the cast (autograd casts each, then adds)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)


def _window_noise_per_row_tensors(windows, row_seeds, depth, num_blocks, row_length):
    """The plain formulation: one generator and one randn tensor per row, concatenated."""
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

    g = torch.Generator().manual_seed(b * s)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    tokens[tokens < 5] = 0  # EOD: several documents per row
    docs = DocumentLayout.from_tokens(tokens, 0)
    seeds = torch.randint(0, 2**40, (b,), generator=g)
    for depth in range(1, 5):
        windows = WindowLayout.build(docs, depth, W, S)
        got = window_noise(windows, seeds, depth, L, s)
        assert torch.equal(got, _window_noise_per_row_tensors(windows, seeds, depth, L, s))
