"""Parameter counts: the analytic counter against real models, SPEC 1.5 through the
paper configs, and the ``megatron-lol params`` verb."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lol.config import load_config
from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.params import (
    BREAKDOWN_KEYS,
    attention_parameters,
    count_parameters,
    router_parameters,
)

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "examples" / "configs" / "paper"
M = 1e6


def paper_counts(name: str, vocab: int = 32000):
    cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
    assert cfg.model.vocab_size == vocab
    return cfg, count_parameters(cfg.model, cfg.model.vocab_size)


def near(n: int, figure_m: float, tol_m: float = 0.1) -> bool:
    return abs(n / M - figure_m) < tol_m


# ------------------------------------------------------------------ hand formulas
def test_router_formula_and_spec_golden():
    assert router_parameters(2048, 8) == 2048 * 8 + 64 + 16 == 16_464
    assert router_parameters(3, 2) == 3 * 2 + 4 + 4


def test_gqa_attention():
    m = ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2)
    # q: 64x64, k and v: 2 groups x 8 channels each, proj 64x64
    assert attention_parameters(m) == 64 * 64 + 2 * 64 * 16 + 64 * 64
    m = ModelConfig(hidden_size=64, num_attention_heads=4, kv_channels=32)
    assert attention_parameters(m) == 64 * 128 * 3 + 128 * 64


def test_moe_counts_and_active_conventions():
    base = dict(hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, n_prelude=1, n_coda=1,
                num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
    att = attention_parameters(ModelConfig(**base))
    expert = 3 * 16 * 8
    dense_mlp = 3 * 16 * 32
    # dense plan, every layer MoE: 2 fixed + 3 core layers
    c = count_parameters(ModelConfig(plan="dense", num_blocks=3, moe_layers="all", **base), 100)
    assert c.experts == 5 * 4 * expert and c.mlp == 0 and c.moe_router == 5 * 4 * 16
    assert c.linear_total == 5 * (att + 4 * expert)
    assert c.linear_active == c.linear_active_compute == 5 * (att + 2 * expert)
    # LoL with MoE fixed layers, L=3 < D=6: stored once counts 3 blocks, compute counts 6
    c = count_parameters(ModelConfig(plan="lol", num_blocks=3, routed_depth=6, moe_layers="fixed", **base), 100)
    assert c.active_blocks == 3
    assert c.linear_active == 2 * (att + 2 * expert) + 3 * (att + dense_mlp)
    assert c.linear_active_compute == 2 * (att + 2 * expert) + 6 * (att + dense_mlp)
    assert c.active_compute - c.active_per_token == 3 * c.block.active
    # L=8 > D=6: at most 6 distinct blocks per token, both conventions agree
    c = count_parameters(ModelConfig(plan="lol", num_blocks=8, routed_depth=6, **base), 100)
    assert c.active_blocks == 6 and c.active_per_token == c.active_compute
    assert c.total == sum(c.breakdown.values())
    assert c.active_with_embedding == c.active_per_token + c.embedding + c.output


# ------------------------------------------------------- against real models
@pytest.fixture(scope="module")
def build_model():
    from megatron_lol import platform as plat

    plat.setup_platform()
    plat.init_distributed()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    from megatron_lol.model.lol_model import LoLGPTModel

    def build(cfg: ModelConfig, vocab: int):
        return LoLGPTModel(cfg, vocab, eod_id=0)

    yield build
    ps.destroy_model_parallel()


def _category(name: str) -> str:
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output"
    if name.startswith("core.routers."):
        return "router"
    if name == "core.depth_vectors":
        return "depth_vectors"
    if name.startswith("core.film_"):
        return "film"
    if name == "core.injection_logit":
        return "injection"
    if "layernorm" in name or "layer_norm" in name or name.startswith("final_norm."):
        return "norms"
    if ".self_attention." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    raise AssertionError(f"unexpected parameter {name}")


SMALL = dict(hidden_size=32, num_attention_heads=4, n_prelude=1, n_coda=2, num_blocks=3, routed_depth=4,
             window_size=8, window_shift=4)
CASES = {
    "lol-tied": {},
    "lol-untied-router": dict(router_tied=False),
    "lol-film-depth": dict(film="depth"),
    "lol-film-depth-block-untied": dict(film="depth_block", router_tied=False),
    "lol-injection": dict(input_injection=True),
    "lol-tied-embeddings": dict(untie_embeddings_and_output_weights=False),
    "lol-gqa-kv-channels": dict(num_query_groups=2, kv_channels=16, ffn_hidden_size=96),
    "lol-no-fixed-layers-L-gt-D": dict(n_prelude=0, n_coda=0, num_blocks=5, routed_depth=3),
    "dense": dict(plan="dense"),
    "dense-strided-film-injection": dict(plan="dense", dense_attention="strided", film="depth",
                                         input_injection=True),
    "looped": dict(plan="looped", num_blocks=2, routed_depth=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_counter_matches_instantiated_model(build_model, case):
    cfg = ModelConfig(**{**SMALL, **CASES[case]})
    cfg.validate()
    vocab = 96
    model = build_model(cfg, vocab)
    counts = count_parameters(cfg, vocab)
    real = {k: 0 for k in BREAKDOWN_KEYS}
    total = 0
    for name, p in model.named_parameters():
        real[_category(name)] += p.numel()
        total += p.numel()
    assert total == counts.total
    expected = dict(counts.breakdown)
    expected["mlp"] += expected.pop("experts") + expected.pop("moe_router")  # no MoE here: both 0
    real_mlp = real.pop("experts") + real.pop("moe_router")
    real["mlp"] += real_mlp
    assert real == expected
    assert counts.non_embedding == total - real["embedding"] - real["output"]
    block = sum(p.numel() for p in model.core.blocks["0"].parameters())
    assert block == counts.block.total
    assert counts.linear_total == real["attention"] + real["mlp"]


# ------------------------------------------------------- SPEC 1.5 via paper configs
def test_single_block_golden():
    _, c = paper_counts("lol-360m-L2")
    assert near(c.block.linear, 12.85, 0.005)
    assert near(c.block.attention, 4.19, 0.005)
    assert near(c.block.mlp, 8.65, 0.005)


@pytest.mark.parametrize("L,figure", [(2, 128.5), (4, 154.1), (8, 205.5)])
def test_lol_360m_and_huginn(L, figure):
    cfg, lol = paper_counts(f"lol-360m-L{L}")
    assert (cfg.model.plan, cfg.model.num_blocks, cfg.model.routed_depth) == ("lol", L, 16)
    assert near(lol.linear_total, figure)
    # SPEC 1.5: norm gains, routers and per-depth vectors add under 0.05% (FiLM, on in
    # these runs, adds 2 x 16 x 2 x 1024 = 65,536 more)
    assert lol.film == 65_536
    assert (lol.non_embedding - lol.film - lol.linear_total) / lol.linear_total < 5e-4
    hcfg, hug = paper_counts(f"huginn-360m-{L}x{16 // L}")
    assert (hcfg.model.plan, hcfg.model.num_blocks, hcfg.model.routed_depth) == ("looped", L, 16)
    assert hug.linear_total == lol.linear_total
    assert near(hug.linear_total, figure)
    # stored-once active = stored for both; per execution both run 8 + 16 layers
    assert hug.linear_active == hug.linear_total == lol.linear_active
    assert hug.linear_active_compute == lol.linear_active_compute == 24 * lol.block.linear


def test_moe_baseline():
    cfg, c = paper_counts("moe-baseline")
    m = cfg.model
    assert m.n_prelude + m.num_blocks + m.n_coda == 24 and m.plan == "dense" and m.moe_layers == "all"
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk) == (3, 1408, 2)
    assert near(c.linear_total, 412.1)
    assert near(c.linear_active, 308.3)
    assert c.linear_active == c.linear_active_compute


def test_lol_vs_moe():
    cfg, c = paper_counts("lol-vs-moe")
    m = cfg.model
    assert (m.n_prelude, m.n_coda, m.num_blocks, m.routed_depth, m.moe_layers) == (4, 4, 24, 16, "fixed")
    assert near(c.linear_total, 445.6)
    assert near(c.linear_active, 308.3)
    _, moe = paper_counts("moe-baseline")
    assert c.linear_active == moe.linear_active  # "the active counts match exactly"
    assert c.linear_active == c.linear_active_compute  # L >= D: conventions agree


def test_math_1b():
    cfg, c = paper_counts("math-1b-lol")
    m = cfg.model
    assert (m.hidden_size, m.ffn_hidden_size, m.num_blocks, m.routed_depth) == (2048, 5632, 8, 8)
    assert near(c.block.linear, 51.4)
    assert c.router_each == 16_464 and c.router == 16_464  # tied: one router
    for att in ("full", "sliding", "strided"):
        dcfg, d = paper_counts(f"math-1b-dense-{att}")
        assert dcfg.model.plan == "dense" and dcfg.model.dense_attention == att
        assert d.linear_total == c.linear_total  # 16 distinct layers each
        assert d.linear_active == c.linear_active


def test_paper_configs_load_with_window_settings():
    names = sorted(p.stem for p in PAPER.glob("*.yaml"))
    assert len(names) == 12
    for name in names:
        cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
        assert (cfg.model.window_size, cfg.model.window_shift, cfg.training.seq_length) == (128, 64, 1024)
        assert cfg.data.paths and cfg.training.train_iters > 0


# ------------------------------------------------------------------ the CLI
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_lol", "params", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_json():
    out = _cli("--config", str(PAPER / "lol-vs-moe.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert near(d["linear_total"], 445.6) and near(d["linear_active"], 308.3)
    _, c = paper_counts("lol-vs-moe")
    assert d["total"] == c.total and d["vocab_size"] == 32000
    assert d["block"]["linear"] == c.block.linear


def test_cli_overrides_vocab_and_table():
    out = _cli("--config", str(PAPER / "lol-360m-L8.yaml"), "--json", "--set", "model.num_blocks=4",
               "--vocab-size", "50257")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["vocab_size_given"] == 50257 and d["vocab_size"] == 50304  # padded to 128
    assert near(d["linear_total"], 154.1)
    assert d["embedding"] == 50304 * 1024 == d["output"]
    out = _cli("--config", str(PAPER / "lol-360m-L8.yaml"))
    assert out.returncode == 0, out.stderr
    assert "205.52M" in out.stdout and "non-embedding" in out.stdout and "12.85M" in out.stdout


def test_cli_missing_vocab_names_the_key():
    out = _cli("--config", str(PAPER / "lol-360m-L2.yaml"), "--set", "model.vocab_size=null")
    assert out.returncode == 2
    assert "model.vocab_size" in out.stderr and "--vocab-size" in out.stderr
