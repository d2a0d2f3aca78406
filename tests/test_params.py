"""Parameter counts: the analytic counter against real models, the golden sizes of
docs/model.md ("Golden facts") through the paper configs, Foil and Accordion through
theirs, and the
``megatron-lol params`` verb."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_lol.config import load_config
from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.params import BREAKDOWN_KEYS, count_parameters

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "examples" / "configs" / "paper"
M = 1e6


# the English FineWeb runs use GPT-NeoX tokenization: 50,277 tokens, padded to a multiple of 128 (as
# Megatron-LM pads them at TP 1 and the trainer at every TP); the others keep 32,000 pieces
FINEWEB = {
    "lol-360m-L2",
    "lol-360m-L4",
    "lol-360m-L8",
    "huginn-360m-2x8",
    "huginn-360m-4x4",
    "huginn-360m-8x2",
    "lol-vs-moe",
    "moe-baseline",
}
NEOX_TOKENS, NEOX_PADDED = 50_277, 50_304


def paper_counts(name: str, vocab: int = None):
    vocab = vocab or (NEOX_PADDED if name in FINEWEB else 32000)
    cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
    assert cfg.model.vocab_size == vocab
    assert vocab % cfg.model.make_vocab_size_divisible_by == 0  # built unpadded
    return cfg, count_parameters(cfg.model, cfg.model.vocab_size)


def near(n: int, figure_m: float, tol_m: float = 0.1) -> bool:
    return abs(n / M - figure_m) < tol_m


def attention_parameters(m: ModelConfig) -> int:
    return count_parameters(m, 64).block.attention


# ------------------------------------------------- the walk against hand formulas
def test_router_formula_and_spec_golden():
    # one router (W_r, b_r, W_n, b_n): d*L + L^2 + 2L (docs/model.md, "Router")
    big = ModelConfig(hidden_size=2048, num_attention_heads=16, num_blocks=8, routed_depth=8, ffn_hidden_size=64)
    assert count_parameters(big, 64).router_each == 2048 * 8 + 64 + 16 == 16_464
    small = ModelConfig(hidden_size=4, num_attention_heads=2, num_blocks=2, routed_depth=2, ffn_hidden_size=8)
    assert count_parameters(small, 64).router_each == 4 * 2 + 4 + 4


def test_router_only_tokens_add_their_router_table():
    """router_only_tokens: n x d router embeddings, counted with the router, not as an embedding."""
    plain = ModelConfig(hidden_size=64, num_attention_heads=4, num_blocks=3, routed_depth=2, ffn_hidden_size=64)
    marked = replace(plain, router_only_tokens=[5, 6, 7], router_only_filler=8)
    a, b = count_parameters(plain, 64), count_parameters(marked, 64)
    assert b.router - a.router == 3 * 64 and b.total - a.total == 3 * 64
    assert b.embedding == a.embedding and b.router_each == a.router_each


def test_gqa_attention():
    m = ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2)
    # q: 64x64, k and v: 2 groups x 8 channels each, proj 64x64
    assert attention_parameters(m) == 64 * 64 + 2 * 64 * 16 + 64 * 64
    m = ModelConfig(hidden_size=64, num_attention_heads=4, kv_channels=32)
    assert attention_parameters(m) == 64 * 128 * 3 + 128 * 64


def test_moe_counts_and_active_conventions():
    base = dict(
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        n_prelude=1,
        n_coda=1,
        num_experts=4,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
    )
    att = attention_parameters(ModelConfig(**base))
    expert = 3 * 16 * 8
    dense_mlp = 3 * 16 * 32
    # dense plan, every layer MoE: 2 fixed + 3 core layers
    c = count_parameters(ModelConfig(plan="dense", core_layers=3, moe_layers="all", **base), 100)
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
    if name == "core.loop_gates":
        return "loop_gates"
    if name.startswith("core.pass_attention."):  # Foil: one (norm + attention) set per (block, pass >= 1)
        return "pass_attention"
    if name.startswith("core.second_pass_routers."):  # Accordion: second_pass_router: separate
        return "second_pass_router"
    if "layernorm" in name or "layer_norm" in name or name.startswith("final_norm."):
        return "norms"
    if ".self_attention." in name:
        return "attention"
    if ".mlp.router." in name:
        return "moe_router"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp." in name:
        return "mlp"
    raise AssertionError(f"unexpected parameter {name}")


SMALL = dict(hidden_size=32, num_attention_heads=4, n_prelude=1, n_coda=2, window_size=8, window_shift=4)
LOL = dict(num_blocks=3, routed_depth=4)
CASES = {
    "lol-tied": LOL,
    "lol-untied-router": dict(LOL, router_tied=False),
    "lol-film-depth": dict(LOL, film="depth"),
    "lol-film-depth-block-untied": dict(LOL, film="depth_block", router_tied=False),
    "lol-injection": dict(LOL, input_injection=True),
    "lol-tied-embeddings": dict(LOL, untie_embeddings_and_output_weights=False),
    "lol-gqa-kv-channels": dict(LOL, num_query_groups=2, kv_channels=16, ffn_hidden_size=96),
    "lol-no-fixed-layers-L-gt-D": dict(n_prelude=0, n_coda=0, num_blocks=5, routed_depth=3),
    "dense": dict(plan="dense", core_layers=3),
    "dense-strided-film-injection": dict(
        plan="dense", core_layers=3, dense_attention="strided", film="depth", input_injection=True
    ),
    "looped": dict(plan="looped", loop_layers=2, loop_count=3),
    "moe-dense-fixed": dict(plan="dense", core_layers=3, moe_layers="fixed", num_experts=4, moe_ffn_hidden_size=16),
    # Foil: looped MoE core with its own expert count, 2 passes, attention untied / tied
    "foil-untied": dict(
        plan="foil",
        foil_layers=2,
        foil_loops=2,
        moe_layers="all",
        num_experts=4,
        foil_experts=6,
        moe_ffn_hidden_size=16,
        untie_attention=True,
        moe_z_loss_coeff=1e-3,
        moe_loss_average_over_executions=True,
    ),
    "foil-tied": dict(
        plan="foil",
        foil_layers=2,
        foil_loops=2,
        moe_layers="all",
        num_experts=4,
        foil_experts=6,
        moe_ffn_hidden_size=16,
        untie_attention=False,
        moe_z_loss_coeff=1e-3,
    ),
    # Accordion: shared expert, separate second-pass router, loop gates, GQA
    "accordion": dict(
        plan="accordion",
        loop_window=3,
        loop_budgets=[0, 1, 3],
        moe_layers="all",
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        second_pass_router="separate",
        loop_gates=True,
        num_query_groups=2,
        kv_channels=16,
    ),
    "accordion-shared-router-no-gates": dict(
        plan="accordion",
        loop_window=3,
        loop_budgets=[0, 2],
        moe_layers="all",
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        loop_gates=False,
    ),
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
    assert real == counts.breakdown
    assert counts.non_embedding == total - real["embedding"] - real["output"]
    # one stored block (its own attention, MLP / experts, router, norms; not its extra passes' parts)
    block = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith("core.blocks.0.") and _category(name) not in ("pass_attention", "second_pass_router")
    )
    assert block == counts.block.total
    sets = counts.pass_attention_sets
    pass_linear = real["pass_attention"] - sets * cfg.hidden_size  # minus the sets' norm gains
    assert counts.linear_total == (
        real["attention"] + real["mlp"] + real["experts"] + real["shared_experts"] + pass_linear
    )
    if cfg.moe.layers == "all":
        E = cfg.core_experts
        assert model.core.blocks["0"].mlp.router.weight.shape == (E, cfg.hidden_size)


# ------------------------------------------- docs/model.md golden sizes via paper configs
def test_single_block_golden():
    _, c = paper_counts("lol-360m-L2")
    assert near(c.block.linear, 12.85, 0.005)
    assert near(c.block.attention, 4.19, 0.005)
    assert near(c.block.mlp, 8.65, 0.005)


@pytest.mark.parametrize("L,figure", [(2, 128.5), (4, 154.1), (8, 205.5)])
def test_lol_360m_and_huginn(L, figure):
    cfg, lol = paper_counts(f"lol-360m-L{L}")
    assert (cfg.model.plan.kind, cfg.model.plan.num_blocks, cfg.model.plan.routed_depth) == ("lol", L, 16)
    assert near(lol.linear_total, figure)
    # docs/model.md, "Parameter accounting": norm gains, routers and per-depth vectors add under 0.05% (FiLM, on in
    # these runs, adds 2 x 16 x 2 x 1024 = 65,536 more)
    assert lol.film == 65_536
    assert (lol.non_embedding - lol.film - lol.linear_total) / lol.linear_total < 5e-4
    hcfg, hug = paper_counts(f"huginn-360m-{L}x{16 // L}")
    assert (hcfg.model.plan.kind, hcfg.model.plan.layers, hcfg.model.plan.loops) == ("looped", L, 16 // L)
    assert hug.linear_total == lol.linear_total
    assert near(hug.linear_total, figure)
    # stored-once active = stored for both; per execution both run 8 + 16 layers
    assert hug.linear_active == hug.linear_total == lol.linear_active
    assert hug.linear_active_compute == lol.linear_active_compute == 24 * lol.block.linear


def test_moe_baseline():
    cfg, c = paper_counts("moe-baseline")
    m = cfg.model
    assert m.n_prelude + m.plan.layers + m.n_coda == 24 and m.plan.kind == "dense" and m.moe.layers == "all"
    assert (m.moe.num_experts, m.moe.ffn_hidden_size, m.moe.router_topk) == (3, 1408, 2)
    assert near(c.linear_total, 412.1)
    assert near(c.linear_active, 308.3)
    assert c.linear_active == c.linear_active_compute


def test_lol_vs_moe():
    cfg, c = paper_counts("lol-vs-moe")
    m = cfg.model
    assert (m.n_prelude, m.n_coda, m.plan.num_blocks, m.plan.routed_depth, m.moe.layers) == (4, 4, 24, 16, "fixed")
    assert near(c.linear_total, 445.6)
    assert near(c.linear_active, 308.3)
    _, moe = paper_counts("moe-baseline")
    assert c.linear_active == moe.linear_active  # "the active counts match exactly"
    assert c.linear_active == c.linear_active_compute  # L >= D: conventions agree


def test_math_1b():
    cfg, c = paper_counts("math-1b-lol")
    m = cfg.model
    assert (m.hidden_size, m.ffn_hidden_size, m.plan.num_blocks, m.plan.routed_depth) == (2048, 5632, 8, 8)
    assert near(c.block.linear, 51.4)
    assert c.router_each == 16_464 and c.router == 16_464  # tied: one router
    for att in ("full", "sliding", "strided"):
        dcfg, d = paper_counts(f"math-1b-dense-{att}")
        assert dcfg.model.plan.kind == "dense" and dcfg.model.plan.attention == att
        assert d.linear_total == c.linear_total  # 16 distinct layers each
        assert d.linear_active == c.linear_active


@pytest.mark.parametrize("name", ["sudoku-lol", "maze-lol"])
def test_sudoku_and_maze_released_shapes(name):
    """The released scripts' shape (the LoL article: width 512, 8 heads, 16 library blocks, depth 16, 4 + 4
    fixed layers; "At width 512 a block is 3.4M parameters, so the 24 stored blocks come to about 82M")."""
    cfg, c = paper_counts(name)
    m = cfg.model
    assert (m.hidden_size, m.num_attention_heads, m.plan.num_blocks, m.plan.routed_depth, m.n_prelude, m.n_coda) == (
        512,
        8,
        16,
        16,
        4,
        4,
    )
    assert near(c.block.linear, 3.4, 0.05) and near(c.linear_total, 82, 0.5)


FOIL = ["foil-base", "foil-3", "foil-2", "foil-1", "foil-base-tied", "proto-foil-3", "proto-foil-2", "proto-foil-1"]
ACCORDION = ["accordion-6b-a0.5b", "accordion-1.61b"]


def test_paper_configs_load_with_window_settings():
    names = sorted(p.stem for p in PAPER.glob("*.yaml"))
    assert len(names) == 25
    assert set(FOIL + ACCORDION) <= set(names)
    synthetic = {"sudoku-lol": 128, "maze-lol": 64}  # docs/model.md, "Windows": sudoku 128/64, mazes 64/32
    for name in names:
        cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
        assert cfg.data.paths and (cfg.training.train_iters or 0) + (cfg.training.train_flops or 0) > 0
        if name in FOIL:
            assert cfg.training.seq_length == 4096 and cfg.model.plan.attention == "full"
        elif name in ACCORDION:
            assert cfg.training.seq_length == 8192
        elif name in synthetic:
            assert (cfg.model.plan.windows.size, cfg.model.plan.windows.shift) == (
                synthetic[name],
                synthetic[name] // 2,
            )
        else:
            assert (cfg.model.plan.windows.size, cfg.model.plan.windows.shift, cfg.training.seq_length) == (
                128,
                64,
                1024,
            )


# ------------------------------------------------------- Foil (docs/model.md, "Foil")
# (config, (E, D, L), untied attention, the Foil paper's figure in M; None: the paper gives only the
# 490.8-520.2M range)
FOIL_TABLE = {
    "foil-base": ((8, 8, 2), True, 553.7),
    "foil-3": ((16, 4, 4), True, 553.7),
    "foil-2": ((32, 2, 8), True, 553.7),
    "foil-1": ((64, 1, 16), True, 553.7),
    "foil-base-tied": ((8, 8, 2), False, 520.2),
    "proto-foil-3": ((16, 4, 4), False, None),
    "proto-foil-2": ((32, 2, 8), False, None),
    "proto-foil-1": ((64, 1, 16), False, 490.8),
}


@pytest.mark.parametrize("name", FOIL)
def test_foil_configs(name):
    (E, D, L), untied, figure = FOIL_TABLE[name]
    cfg, c = paper_counts(name, vocab=49152)
    m = cfg.model
    plan = m.execution_plan()
    assert (m.plan.kind, m.core_experts, plan.num_stored_blocks, plan.loop_passes, plan.untie_attention) == (
        "foil",
        E,
        D,
        L,
        untied,
    )
    assert (m.plan.experts, m.plan.layers, m.plan.loops) == (E, D, L)
    assert (m.hidden_size, m.num_attention_heads, m.moe.ffn_hidden_size, m.moe.router_topk) == (1024, 16, 1536, 2)
    assert (m.n_prelude, m.n_coda, m.moe.num_experts, m.moe.layers) == (1, 1, 8, "all")
    assert (m.moe.aux_loss_coeff, m.moe.z_loss_coeff, m.moe.loss_average_over_executions) == (0.01, 0.001, True)
    # the Foil paper's accounting: E_real = E*D, D_eff = D*L, E_eq = E*D*L, E_comp = k*D*L
    acc = c.loop_accounting
    assert (acc["E_real"], acc["D_eff"], acc["E_eq"], acc["E_comp"]) == (64, 16, E * D * L, 32)
    assert acc["E_eq"] == {8: 128, 16: 256, 32: 512, 64: 1024}[E]
    # hand check: experts 8*8*3*1024*1536 in every shape, 4*1024^2 per attention set
    expert = 3 * 1024 * 1536
    attention_set = 4 * 1024 * 1024
    assert c.block.experts == E * expert and D * c.block.experts == 64 * expert == 301_989_888
    assert c.block.moe_router == E * 1024
    assert c.pass_attention_sets == (D * (L - 1) if untied else 0)
    assert c.pass_attention == c.pass_attention_sets * (attention_set + 1024)  # + each set's input norm
    cols = c.seed_columns
    assert cols["core_experts_and_routers"] == 64 * expert + 64 * 1024
    assert cols["core_attention"] == (16 if untied else D) * attention_set + c.pass_attention_sets * 1024
    assert cols["head_and_tail"] == 2 * (8 * expert + attention_set + 8 * 1024 + 2 * 1024)
    assert cols["other"] == 2 * 49152 * 1024 == 100_663_296
    norms = 2 * 2 * 1024 + D * 2 * 1024 + 1024  # fixed layers, core blocks, final norm
    assert c.total == sum(cols.values()) + D * 2 * 1024 + 1024
    assert c.total == (
        64 * expert
        + 64 * 1024
        + (16 if untied else D) * attention_set
        + c.pass_attention_sets * 1024
        + 2 * (8 * expert + attention_set + 8 * 1024)
        + 100_663_296
        + norms
    )
    if figure is not None:
        assert abs(c.total / M - figure) / figure < 0.005
        assert near(c.total, figure, 0.1)
    # compute is the same for all shapes: 16 core executions of top-2 experts + one attention each
    assert c.linear_active_compute == 2 * (attention_set + 2 * expert) + 16 * (attention_set + 2 * expert)


def test_foil_family_totals():
    totals = {name: paper_counts(name, vocab=49152)[1].total for name in FOIL}
    # untying restores exactly the discarded attention sets: Base and the Foils differ only by the
    # norm gains (a stored layer has two, an extra pass set one)
    untied = [totals[n] for n in ("foil-base", "foil-3", "foil-2", "foil-1")]
    assert [untied[0] - u for u in untied] == [0, 4 * 1024, 6 * 1024, 7 * 1024]
    # the tied controls span the Foil paper's 490.8M (proto-Foil-1) to 520.2M (Base-tied), decreasing with flattening
    tied = [totals[n] for n in ("foil-base-tied", "proto-foil-3", "proto-foil-2", "proto-foil-1")]
    assert tied == sorted(tied, reverse=True)
    assert near(tied[0], 520.2, 0.05) and near(tied[-1], 490.8, 0.05)
    # each flattening step (E, D, L) -> (2E, D/2, 2L) drops D/2 attention sets (and those layers' two
    # norm gains); experts and routers stay (E*D fixed)
    for (a, b), dropped in zip(zip(tied, tied[1:]), (4, 2, 1)):
        assert a - b == dropped * (4 * 1024 * 1024 + 2 * 1024)


# ------------------------------------------------------- Accordion (docs/model.md, "Accordion")
ACCORDION_TABLE = {
    # name: (hidden, Q, KV, expert hidden, vocab, total B, active B)
    "accordion-6b-a0.5b": (1536, 12, 4, 384, 128_000, 6.03, 0.54),
    "accordion-1.61b": (768, 6, 2, 192, 129_280, 1.61, 0.14),
}


@pytest.mark.parametrize("name", ACCORDION)
def test_accordion_configs(name):
    h, nq, nkv, f, vocab, total_b, active_b = ACCORDION_TABLE[name]
    cfg, c = paper_counts(name, vocab=vocab)
    m = cfg.model
    assert (m.plan.kind, m.n_prelude, m.plan.window, m.n_coda, m.plan.budgets) == (
        "accordion",
        6,
        12,
        6,
        [0, 3, 6, 9, 12],
    )
    assert (m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (h, nq, nkv, 128)
    assert (m.moe.num_experts, m.moe.router_topk, m.moe.ffn_hidden_size, m.moe.shared_expert_intermediate_size) == (
        128,
        8,
        f,
        f,
    )
    # by hand, per layer: GQA attention, 128 SwiGLU experts, the shared expert, the router
    attention = h * (nq * 128 + 2 * nkv * 128) + nq * 128 * h
    expert = 3 * h * f
    assert c.block.attention == c.prelude_layer.attention == attention
    assert c.block.experts == 128 * expert and c.block.shared_expert == expert and c.block.moe_router == 128 * h
    assert c.experts == 24 * 128 * expert and c.shared_experts == 24 * expert
    assert c.loop_gates == 12 * 2 * h and c.second_pass_router == 0
    embeddings = 2 * vocab * h
    norms = 24 * 2 * h + h
    assert c.total == 24 * (attention + 129 * expert + 128 * h) + embeddings + norms + c.loop_gates
    # the Accordion paper's active: one unlooped pass, embedding and head excluded -- attention + top-8 routed experts
    # + shared expert + router per layer (our figure adds the norm gains)
    per_layer = attention + 8 * expert + expert + 128 * h
    assert c.active_per_token == 24 * per_layer + norms
    assert round(c.total / 1e9, 2) == total_b and round(c.active_per_token / 1e9, 2) == active_b
    assert abs(c.total / 1e9 - total_b) / total_b < 0.005
    if name == "accordion-6b-a0.5b":  # 0.14B (two digits) does not resolve 0.5%
        assert abs(c.active_per_token / 1e9 - active_b) / active_b < 0.005
    # budgets: k extra executions of block-sized layers (+ their gates); k = 0 is the active figure
    assert [b["layer_executions"] for b in c.budgets] == [24, 27, 30, 33, 36]
    assert c.budgets[0]["active_compute"] == c.active_per_token
    for b in c.budgets:
        assert b["active_compute"] == c.active_per_token + b["k"] * (c.block.active + 2 * h)
    assert c.active_compute == c.budgets[-1]["active_compute"]
    # a separate second-pass router adds one router per window layer, nothing to the unlooped pass
    sep = count_parameters(replace(m, plan=replace(m.plan, second_pass_router="separate")), vocab)
    assert sep.total - c.total == sep.second_pass_router == 12 * 128 * h
    assert sep.active_per_token == c.active_per_token


# ------------------------------------------------------------------ the CLI
def _cli(*args, process: bool = False):
    """``megatron-lol params ARGS``: in this process (counting builds need megatron-core, whose import a
    child process would pay again), or as its own process with ``process=True``."""
    if process:
        return subprocess.run(
            [sys.executable, "-m", "megatron_lol", "params", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    from megatron_lol.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["params", *args])
        except SystemExit as exc:  # argparse and CLI errors
            code = exc.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_json():
    out = _cli("--config", str(PAPER / "lol-vs-moe.yaml"), "--json", process=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert near(d["linear_total"], 445.6) and near(d["linear_active"], 308.3)
    _, c = paper_counts("lol-vs-moe")
    assert d["total"] == c.total and d["vocab_size"] == NEOX_PADDED
    assert d["block"]["linear"] == c.block.linear


def test_cli_overrides_vocab_and_table():
    out = _cli(
        "--config", str(PAPER / "lol-360m-L8.yaml"), "--json", "--set", "model.num_blocks=4", "--vocab-size", "50257"
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["vocab_size_given"] == 50257 and d["vocab_size"] == 50304  # padded to 128
    assert near(d["linear_total"], 154.1)
    assert d["embedding"] == 50304 * 1024 == d["output"]
    out = _cli("--config", str(PAPER / "lol-360m-L8.yaml"))
    assert out.returncode == 0, out.stderr
    assert "205.52M" in out.stdout and "non-embedding" in out.stdout and "12.85M" in out.stdout


def test_cli_foil_and_accordion():
    out = _cli("--config", str(PAPER / "foil-2.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["loop_accounting"]["shape"] == "(32,2,8)"
    assert {k: d["loop_accounting"][k] for k in ("E_real", "D_eff", "E_eq", "E_comp")} == {
        "E_real": 64,
        "D_eff": 16,
        "E_eq": 512,
        "E_comp": 32,
    }
    assert d["pass_attention_sets"] == 14 and near(d["total"], 553.7, 0.1)
    assert d["seed_columns"]["other"] == 100_663_296
    out = _cli("--config", str(PAPER / "foil-2.yaml"))
    assert out.returncode == 0, out.stderr
    for text in ("(32,2,8)", "E_real = E*D", "E_eq = E*D*L", "E_comp = k*D*L", "pass attention", "553.75M"):
        assert text in out.stdout, text
    out = _cli("--config", str(PAPER / "accordion-6b-a0.5b.yaml"))
    assert out.returncode == 0, out.stderr
    for text in ("unlooped k=0 pass", "shared experts", "loop gates", "k=12: 36 layer executions", "537.99M"):
        assert text in out.stdout, text
    out = _cli("--config", str(PAPER / "accordion-1.61b.yaml"), "--json")
    d = json.loads(out.stdout)
    assert [b["k"] for b in d["budgets"]] == [0, 3, 6, 9, 12] and round(d["total"] / 1e9, 2) == 1.61


def test_fineweb_configs_name_the_gpt_neox_tokenizer():
    """The paper's tokenizer for English FineWeb, by Hub name through the HF tokenizer type; the rows are
    the trainer's padding of its 50,277 tokens (so params / FLOP counts equal a run's without the file)."""
    from megatron_lol.model.lol_model import padded_vocab_size

    assert padded_vocab_size(NEOX_TOKENS, 128) == NEOX_PADDED
    for name in sorted(FINEWEB):
        cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
        d = cfg.data
        assert (d.tokenizer_type, d.tokenizer_model) == ("HuggingFaceTokenizer", "EleutherAI/gpt-neox-20b"), name
        assert d.tokenizer_on_hub() and cfg.model.make_vocab_size_divisible_by == 128
        assert cfg.model.vocab_size == padded_vocab_size(NEOX_TOKENS, cfg.model.make_vocab_size_divisible_by)


def test_cli_missing_vocab_names_the_key():
    out = _cli("--config", str(PAPER / "math-1b-lol.yaml"), "--set", "model.vocab_size=null")
    assert out.returncode == 2
    assert "model.vocab_size" in out.stderr and "--vocab-size" in out.stderr
