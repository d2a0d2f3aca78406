"""Foil (looped MoE, untied attention) and Accordion (budgets by fixed-prefix looping):
each trains, and each has a test of its defining property. The routing metrics U_t / B2 /
MMR are checked against the properties their definitions state (docs/model.md, "Foil")."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ensure_megatron

VOCAB, EOD = 96, 0

FOIL = dict(
    plan="foil",
    foil_layers=2,
    foil_loops=2,
    num_experts=4,
    foil_experts=8,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layers="all",
    untie_attention=True,
    moe_z_loss_coeff=1e-3,
    moe_loss_average_over_executions=True,
)
ACCORDION = dict(
    plan="accordion",
    n_prelude=1,
    loop_window=3,
    n_coda=1,
    num_experts=4,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layers="all",
    moe_shared_expert_intermediate_size=32,
    loop_budgets=[0, 1, 3],
    num_query_groups=2,
    kv_channels=16,
)


def _model(seed=5, **model):
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.lol_model import LoLGPTModel

    ensure_megatron(seed)
    base = dict(hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4, n_prelude=1, n_coda=1)
    base.update(model)
    cfg = config_from_dict({"model": base}).model
    return LoLGPTModel(cfg, VOCAB, EOD, init_seed=seed), cfg


def _tokens(b=2, s=32, seed=0):
    x = torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))
    x[0, 13] = EOD  # two documents in the first row
    return x


def _train(model, steps=8, **kw):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _tokens(4)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = model(x, labels=x, **({k: v(i) for k, v in kw.items()})).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _count_calls(modules: dict):
    calls = []
    hooks = [m.register_forward_hook(lambda mod, i, o, k=k: calls.append(k)) for k, m in modules.items()]
    return calls, hooks


# ------------------------------------------------------------------ Foil
@pytest.mark.parametrize("untie", [True, False], ids=["foil", "proto-foil"])
def test_foil_trains(megatron_env, untie):
    model, cfg = _model(**dict(FOIL, untie_attention=untie))
    losses = _train(model)
    assert losses[-1] < losses[0] - 0.3, losses


def test_foil_attention_per_pass_experts_shared(megatron_env):
    model, cfg = _model(**FOIL)
    core = model.core
    plan = cfg.execution_plan()
    assert plan.loop_passes == 2 and set(core.pass_attention.keys()) == {"0_1", "1_1"}
    # distinct attention parameters per (block, pass); experts and routers exist once per block
    for i in range(plan.num_stored_blocks):
        own = core.block(i).self_attention.linear_qkv.weight
        other = core.pass_attention[f"{i}_1"].self_attention.linear_qkv.weight
        assert own is not other and not torch.equal(own, other)
    assert not any("pass_attention" in n and ("experts" in n or "router" in n) for n, _ in model.named_parameters())
    assert len(core.block(0).mlp.experts.local_experts) == 8 and model.prelude["0"].mlp.router.weight.shape[0] == 4
    # every pass runs the block's own experts, and pass p's own attention
    attn = {f"{i}_0": core.block(i).self_attention for i in range(2)}
    attn.update({k: v.self_attention for k, v in core.pass_attention.items()})
    experts = {str(i): core.block(i).mlp for i in range(2)}
    a_calls, h1 = _count_calls(attn)
    e_calls, h2 = _count_calls(experts)
    model.train()
    x = _tokens()
    model(x, labels=x).mean().backward()
    for h in h1 + h2:
        h.remove()
    assert a_calls == ["0_0", "1_0", "0_1", "1_1"]
    assert e_calls == ["0", "1", "0", "1"]
    for k, module in attn.items():  # each attention set is trained by its pass only
        assert module.linear_qkv.weight.grad is not None and module.linear_qkv.weight.grad.abs().sum() > 0, k


def test_proto_foil_shares_attention(megatron_env):
    model, cfg = _model(**dict(FOIL, untie_attention=False))
    assert model.core.pass_attention is None
    calls, hooks = _count_calls({str(i): model.core.block(i).self_attention for i in range(2)})
    with torch.no_grad():
        model.eval()(_tokens())
    for h in hooks:
        h.remove()
    assert calls == ["0", "1", "0", "1"]


def test_foil_losses_averaged_over_executions(megatron_env):
    model, cfg = _model(**FOIL)
    n = 1 + 2 * 2 + 1  # prelude, D x L core executions, coda
    assert model.config.moe_aux_loss_coeff == pytest.approx(0.01 / n)
    assert model.config.moe_z_loss_coeff == pytest.approx(1e-3 / n)
    assert model.core.block(0).mlp.config.num_moe_experts == 8
    plain, _ = _model(**dict(FOIL, moe_loss_average_over_executions=False))
    assert plain.config.moe_aux_loss_coeff == pytest.approx(0.01)


def test_foil_routing_records_and_metrics(megatron_env):
    from megatron_lol.model.moe_metrics import summarise

    model, cfg = _model(**FOIL)
    with torch.no_grad():
        _, core = model.eval()(_tokens(), record_moe=True, return_core=True)
    recs = core.moe_records
    assert [(r.block, r.pass_index) for r in recs] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r.logits.shape == (64, 8) and (r.routing_map.sum(1) == 2).all() for r in recs)
    s = summarise(recs, 8, 2)
    assert 4 <= s["distinct_experts_per_token"] <= s["distinct_experts_cap"] == 2 * min(8, 2 * 2)
    assert [p["pass"] for p in s["by_pass"]] == [0, 1] and 1 / 8 <= s["b2"] <= 1 and s["mmr"] >= 1


# ------------------------------------------------------------------ metrics
def _rec(block, p, logits, k=2):
    from megatron_lol.model.core import MoERecord

    top = logits.topk(k, dim=-1).indices
    rmap = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
    return MoERecord(block, p, logits.float(), rmap)


def test_mmr_properties_stated_by_the_seed():
    from megatron_lol.model.moe_metrics import load_balance_b2, median_margin_ratio

    c = 3.0
    # top m = E/2 logits coincide -> R = 1, even though the router is not indifferent
    z = torch.tensor([[0.0, 0, 0, 0, -c, -c, -c, -c]])
    assert median_margin_ratio([z]) == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 8, generator=gen) * 2
    mmr = median_margin_ratio([logits])
    assert mmr > 1
    # a z + b: MMR -> MMR^a, B2 unchanged (same top-k selections)
    a, b = 1.7, -0.4
    assert median_margin_ratio([a * logits + b]) == pytest.approx(mmr**a, rel=1e-5)  # fp32 logits
    r1, r2 = _rec(0, 0, logits), _rec(0, 0, a * logits + b)
    assert load_balance_b2(r1.routing_map) == pytest.approx(load_balance_b2(r2.routing_map))
    # hand value: p = softmax(z), R = p_(1) / p_(4) for E = 8
    z = torch.tensor([[2.0, 1.0, 0.5, 0.25, 0.0, -1, -2, -3]])
    assert median_margin_ratio([z]) == pytest.approx(math.exp(2.0 - 0.25))


def test_b2_and_distinct_experts_by_hand():
    from megatron_lol.model.moe_metrics import distinct_experts_per_token, load_balance_b2

    E = 4
    uniform = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert load_balance_b2(uniform) == pytest.approx(1.0)
    one = torch.zeros(3, E, dtype=torch.bool)
    one[:, 0] = True
    assert load_balance_b2(one) == pytest.approx(1 / E)
    q = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)  # shares 2/4, 1/4, 1/4, 0
    assert load_balance_b2(q) == pytest.approx(1 / (4 * (0.25 + 1 / 16 + 1 / 16)))
    from megatron_lol.model.core import MoERecord

    def rec(b, p, rows):
        m = torch.tensor(rows, dtype=torch.bool)
        return MoERecord(b, p, torch.zeros(m.shape), m)

    # token 0: block 0 passes {0,1} then {0,1} -> 2; block 1 {2,3} then {0,1} -> 4: 6
    # token 1: block 0 {0,1} then {2,3} -> 4; block 1 {0,1} then {0,1} -> 2: 6 ... mean 6
    recs = [
        rec(0, 0, [[1, 1, 0, 0], [1, 1, 0, 0]]),
        rec(1, 0, [[0, 0, 1, 1], [1, 1, 0, 0]]),
        rec(0, 1, [[1, 1, 0, 0], [0, 0, 1, 1]]),
        rec(1, 1, [[1, 1, 0, 0], [1, 1, 0, 0]]),
    ]
    assert distinct_experts_per_token(recs) == pytest.approx(6.0)
    assert distinct_experts_per_token(recs[:2]) == pytest.approx(4.0)  # no looping: k x D


# ------------------------------------------------------------------ Accordion
def test_accordion_budget_k_runs_n_plus_k_layers(megatron_env):
    model, cfg = _model(**ACCORDION)
    blocks = {str(i): model.core.block(i).self_attention for i in range(3)}
    layers = dict(blocks, prelude=model.prelude["0"].self_attention, coda=model.coda["0"].self_attention)
    model.eval()
    outs = {}
    for k in (0, 1, 3):
        calls, hooks = _count_calls(layers)
        with torch.no_grad():
            outs[k] = model(_tokens(), budget=k)
        for h in hooks:
            h.remove()
        assert len(calls) == 1 + 3 + k + 1
        assert calls == ["prelude", "0", "1", "2"] + [str(i) for i in range(k)] + ["coda"]
    assert not torch.allclose(outs[0], outs[3])
    with pytest.raises(Exception, match="budget: 2 is not one of the model's budgets"):
        model(_tokens(), budget=2)


def test_accordion_k0_is_the_unlooped_model(megatron_env):
    acc, _ = _model(**dict(ACCORDION, second_pass_router="separate"))
    dense, _ = _model(**dict(ACCORDION, plan="dense", loop_window=None, core_layers=3, loop_budgets=[0]))
    shared = {n: p for n, p in dense.named_parameters()}
    for n, p in acc.named_parameters():  # the unlooped model's parameters are the same tensors' values
        if n in shared:
            assert torch.equal(p, shared[n]), n
    with torch.no_grad():
        assert torch.equal(acc.eval()(_tokens(), budget=0), dense.eval()(_tokens()))


def test_accordion_second_pass_gates_and_router(megatron_env):
    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.block_call import call_block
    from megatron_lol.model.windows import DocumentLayout

    model, cfg = _model(**dict(ACCORDION, second_pass_router="separate"))
    core = model.core
    assert core.loop_gates.shape == (3, 2, 32) and set(core.second_pass_routers.keys()) == {"0", "1", "2"}
    calls, hooks = _count_calls(dict(core.second_pass_routers.items()))
    first, fh = _count_calls({str(i): core.block(i).mlp.router for i in range(3)})
    x = _tokens()
    model.eval()
    with torch.no_grad():
        model(x, budget=3)
    for h in hooks + fh:
        h.remove()
    assert calls == ["0", "1", "2"] and first == ["0", "1", "2"]
    # with the gates at 1 and the shared router, the second pass is an ordinary layer call
    plain, _ = _model(**ACCORDION)
    docs = DocumentLayout.from_tokens(x, EOD)
    rope = plain.rotary(x.shape[1])
    mask = SegmentMask(segments=docs.doc_index)
    with torch.no_grad():
        h = plain.embedding(input_ids=x, position_ids=None)
        for layer in [plain.prelude["0"]] + [plain.core.block(i) for i in (0, 1, 2, 0)] + [plain.coda["0"]]:
            h, _ = call_block(layer, h, mask, rope)
        want = plain.output_layer(plain.final_norm(h))[0].transpose(0, 1)
        got = plain.eval()(x, budget=1)
        assert torch.allclose(got, want, atol=1e-5)
        # a zero gate removes the write: MLP gate 0 and attention gate 0 -> budget 1 == budget 0 at block 0
        plain.core.loop_gates.zero_()
        assert torch.allclose(plain(x, budget=1), plain(x, budget=0), atol=1e-6)
    # the gates are trained by the second pass only
    plain.core.loop_gates.data.fill_(1.0)
    plain.train()
    plain(x, labels=x, budget=0).mean().backward()
    assert plain.core.loop_gates.grad is None or plain.core.loop_gates.grad.abs().sum() == 0
    plain(x, labels=x, budget=3).mean().backward()
    assert plain.core.loop_gates.grad.abs().sum() > 0


def test_accordion_trains(megatron_env):
    model, cfg = _model(**ACCORDION)
    budgets = [0, 3, 1, 3, 0, 1, 3, 3]
    losses = _train(model, budget=lambda i: budgets[i])
    assert losses[-1] < losses[0] - 0.3, losses


def test_expert_bias_balancing_through_the_trainer(megatron_env, monkeypatch):
    """megatron-core's loss-free balancing (sigmoid scores, ``moe_router_enable_expert_bias``) in an Accordion:
    after an optimizer step every MoE router's bias (the layers' and the separate second-pass routers') moved
    by ``rate * sign(mean load - load)`` with the loads the step's routing produced; a config without sigmoid
    scores is refused in one line."""
    import importlib

    from test_parallel_lol import SEQ, SyntheticTokens, TinyTokenizer

    from megatron_lol.config import config_from_dict
    from megatron_lol.errors import ConfigError
    from megatron_lol.training.trainer import Trainer

    rate = 0.01
    model = dict(
        ACCORDION,
        hidden_size=32,
        num_attention_heads=4,
        window_size=8,
        window_shift=4,
        vocab_size=128,
        second_pass_router="separate",
        loop_budget=3,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=rate,
        moe_aux_loss_coeff=0.0,
    )
    with pytest.raises(
        ConfigError,
        match=r"^model\.moe\.router_enable_expert_bias: needs router_score_function: "
        r"sigmoid .*got softmax\)$",
    ):
        config_from_dict({"model": dict(model, moe_router_score_function="softmax")})
    cfg = config_from_dict(
        {
            "model": model,
            "training": dict(
                train_iters=2,
                micro_batch_size=1,
                global_batch_size=2,
                seq_length=SEQ,
                log_interval=100,
                eval_interval=100,
                eval_iters=0,
                seed=7,
            ),
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
        }
    )
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package shadows its name
    seen = []
    original = fmg.get_updated_expert_bias

    def spy(tokens, bias, update_rate):
        seen.append((tokens.clone(), bias.clone(), update_rate))
        return original(tokens, bias, update_rate)

    monkeypatch.setattr(fmg, "get_updated_expert_bias", spy)
    trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(16, 0), None, None)).setup()
    net = trainer.model
    routers = {n: m for n, m in net.named_modules() if getattr(m, "expert_bias", None) is not None}
    assert sorted(routers) == [
        "coda.0.mlp.router",
        "core.blocks.0.mlp.router",
        "core.blocks.1.mlp.router",
        "core.blocks.2.mlp.router",
        "core.second_pass_routers.0",
        "core.second_pass_routers.1",
        "core.second_pass_routers.2",
        "prelude.0.mlp.router",
    ]
    data = trainer.data_iterator(trainer.train_ds, 0)
    for step in range(2):
        trainer.train_step(data)
        tokens, before, update_rate = seen[-1]
        assert len(seen) == step + 1 and update_rate == rate and tokens.shape == (8, 4)
        # every router routed each of the step's tokens to top-2 experts (budget 3 runs every second pass)
        assert torch.equal(tokens.sum(dim=1), torch.full((8,), 2.0 * 2 * SEQ))
        after = torch.stack([m.expert_bias for m in routers.values()])
        order = [n for n, m in net.named_modules() if getattr(m, "expert_bias", None) is not None]
        assert list(routers) == order  # the spy's rows are in module order too
        want = before + rate * torch.sign(tokens.mean(dim=1, keepdim=True) - tokens)
        assert torch.equal(after, want)
    assert after.abs().max() > 0


def test_accordion_config_errors():
    from megatron_lol.config import config_from_dict
    from megatron_lol.config.schema import ConfigError

    def check(model, match, parallel=None, curriculum=None):
        raw = {"model": dict(ACCORDION, hidden_size=32, num_attention_heads=4, **model)}
        if parallel:
            raw["parallel"] = parallel
        if curriculum:
            raw["curriculum"] = curriculum
        with pytest.raises(ConfigError, match=match):
            config_from_dict(raw).validate(check_data=False)

    check({"loop_budgets": [0, 4]}, r"model.plan.budgets: every budget must be in \[0, window=3\]")
    check({"loop_budgets": [3, 0]}, "model.plan.budgets: must be increasing")
    check({"loop_budget": 2}, "model.plan.budget: 2 is not one of budgets")
    check({"second_pass_router": "own"}, "model.plan.second_pass_router: must be one of shared, separate")
    # rename_config: off (the deprecated keys, named by the messages)
    check({"dense_attention": "sliding"}, r"model.dense_attention='sliding': not used by plan accordion")
    check({"film": "depth"}, r"model.film='depth': not used by plan accordion \(an option of plan dense / looped")
    # rename_config: on
    with pytest.raises(
        ConfigError, match=r"model.plan.film is not an option of plan accordion \(its options: window, budgets"
    ):
        config_from_dict({"model": {"plan": {"kind": "accordion", "window": 3, "film": "depth"}}})
    check({}, "parallel.pipeline_model_parallel_size: plan accordion", parallel={"pipeline_model_parallel_size": 2})
    check({}, "curriculum.initial_depth: plan accordion", curriculum={"initial_depth": 2})
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size: plan lol shards its block library"):
        config_from_dict(
            {
                "model": dict(plan="lol", num_blocks=4, routed_depth=4, num_experts=4, moe_layers="all"),
                "parallel": {"expert_model_parallel_size": 2},
            }
        ).validate(check_data=False)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: megatron-core MoE layers with"):
        config_from_dict(
            {"model": dict(FOIL, hidden_size=32, num_attention_heads=4), "parallel": {"tensor_model_parallel_size": 2}}
        ).validate(check_data=False)
    with pytest.raises(ConfigError, match="model.untie_attention: not used by plan dense"):
        config_from_dict({"model": dict(plan="dense", untie_attention=True)}).validate(check_data=False)
    with pytest.raises(ConfigError, match="model.moe.core_num_experts: needs model.moe.layers: all"):
        config_from_dict(
            {
                "model": dict(
                    plan="looped", loop_layers=2, loop_count=2, num_experts=4, moe_layers="fixed", core_num_experts=8
                )
            }
        ).validate(check_data=False)
    with pytest.raises(ConfigError, match="model.moe.layers: plan foil loops a block of MoE layers"):
        config_from_dict({"model": dict(FOIL, moe_layers="fixed")}).validate(check_data=False)
    with pytest.raises(ConfigError, match="model.routed_depth: not used by plan foil"):
        config_from_dict({"model": dict(FOIL, routed_depth=4)}).validate(check_data=False)


# ------------------------------------------------------------------ training command + analyses
TINY = """\
model:
{model}
  hidden_size: 32
  num_attention_heads: 4
  ffn_hidden_size: 64
  n_prelude: 1
  n_coda: 1
  moe_layers: all
  num_experts: 4
  moe_ffn_hidden_size: 32
  moe_router_topk: 2
  make_vocab_size_divisible_by: 64
