"""LeanTransformerLayer: megatron-core's layer, bit for bit, on a shorter call path.

Every comparison runs the same layer object twice, once on the short path and
once with ``LeanTransformerLayer.enabled = False`` (megatron-core's own
``TransformerLayer`` code), and requires identical outputs, input gradients and
parameter gradients (``torch.equal``). A counter on megatron's halves makes sure
the short path really ran.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

from conftest import tiny_config


@contextlib.contextmanager
def megatron_path():
    from megatron_lol.model.lean_layer import LeanTransformerLayer

    LeanTransformerLayer.enabled = False
    try:
        yield
    finally:
        LeanTransformerLayer.enabled = True


@pytest.fixture
def megatron_calls(monkeypatch):
    """Counts calls into megatron-core's TransformerLayer halves."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts = {"attention": 0, "mlp": 0}
    attn, mlp = TransformerLayer._forward_attention, TransformerLayer._forward_mlp

    def counted_attn(self, *a, **k):
        counts["attention"] += 1
        return attn(self, *a, **k)

    def counted_mlp(self, *a, **k):
        counts["mlp"] += 1
        return mlp(self, *a, **k)

    monkeypatch.setattr(TransformerLayer, "_forward_attention", counted_attn)
    monkeypatch.setattr(TransformerLayer, "_forward_mlp", counted_mlp)
    return counts


def _layer(dtype=torch.float32, **model):
    from megatron_lol.model.library import block_spec, build_layer, transformer_config

    cfg = tiny_config(**model)
    if dtype == torch.bfloat16:
        cfg = dataclasses.replace(cfg, params_dtype="bf16")
    torch.manual_seed(5)
    layer = build_layer(block_spec(False), transformer_config(cfg), 1).train()
    return layer, cfg


def _run(layer, hidden, mask, rope, gates=None):
    from megatron_lol.model.library import run_layer

    for p in layer.parameters():
        p.grad = None
    x = hidden.clone().requires_grad_(True)
    out = run_layer(layer, x, mask, rope, False, gates=gates)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [None, 2])
def test_chunked_windows_bit_identical(megatron_env, megatron_calls, dtype, groups):
    from megatron_lol.model.attention import SegmentMask

    layer, cfg = _layer(dtype, num_query_groups=groups)
    T, W = 45, 8
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, 1, cfg.hidden_size, generator=g).to(dtype)
    segments = (torch.arange(T) // 6).view(1, -1)  # windows of 6 tokens in chunks of 8
    mask = SegmentMask(segments=segments, chunk=W)
    rope = _rope(T, layer.self_attention.hidden_size_per_attention_head)
    lean = _run(layer, hidden, mask, rope)
    assert megatron_calls == {"attention": 0, "mlp": 0}
    with megatron_path():
        reference = _run(layer, hidden, mask, rope)
    assert megatron_calls == {"attention": 1, "mlp": 1}
    _assert_same(lean, reference)


@pytest.mark.parametrize("sliding", [None, 5])
def test_dense_documents_and_film_bit_identical(megatron_env, megatron_calls, sliding):
    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.library import layer_norms

    layer, cfg = _layer()
    s, b = 20, 3
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(s, b, cfg.hidden_size, generator=g)
    docs = torch.cumsum(torch.rand(b, s, generator=g) < 0.2, dim=1)
    mask = SegmentMask(segments=docs, sliding=sliding)
    for norm in layer_norms(layer):  # FiLM, as the routed core sets it
        norm.film = (torch.rand(cfg.hidden_size, generator=g) + 0.5, torch.randn(cfg.hidden_size, generator=g))
    rope = _rope(s, layer.self_attention.hidden_size_per_attention_head)
    lean = _run(layer, hidden, mask, rope)
    with megatron_path():
        reference = _run(layer, hidden, mask, rope)
    _assert_same(lean, reference)
    # and without RoPE
    lean = _run(layer, hidden, mask, None)
    with megatron_path():
        reference = _run(layer, hidden, mask, None)
    _assert_same(lean, reference)
    assert megatron_calls == {"attention": 2, "mlp": 2}  # only the two reference runs


def test_gated_second_pass_bit_identical(megatron_env, megatron_calls):
    """Accordion's gated halves go through _forward_attention / _forward_mlp too."""
    from megatron_lol.model.attention import SegmentMask

    layer, cfg = _layer()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, 2, cfg.hidden_size, generator=g)
    gates = (torch.rand(cfg.hidden_size, generator=g), torch.rand(cfg.hidden_size, generator=g))
    mask = SegmentMask()
    lean = _run(layer, hidden, mask, _rope(16, layer.self_attention.hidden_size_per_attention_head), gates)
    with megatron_path():
        reference = _run(layer, hidden, mask, _rope(16, layer.self_attention.hidden_size_per_attention_head), gates)
    _assert_same(lean, reference)
    assert megatron_calls == {"attention": 1, "mlp": 1}


