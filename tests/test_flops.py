"""FLOP model: hand-derived counts (clipped windows, truncation, growing depth, MoE with shared and
per-core experts, Foil, Accordion budgets) and torch's FLOP counter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_lol.perf import flops as fl


def _model(**over):
    from megatron_lol.config import config_from_dict

    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_blocks=3,
        routed_depth=3,
        window_size=8,
        window_shift=4,
        n_prelude=1,
        n_coda=1,
        router_noise=False,
    )
    base.update(over)
    return config_from_dict({"model": base}).model


def test_pairs_golden_and_clipped():
    assert fl.windowed_pairs(1024, 128, 0) == 66_048  # docs/model.md, "Golden facts"
    assert fl.windowed_pairs(1024, 128, 64) == 61_952
    assert fl.causal_pairs(1024) == 524_800
    # n = 21, W = 8: aligned windows 8, 8, 5; shifted by 4: 4, 8, 8, 1 (clipped at both ends)
    assert fl.window_lengths(21, 8, 0) == [8, 8, 5]
    assert fl.window_lengths(21, 8, 4) == [4, 8, 8, 1]
    assert fl.windowed_pairs(21, 8, 0) == 36 + 36 + 15
    assert fl.windowed_pairs(21, 8, 4) == 10 + 36 + 36 + 1
    assert fl.sliding_pairs(10, 4) == 1 + 2 + 3 + 4 * 7
    assert fl.chunked_pairs(21, 8) == 3 * 8 * 16
    from megatron_lol.model.windows import allowed_pairs

    for n, W, off in ((21, 8, 4), (100, 16, 8), (7, 8, 0), (64, 8, 3)):
        assert fl.windowed_pairs(n, W, off) == allowed_pairs(n, W, off)


def test_lol_forward_and_training_by_hand():
    m = _model()
    V, n = 97, 21
    # per token and layer: QKV 2*32*96 + out 2*32*32 = 8192; SwiGLU 6*32*64 = 12288
    layer = 21 * (8192 + 12288)
    heads_dim = 4 * 8  # nq * c
    prelude = layer + 4 * fl.causal_pairs(21) * heads_dim
    depth_pairs = [87, 83, 87]  # depths 1, 2, 3: offsets 0, 4, 0
    windows = [3, 4, 3]
    core = sum(layer + 4 * p * heads_dim + 2 * w * 32 * 3 for p, w in zip(depth_pairs, windows))
    head = 2 * 21 * 32 * V
    f = fl.forward_flops(m, V, n)
    assert f.forward.total == prelude + core + prelude + head
    assert f.backward.total == 0
    t = fl.training_flops(m, V, n)
    assert t.forward.total == f.forward.total  # no router noise configured
    assert t.total == 3 * f.forward.total
    # growing depth: a depth-2 core runs depths 1 and 2 only
    g = fl.training_flops(m, V, n, depth=2)
    core2 = sum(layer + 4 * p * heads_dim + 2 * w * 32 * 3 for p, w in zip(depth_pairs[:2], windows[:2]))
    assert g.forward.total == 2 * prelude + core2 + head
    # truncated backprop, k = 1: depths 1 and 2 back-propagate their first windows only
    # (8 tokens at depth 1, 4 tokens at depth 2: the shifted first window is clipped)
    tr = fl.training_flops(m, V, n, backprop_depth=1)
    first = [(8, 36, 1), (4, 10, 1)]
    bwd_core = 2 * (layer + 4 * 87 * heads_dim + 2 * 3 * 32 * 3)  # depth 3, full
    for tokens, pairs, w in first:
        bwd_core += 2 * (tokens * (8192 + 12288) + 4 * pairs * heads_dim + 2 * w * 32 * 3)
    assert tr.backward.total == 2 * (2 * prelude + head) + bwd_core
    no_first = fl.training_flops(m, V, n, backprop_depth=1, first_window_full_backprop=False)
    assert no_first.backward.total == 2 * (2 * prelude + head) + 2 * (layer + 4 * 87 * heads_dim + 2 * 3 * 32 * 3)
    # batch scales linearly
    assert fl.training_flops(m, V, n, batch=3).total == 3 * t.total
    # the trainer's entry point
    from megatron_lol.config import config_from_dict

    cfg = config_from_dict(
        {
            "model": dict(
                hidden_size=32,
                num_attention_heads=4,
                ffn_hidden_size=64,
                num_blocks=3,
                routed_depth=3,
                window_size=8,
                window_shift=4,
                router_noise=False,
                vocab_size=V,
            )
        }
    )
    assert fl.training_flops_per_step(cfg, 3, 1, n) == t.total


def test_other_plans_and_moe_by_hand():
    V, n = 50, 16
    layer = n * (8192 + 12288)
    dense = _model(plan="dense", num_blocks=2, dense_attention="full")
    f = fl.forward_flops(dense, V, n)
    assert f.forward.total == 4 * (layer + 4 * fl.causal_pairs(n) * 32) + 2 * n * 32 * V
    sliding = fl.forward_flops(_model(plan="dense", num_blocks=2, dense_attention="sliding"), V, n)
    assert sliding.parts["core"]["forward"].attention_scores == 2 * 4 * fl.sliding_pairs(n, 8) * 32
    looped = fl.forward_flops(_model(plan="looped", num_blocks=1, routed_depth=3, dense_attention="strided"), V, n)
    # depths 1, 3: windows 8, 8 (72 pairs); depth 2 (offset 4): 4, 8, 4 (10 + 36 + 10)
    assert looped.parts["core"]["forward"].attention_scores == 4 * 32 * (72 + 56 + 72)
    # executed attention: dense rows compute s*s scores, the chunked core ceil(T/W) * W * 2W
    ex = fl.forward_flops(dense, V, n, batch=2, attention_pairs="executed")
    assert ex.parts["prelude"]["forward"].attention_scores == 4 * 2 * n * n * 32
    exl = fl.forward_flops(_model(), V, 21, batch=2, attention_pairs="executed")
    assert exl.parts["core"]["forward"].attention_scores == 3 * 4 * fl.chunked_pairs(42, 8) * 32
    # MoE in the fixed layers: router 2*T*d*E, top-k experts of hidden f_e
    moe = _model(
        plan="dense", num_blocks=1, moe_layers="fixed", num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2
    )
    p = fl.forward_flops(moe, V, n).parts["prelude"]["forward"]
    assert p.mlp == 2 * 6 * n * 32 * 16 and p.moe_router == 2 * n * 32 * 4


def test_memory_model_is_positive_and_scales():
    m = _model()
    a = fl.memory_model(m, 97, 64, 2)
    b = fl.memory_model(m, 97, 64, 4)
    assert a.total > 0 and b.activations == pytest.approx(2 * a.activations)
    assert b.weights == a.weights
    d = fl.memory_model(m, 97, 64, 2, data_parallel=4, distributed_optimizer=True)
    assert d.optimizer == pytest.approx(a.optimizer / 4)
    # a routed depth also keeps its input and the block outputs for the gated combine (2 d per token)
    windows = {"size": m.plan.windows.size, "shift": m.plan.windows.shift}  # the same windows
    looped = {"kind": "looped", "layers": 3, "loops": 1, "attention": "strided", "windows": windows}
    fixed = fl.memory_model(replace(m, plan=looped), 97, 64, 2)  # the same 3 blocks, each once, strided
    depth = fl.default_depth(m)
    assert a.activations - fixed.activations == pytest.approx(depth * 2 * 64 * 2 * m.hidden_size * 4)


def _count(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("plan", ["lol", "strided"])
def test_flop_counter_agrees_within_2_percent(make_model, plan):
    """torch.utils.flop_counter on a forward (and a training step) of a small model vs the executed mode."""
    extra = {} if plan == "lol" else {"plan": "looped", "num_blocks": 2, "dense_attention": "strided"}
    model = make_model(router_noise=False, **extra)  # zero router: every window ties -> block 0, one stream
    cfg = model.cfg
    b, s = 2, 40
    x = torch.randint(1, 97, (b, s), generator=torch.Generator().manual_seed(0))  # no EOD: one document per row
    with torch.no_grad():
        measured = _count(lambda: model(x))
    predicted = fl.forward_flops(cfg, 97, s, b, attention_pairs="executed").forward.total
    assert measured == pytest.approx(predicted, rel=0.02)
    allowed = fl.forward_flops(cfg, 97, s, b).forward.total
    assert allowed < predicted  # the allowed-pairs model counts fewer score entries than are executed
    # a training step: forward + backward
    model.train()
    labels = torch.randint(1, 97, (b, s), generator=torch.Generator().manual_seed(1))
    measured = _count(lambda: model(x, labels=labels).sum().backward())
    predicted = fl.training_flops(cfg, 97, s, b, attention_pairs="executed").total
    assert measured == pytest.approx(predicted, rel=0.02)


# ------------------------------------------------ Foil and Accordion (docs/model.md, "Foil", "Accordion")
def test_shared_expert_and_core_expert_count_by_hand():
    V, n, d = 50, 16, 32
    attn = n * 8192  # QKV 2*32*96 + out 2*32*32 per token
    scores = 4 * fl.causal_pairs(n) * 32
    # every layer MoE: 4 experts of hidden 16, top-2, plus one shared expert of hidden 24
    m = _model(
        plan="dense",
        num_blocks=1,
        moe_layers="all",
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=24,
    )
    p = fl.forward_flops(m, V, n).parts["prelude"]["forward"]
    assert p.mlp == 2 * 6 * n * d * 16 + 6 * n * d * 24  # top-2 routed + the shared expert
    assert p.moe_router == 2 * n * d * 4
    assert p.attention_proj == attn and p.attention_scores == scores
    # Foil: the core's MoE layers hold core_num_experts = 6 (the router grows, the top-2 compute does not)
    foil = _model(
        plan="looped",
        num_blocks=2,
        routed_depth=4,
        dense_attention="full",
        moe_layers="all",
        num_experts=4,
        core_num_experts=6,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
    )
    f = fl.forward_flops(foil, V, n)
    core = f.parts["core"]["forward"]
    assert f.parts["prelude"]["forward"].moe_router == 2 * n * d * 4
    assert core.moe_router == 4 * 2 * n * d * 6  # 4 executions, 6 experts each
    assert core.mlp == 4 * 2 * 6 * n * d * 16
    assert core.attention_proj == 4 * attn and core.attention_scores == 4 * scores  # full causal attention
    # untied attention (one set per pass) computes exactly what the tied one does
    untied = fl.training_flops(replace(foil, untie_attention=True), V, n)
    assert untied.total == fl.training_flops(foil, V, n).total
    # memory model: weights are the counted parameters (untied: one extra set per block here)
    from megatron_lol.model.params import count_parameters

    a = fl.memory_model(foil, V, n, 1)
    b = fl.memory_model(replace(foil, untie_attention=True), V, n, 1)
    assert a.weights == 4 * count_parameters(foil, V).total
    assert b.weights - a.weights == 4 * 2 * (32 * 96 + 32 * 32 + 32)  # 2 blocks x 1 extra pass x (attn + norm)
    assert b.activations == a.activations


def test_accordion_budgets_by_hand():
    V, n, d = 50, 16, 32
    m = _model(
        plan="accordion",
        loop_window=3,
        num_blocks=None,
        routed_depth=None,
        loop_budgets=[0, 1, 3],
        moe_layers="all",
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=24,
        second_pass_router="separate",
    )
    # one layer: attention projections, full causal scores, top-2 + shared expert, router
    layer = n * 8192 + 4 * fl.causal_pairs(n) * 32 + (2 * 6 * n * d * 16 + 6 * n * d * 24) + 2 * n * d * 4
    head = 2 * n * d * V
    plan = m.execution_plan()
    assert plan.depth_for(1) == 4
    f1 = fl.forward_flops(m, V, n, depth=plan.depth_for(1))
    assert f1.parts["core"]["forward"].total == 4 * layer  # window layers 1..3, then layer 1 again
    assert f1.forward.total == (1 + 4 + 1) * layer + head
    assert fl.training_flops(m, V, n, depth=4).total == 3 * f1.forward.total
    # default: the largest budget (3 re-runs); a fixed loop_budget sets it
    assert fl.forward_flops(m, V, n).forward.total == (1 + 6 + 1) * layer + head
    assert fl.forward_flops(replace(m, loop_budget=0), V, n).forward.total == (1 + 3 + 1) * layer + head
    with pytest.raises(ValueError):
        fl.forward_flops(m, V, n, depth=2)  # below the unlooped window
    from megatron_lol.errors import ConfigError

    with pytest.raises(ConfigError, match="2 is not one of the model's budgets"):
        plan.depth_for(2)  # not a configured budget
    # a step: the sum over its micro-batches' budgets; without them, the mean over uniform sampling
    from megatron_lol.config import config_from_dict

    cfg = config_from_dict(
        {
            "model": dict(
                plan="accordion",
                hidden_size=32,
                num_attention_heads=4,
                ffn_hidden_size=64,
                num_blocks=3,
                loop_budgets=[0, 1, 3],
                moe_layers="all",
                num_experts=4,
                moe_ffn_hidden_size=16,
                moe_shared_expert_intermediate_size=24,
                vocab_size=V,
            )
        }
    )
    per_seq = {k: 3 * ((1 + 3 + k + 1) * layer + head) for k in (0, 1, 3)}
    assert fl.training_flops_per_step(cfg, None, 4, n, budgets=[0, 3]) == 2 * per_seq[0] + 2 * per_seq[3]
    assert fl.training_flops_per_step(cfg, None, 6, n) == pytest.approx(6 * sum(per_seq.values()) / 3)
    assert fl.training_flops_per_step(cfg, 4, 2, n) == 2 * per_seq[1]
    # memory: the separate routers and gates are weights; activations per executed layer
    from megatron_lol.model.params import count_parameters

    mem = fl.memory_model(m, V, n, 1, depth=4)
    assert mem.weights == 4 * count_parameters(m, V).total
    assert fl.memory_model(m, V, n, 1, depth=6).activations > mem.activations


@pytest.mark.parametrize("system", ["foil", "accordion"])
def test_flop_counter_agrees_moe_systems(make_model, system):
    """torch's FLOP counter on tiny Foil (untied, core experts != fixed experts) and Accordion (shared
    expert, separate second-pass router, budget 1) models vs the executed-pairs FLOP model."""
    moe = dict(moe_layers="all", num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
    if system == "foil":
        model = make_model(
            plan="looped",
            num_blocks=2,
            routed_depth=4,
            dense_attention="full",
            core_num_experts=6,
            untie_attention=True,
            **moe,
        )
        kwargs, depth = {}, None
    else:
        model = make_model(
            plan="accordion",
            num_blocks=3,
            loop_budgets=[0, 1, 3],
            dense_attention="full",
            moe_shared_expert_intermediate_size=24,
            second_pass_router="separate",
            **moe,
        )
        kwargs, depth = {"budget": 1}, 4
    cfg = model.cfg
    b, s = 2, 24
    x = torch.randint(1, 97, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        measured = _count(lambda: model(x, **kwargs))
    predicted = fl.forward_flops(cfg, 97, s, b, depth=depth, attention_pairs="executed").forward.total
    assert measured == pytest.approx(predicted, rel=1e-6)  # exact: every matmul is counted


def test_accordion_table44_relative_training_flops():
    """The Accordion paper's Table 44 ("Rel. train FLOPs" 1.000 / 1.101 / 1.202 / 1.303 / 1.404 for k = 0..12 at
    8K) is reproduced to its three decimals with a 129,280-row head; the 6B config's 128,000 rows (its Table 5)
    give 1.203 / 1.304 / 1.405 (docs/systems.md, "Readings")."""
    from pathlib import Path

    from megatron_lol.config import load_config

    cfg = load_config(
        Path(__file__).resolve().parents[1] / "examples/configs/paper/accordion-6b-a0.5b.yaml", check_data=False
    )
    plan = cfg.model.execution_plan()

    def relative(vocab):
        f = [fl.training_flops(cfg.model, vocab, 8192, 1, depth=plan.depth_for(k)).total for k in plan.budgets]
        return [round(x / f[0], 3) for x in f]

    assert relative(129_280) == [1.0, 1.101, 1.202, 1.303, 1.404]
    assert relative(cfg.model.vocab_size) == [1.0, 1.101, 1.203, 1.304, 1.405]