data:
  paths: [{prefix}]
  split: "80,20,0"
  tokenizer_type: SentencePieceTokenizer
  tokenizer_model: {tokenizer}
  cache_dir: {cache}
optimizer:
  lr: 3.0e-3
  min_lr: 3.0e-4
  lr_warmup_iters: 1
training:
  train_iters: 6
  micro_batch_size: 2
  global_batch_size: 4
  seq_length: 64
  log_interval: 3
  eval_interval: 6
  eval_iters: 2
  save: {save}
"""
FOIL_YAML = """\
  plan: foil
  foil_layers: 2
  foil_loops: 2
  foil_experts: 8
  untie_attention: true
  moe_z_loss_coeff: 1.0e-3
  moe_loss_average_over_executions: true"""
ACCORDION_YAML = """\
  plan: accordion
  loop_window: 3
  loop_budgets: [0, 1, 3]
  moe_shared_expert_intermediate_size: 32"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus_fixtures import indexed_corpus

    root = tmp_path_factory.mktemp("foil_accordion")
    prefix, tok = indexed_corpus(str(root), max_bytes=150_000, max_doc=4000, vocab_size=384)
    return {"root": root, "prefix": prefix, "tokenizer": tok}


def _train_cli(corpus, name: str, model_yaml: str):
    from test_analysis import _env

    root = corpus["root"]
    save = root / name
    cfg = root / f"{name}.yaml"
    cfg.write_text(
        TINY.format(
            model=model_yaml, prefix=corpus["prefix"], tokenizer=corpus["tokenizer"], cache=root / "cache", save=save
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", str(cfg)],
        cwd=str(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return save, metrics, proc.stdout


def _analyze(*argv) -> int:
    from megatron_lol.cli import main

    return main(["analyze", *map(str, argv)])


def test_foil_train_command_logs_routing_metrics_and_analyze(corpus, tmp_path, capsys):
    save, metrics, out = _train_cli(corpus, "foil", FOIL_YAML)
    logged = [m for m in metrics if "moe_routing" in m]
    assert [m["step"] for m in logged] == [3, 6]
    r = logged[-1]["moe_routing"]
    assert 2 * 2 <= r["distinct_experts_per_token"] <= r["distinct_experts_cap"] == 8
    assert len(r["by_pass"]) == 2 and r["mmr"] >= 1
    assert "U_t" in out and "MMR" in out
    dest = tmp_path / "moe"
    assert (
        _analyze("moe-routing", "--load", save, "--data-path", corpus["prefix"], "--max-examples", 12, "--output", dest)
        == 0
    )
    res = json.loads((dest / "moe_routing.json").read_text())
    assert res["shape"] == {"E": 8, "D": 2, "L": 2, "k": 2, "E_real": 16, "D_eff": 4, "E_eq": 32, "E_comp": 8}
    assert (dest / "moe_routing.png").stat().st_size > 1000
    assert _analyze("budgets", "--load", save, "--generate", "x", "--output", tmp_path / "b") == 2
    assert "budgets needs plan: accordion" in capsys.readouterr().err


def test_accordion_train_command_budgets_and_analyze(corpus, tmp_path, capsys):
    save, metrics, out = _train_cli(corpus, "accordion", ACCORDION_YAML)
    steps = [m for m in metrics if "loss" in m]
    budgets = [k for m in steps if "budgets" in m for k in m["budgets"]]
    assert budgets and set(budgets) <= {0, 1, 3}
    last = metrics[-1]
    assert set(last["eval_loss_by_budget"]) == {"0", "1", "3"}
    assert last["eval_loss"] == pytest.approx(sum(last["eval_loss_by_budget"].values()) / 3)
    # the Accordion paper's Table 1 mean: the endpoint budgets only
    assert last["eval_loss_endpoints"] == pytest.approx(
        (last["eval_loss_by_budget"]["0"] + last["eval_loss_by_budget"]["3"]) / 2
    )
    assert "eval by budget" in out and "eval endpoints mean" in out
    dest = tmp_path / "budgets"
    assert (
        _analyze(
            "budgets",
            "--load",
            save,
            "--data-path",
            corpus["prefix"],
            "--max-examples",
            8,
            "--generate",
            "def ",
            "--max-new-tokens",
            4,
            "--output",
            dest,
        )
        == 0
    )
    res = json.loads((dest / "budgets.json").read_text())
    assert set(res["loss_by_budget"]) == {"0", "1", "3"} and set(res["generation"]["by_budget"]) == {"0", "1", "3"}
    assert (dest / "budgets.png").exists()
    assert (
        _analyze(
            "moe-routing", "--load", save, "--data-path", corpus["prefix"], "--budget", 2, "--output", tmp_path / "m"
        )
        == 2
    )
    assert "--budget: 2 is not one of" in capsys.readouterr().err


def test_budget_sampling_is_deterministic_and_covers_all():
    from megatron_lol.config import config_from_dict

    cfg = config_from_dict(
        {"model": dict(ACCORDION, hidden_size=32, num_attention_heads=4, loop_budgets=[0, 3, 6, 9, 12], loop_window=12)}
    )
    plan = cfg.model.execution_plan()
    draws = [plan.sample_budget(cfg.training.seed, it, mb) for it in range(200) for mb in range(4)]
    # the same on every rank and in a resumed run
    assert draws == [
        cfg.model.execution_plan().sample_budget(cfg.training.seed, it, mb) for it in range(200) for mb in range(4)
    ]
    counts = {k: draws.count(k) for k in (0, 3, 6, 9, 12)}
    assert all(120 < c < 200 for c in counts.values()), counts  # uniform: 160 each
    assert len({plan.sample_budget(cfg.training.seed, 7, mb) for mb in range(16)}) > 1  # per micro-batch
    cfg.model.plan = dataclasses.replace(cfg.model.plan, budget=6)
    assert {cfg.model.execution_plan().sample_budget(cfg.training.seed, it, 0) for it in range(20)} == {6}