def test_lol_model_training_step_bit_identical(make_model):
    """A whole LoL model (prelude, routed blocks with FiLM, coda): loss and every gradient."""
    net = make_model(router_std=0.5, film="depth").train()
    tokens = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(4))

    def step():
        net.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # router noise
        loss = net(tokens, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    loss, grads = step()
    with megatron_path():
        loss_ref, grads_ref = step()
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and len(grads) > 10
    for name in grads:
        assert torch.equal(grads[name], grads_ref[name]), name


def test_short_path_only_where_nothing_needs_megatron(megatron_env):
    from megatron_lol.model.lean_layer import LeanTransformerLayer, lean_path_taken

    layer, _ = _layer()
    assert isinstance(layer, LeanTransformerLayer)
    assert lean_path_taken(layer) == (True, True)
    # an MoE block: the attention half qualifies, the MoE MLP does not
    moe_cfg = tiny_config(num_experts=4, moe_layers="all", plan="looped", num_blocks=2)
    from megatron_lol.model.library import block_spec, build_layer, transformer_config

    moe_layer = build_layer(block_spec(False, num_experts=4), transformer_config(moe_cfg), 1)
    assert lean_path_taken(moe_layer) == (True, False)
    # settings that need megatron's generality
    for name, value in (("sequence_parallel", True), ("add_bias_linear", True), ("tensor_model_parallel_size", 2),
                        ("hidden_dropout", 0.1)):
        fresh, _ = _layer()
        if name == "hidden_dropout":
            fresh.hidden_dropout = value
        else:
            fresh.config = copy.copy(fresh.config)
            setattr(fresh.config, name, value)
        assert lean_path_taken(fresh) == (False, False), name
    fresh, _ = _layer()
    fresh.config = copy.copy(fresh.config)
    fresh.config.rotary_interleaved = True
    assert lean_path_taken(fresh) == (False, True)
    with megatron_path():
        assert lean_path_taken(layer) == (False, False)


def test_hooks_on_skipped_modules_keep_megatrons_path(megatron_env, megatron_calls):
    """A hook on the attention / MLP (or their linears) fires: that half takes megatron's path."""
    from megatron_lol.model.attention import SegmentMask

    layer, cfg = _layer()
    hidden = torch.randn(12, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    rope = _rope(12, layer.self_attention.hidden_size_per_attention_head)
    fired = []
    handle = layer.self_attention.register_forward_hook(lambda *a: fired.append("attention"))
    lean = _run(layer, hidden, SegmentMask(), rope)
    assert fired == ["attention"] and megatron_calls == {"attention": 1, "mlp": 0}
    handle.remove()
    handle = layer.mlp.linear_fc2.register_forward_pre_hook(lambda *a: fired.append("fc2"))
    again = _run(layer, hidden, SegmentMask(), rope)
    assert fired == ["attention", "fc2"] and megatron_calls == {"attention": 1, "mlp": 1}
    handle.remove()
    _assert_same(lean, again)
