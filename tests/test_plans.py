"""Baseline plans in the same model code: dense (full / sliding / strided), looped, MoE layers.

Each plan trains a few steps on CPU and has a test of its defining property.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ensure_megatron

VOCAB, EOD = 96, 0


def _model(seed=3, **model):
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.lol_model import LoLGPTModel

    ensure_megatron(seed)
    base = dict(hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4, n_prelude=1, n_coda=1)
    base.update(model)
    if base.get("plan", "lol") == "lol":
        base.setdefault("num_blocks", 3)
        base.setdefault("routed_depth", 3)
    cfg = config_from_dict({"model": base}).model
    return LoLGPTModel(cfg, VOCAB, EOD, init_seed=seed), cfg


PLANS = {
    "dense-full": dict(plan="dense", core_layers=3, dense_attention="full"),
    "dense-sliding": dict(plan="dense", core_layers=3, dense_attention="sliding"),
    "dense-strided": dict(plan="dense", core_layers=3, dense_attention="strided"),
    "looped-2x2": dict(plan="looped", loop_layers=2, loop_count=2),
    "lol-moe-fixed": dict(plan="lol", num_experts=4, moe_ffn_hidden_size=48, moe_layers="fixed"),
    "dense-moe": dict(plan="dense", core_layers=3, num_experts=4, moe_ffn_hidden_size=48, moe_layers="all"),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_trains_and_matches_param_count(megatron_env, name):
    from megatron_lol.model.params import count_parameters

    model, cfg = _model(**PLANS[name])
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, VOCAB).total
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(1, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(x, labels=x).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.3, losses


def _block_calls(model, tokens, **kw):
    calls = []
    # the attention norm runs once per block call, as a module, on every path
    hooks = [
        blk.input_layernorm.register_forward_hook(lambda m, i, o, k=k: calls.append(int(k)))
        for k, blk in model.core.blocks.items()
    ]
    model(tokens, **kw)
    for h in hooks:
        h.remove()
    return calls


def test_dense_runs_blocks_in_order_and_looped_cycles_shared_blocks(megatron_env):
    x = torch.randint(1, VOCAB, (1, 16))
    dense, _ = _model(plan="dense", core_layers=3)
    assert _block_calls(dense.eval(), x) == [0, 1, 2]
    looped, cfg = _model(plan="looped", loop_layers=2, loop_count=3)
    assert len(looped.core.blocks) == 2  # stored once, shared by the loops
    assert _block_calls(looped.eval(), x) == [0, 1, 0, 1, 0, 1]
    assert not hasattr(looped.core, "routers")


def _changes(model, tokens, t):
    with torch.no_grad():
        a = model(tokens)
        b_tokens = tokens.clone()
        b_tokens[0, t] = (b_tokens[0, t] % (VOCAB - 2)) + 1
        b = model(b_tokens)
    return (a - b).abs().amax(dim=-1)[0] > 1e-6


def test_sliding_and_strided_attention_reach(megatron_env):
    x = torch.randint(1, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
    # one block, no prelude/coda: sliding window W=8 means token 3 reaches positions 3..10 only
    sliding, _ = _model(plan="dense", dense_attention="sliding", core_layers=1, n_prelude=0, n_coda=0)
    changed = _changes(sliding.eval(), x, 3)
    assert changed[3:11].all() and not changed[11:].any() and not changed[:3].any()
    # strided: depth 1 windows [0,8) [8,16) ...: token 3 reaches 3..7 only
    strided, _ = _model(plan="dense", dense_attention="strided", core_layers=1, n_prelude=0, n_coda=0)
    changed = _changes(strided.eval(), x, 3)
    assert changed[3:8].all() and not changed[8:].any()
    full, _ = _model(plan="dense", dense_attention="full", core_layers=1, n_prelude=0, n_coda=0)
    assert _changes(full.eval(), x, 3)[3:].all()


def test_moe_layers_sit_where_configured(megatron_env):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    lol, _ = _model(plan="lol", num_experts=4, moe_ffn_hidden_size=48, moe_layers="fixed")
    assert all(isinstance(l.mlp, MoELayer) for l in list(lol.prelude.values()) + list(lol.coda.values()))
    assert not any(isinstance(b.mlp, MoELayer) for b in lol.core.blocks.values())
    dense, _ = _model(plan="dense", core_layers=3, num_experts=4, moe_ffn_hidden_size=48, moe_layers="all")
    assert all(isinstance(b.mlp, MoELayer) for b in dense.core.blocks.values())
