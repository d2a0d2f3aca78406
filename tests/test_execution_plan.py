"""Execution plans: the one definition of every model's schedule (``megatron_lol.plan``).

Each plan's steps, the Accordion budget rule, the exact growth period, the
plan-specific config keys (and the deprecated spelling, which is read), and the
schedule every consumer reads from the plan: the trainer, the FLOP model, the
parameter counter and the HF export.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest

from megatron_lol.config import ModelConfig, config_from_dict, load_config
from megatron_lol.config.migration import ConfigDeprecationWarning
from megatron_lol.errors import ConfigError
from megatron_lol.plan import build_plan, depth_at, growth_period

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "examples" / "configs" / "paper"
BASE = dict(hidden_size=32, num_attention_heads=4, window_size=8, window_shift=4)


def _plan(**model):
    return config_from_dict({"model": dict(BASE, **model)}).model.execution_plan()


def _shape(plan):
    return [(s.depth, s.block, s.pass_index, s.attention) for s in plan.steps()]


def test_each_plan_kind_steps():
    dense = _plan(plan="dense", core_layers=3, dense_attention="sliding")
    assert _shape(dense) == [(1, 0, 0, "sliding"), (2, 1, 0, "sliding"), (3, 2, 0, "sliding")]
    assert (dense.num_stored_blocks, dense.depth, dense.routed, dense.gathers_sequence) == (3, 3, False, False)

    looped = _plan(plan="looped", loop_layers=2, loop_count=3)
    assert [(s.block, s.pass_index) for s in looped.steps()] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert looped.untied_attention_sets() == [] and looped.loop_passes == 3

    foil = _plan(plan="foil", foil_layers=2, foil_loops=2, foil_experts=6, moe_layers="all", num_experts=4)
    assert foil.untied_attention_sets() == [(0, 1), (1, 1)] and foil.core_experts == 6
    assert not foil.pipeline_ok and not foil.shards_library
    tied = _plan(
        plan="foil", foil_layers=2, foil_loops=2, foil_experts=6, moe_layers="all", num_experts=4, untie_attention=False
    )
    assert tied.untied_attention_sets() == [] and tied.pipeline_ok

    lol = _plan(plan="lol", num_blocks=3, routed_depth=5)
    assert _shape(lol) == [(d, None, 0, "window") for d in range(1, 6)]
    assert lol.routed and lol.shards_library and lol.gathers_sequence and lol.num_stored_blocks == 3

    strided = _plan(plan="dense", core_layers=2, dense_attention="strided")
    assert strided.gathers_sequence and not strided.routed


def test_accordion_budget_rule_lives_in_the_plan():
    acc = _plan(
        plan="accordion",
        loop_window=3,
        loop_budgets=[0, 1, 3],
        moe_layers="all",
        num_experts=4,
        second_pass_router="separate",
    )
    steps = acc.steps()
    assert [(s.block, s.pass_index, s.gated, s.separate_router) for s in steps] == [
        (0, 0, False, False),
        (1, 0, False, False),
        (2, 0, False, False),
        (0, 1, True, True),
        (1, 1, True, True),
        (2, 1, True, True),
    ]
    assert [acc.depth_for(k) for k in (0, 1, 3)] == [3, 4, 6]
    assert acc.resolve_budget(None) == 3 and acc.eval_budgets() == [0, 1, 3]
    assert acc.steps(acc.depth_for(1))[-1].block == 0
    with pytest.raises(ConfigError, match=r"^budget: 2 is not one of the model's budgets \[0, 1, 3\]$"):
        acc.depth_for(2)
    fixed = _plan(plan="accordion", loop_window=3, loop_budgets=[0, 1, 3], loop_budget=1)
    assert fixed.resolve_budget(None) == 1 and fixed.eval_budgets() == [1]
    assert {fixed.sample_budget(1, it, m) for it in range(10) for m in range(4)} == {1}
    with pytest.raises(ConfigError, match="only plan accordion has a loop budget"):
        _plan(plan="lol").resolve_budget(1)


def test_growth_period_is_exact():
    assert growth_period(0.29, 100) == 29  # 0.29 * 100 is 28.999999999999996 in binary floating point
    assert growth_period(0.75, 800) == 600 and growth_period(1, 7) == 7
    # the trainer's depth at each step uses it: full depth from step 29 on
    assert depth_at(28, 16, 1, 0.29, 100) < 16 and depth_at(29, 16, 1, 0.29, 100) == 16
    assert depth_at(5, 16, None, 0.29, 100) == 16
    cfg = config_from_dict(
        {
            "model": dict(BASE, num_blocks=4, routed_depth=16),
            "curriculum": {"initial_depth": 1, "growth_fraction": 0.29},
            "training": {"train_iters": 100},
        }
    )
    from megatron_lol.training.trainer import Trainer

    trainer = Trainer(cfg)
    assert [trainer.depth_at(t) for t in (28, 29)] == [depth_at(28, 16, 1, 0.29, 100), 16]


@pytest.mark.parametrize(
    "model,message",
    [
        (dict(plan="dense", core_layers=3, num_blocks=4), "model.num_blocks: not used by plan dense"),
        (
            dict(
                plan="foil",
                foil_layers=2,
                foil_loops=2,
                foil_experts=4,
                moe_layers="all",
                num_experts=4,
                routed_depth=4,
            ),
            "model.routed_depth: not used by plan foil",
        ),
        (
            dict(plan="foil", foil_layers=2, foil_loops=2, moe_layers="all", num_experts=4),
            "model.plan.experts: plan foil needs it",
        ),
        (dict(plan="looped", loop_layers=2), "model.plan.loops: plan looped needs it"),
        (dict(plan="accordion", loop_window=0), "model.plan.window: must be > 0 (got 0)"),
        (
            dict(plan="lol", untie_attention=True),
            "model.untie_attention: not used by plan lol (an option of plan looped / foil, model.plan.untie_attention)",
        ),
        # rename_config: off (the deprecated key, named by its message)
        (
            dict(plan="lol", dense_attention="sliding"),
            "model.dense_attention='sliding': not used by plan lol (an option of plan dense / looped / foil, "
            "model.plan.attention)",
        ),
        # rename_config: on
    ],
)
def test_plan_keys_are_validated(model, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": dict(BASE, **model)})
    assert message in str(err.value) and "\n" not in str(err.value)


SECTIONS_MISSING_AN_OPTION = [
    ({"kind": "dense"}, {}, "model.plan.layers: plan dense needs it"),
    ({"kind": "looped", "layers": 2}, {}, "model.plan.loops: plan looped needs it"),
    ({"kind": "looped", "loops": 2}, {}, "model.plan.layers: plan looped needs it"),
    ({"kind": "foil", "layers": 2, "experts": 4}, dict(moe_layers="all", num_experts=4), "model.plan.loops: plan foil"),
    ({"kind": "foil", "loops": 2, "experts": 4}, dict(moe_layers="all", num_experts=4), "model.plan.layers: plan foil"),
    ({"kind": "foil", "layers": 2, "loops": 2}, dict(moe_layers="all", num_experts=4), "model.plan.experts: plan foil"),
    ({"kind": "accordion"}, {}, "model.plan.window: plan accordion needs it"),
    (
        {"kind": "accordion", "window": 4, "budgets": [0, 5]},
        {},
        "model.plan.budgets: every budget must be in [0, window=4]",
    ),
    ({"kind": "accordion", "window": 4, "budgets": [0, 2], "budget": 1}, {}, "model.plan.budget: 1 is not one of"),
    ({"kind": "lol", "num_blocks": 0}, {}, "model.plan.num_blocks: must be > 0 (got 0)"),
    ({"kind": "lol", "routed_depth": 0}, {}, "model.plan.routed_depth: must be > 0 (got 0)"),
]


@pytest.mark.parametrize("section, model, message", SECTIONS_MISSING_AN_OPTION)
def test_plan_section_errors_name_the_key_as_written_in_the_section(section, model, message):
    """Every built-in kind answers a missing or bad option with ``model.plan.<key>`` (what the config
    writes), not the field the option is stored in."""
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": dict(BASE, plan=section, **model)})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_misspelt_plan_option_gets_a_suggestion_from_the_section():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": dict(BASE, plan={"kind": "looped", "layers": 2, "loop": 2})})
    assert "model.plan.loop is not an option of plan looped; did you mean loops?" in str(err.value)


OLD_SPELLING = {
    "foil-2": (
        """plan: looped
  num_blocks: 2
  routed_depth: 16
  untie_attention: true
  core_num_experts: 32""",
        "foil",
    ),
    "proto-foil-1": (
        """plan: looped
  num_blocks: 1
  routed_depth: 16
  core_num_experts: 64""",
        "foil",
    ),
    "huginn-360m-4x4": (
        """plan: looped
  num_blocks: 4
  routed_depth: 16""",
        "looped",
    ),
    "moe-baseline": (
        """plan: dense
  num_blocks: 16""",
        "dense",
    ),
    "accordion-1.61b": (
        """plan: accordion
  num_blocks: 12
  loop_budgets: [0, 3, 6, 9, 12]""",
        "accordion",
    ),
}


def _flat_options(section: dict) -> dict:
    """The section's windows / attention / FiLM / injection options (popped) as the flat ``model`` keys
    of the earlier spelling."""
    from megatron_lol.config.migration import OPTION_KEYS

    out = {}
    for key, (path, _) in OPTION_KEYS.items():
        head, _, sub = path.partition(".")
        if head in section:
            out[key] = section[head][sub] if sub else section[head]
    for key in {path.partition(".")[0] for path, _ in OPTION_KEYS.values()}:
        section.pop(key, None)
    return out


@pytest.mark.parametrize("name", list(OLD_SPELLING))
def test_older_spelling_reads_with_a_deprecation_and_the_same_model(name, tmp_path):
    """A paper config in the deprecated spelling (every plan's shape in num_blocks / routed_depth, Foil as
    plan: looped) loads with a deprecation warning into the same plan and the same parameter count."""
    from megatron_lol.model.params import count_parameters

    old_shape, plan_name = OLD_SPELLING[name]
    text = (PAPER / f"{name}.yaml").read_text()
    kept, in_section = [], False
    for line in text.splitlines():  # drop the plan section (``plan:`` and its indented keys)
        in_section = line.startswith("  plan:") or (in_section and line.startswith("    "))
        if not in_section:
            kept.append(line)
    at = kept.index("model:") + 1
    new_cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
    flat = [f"  {key}: {json.dumps(value)}" for key, value in _flat_options(new_cfg.model.to_dict()["plan"]).items()]
    old = "\n".join(kept[:at] + ["  " + old_shape] + flat + kept[at:]) + "\n"
    (tmp_path / "old.yaml").write_text(old)
    with pytest.warns(ConfigDeprecationWarning):
        old_cfg = load_config(tmp_path / "old.yaml", check_data=False)
    assert old_cfg.model.plan == new_cfg.model.plan and new_cfg.model.plan.kind == plan_name
    assert old_cfg.model.execution_plan().to_dict() == new_cfg.model.execution_plan().to_dict()
    vocab = 49152
    assert count_parameters(old_cfg.model, vocab).total == count_parameters(new_cfg.model, vocab).total


def test_flat_plan_keys_of_earlier_run_configs_load_with_a_deprecation():
    """A run_config.yaml written before plan sections (the kind's options as flat ``model`` keys)
    loads, with a deprecation warning, into the same plan."""
    from megatron_lol.config.migration import FLAT_KEYS

    for path in sorted(PAPER.glob("*.yaml")):
        cfg = load_config(path, check_data=False)
        raw = cfg.to_dict()
        section = raw["model"].pop("plan")
        kind = section.pop("kind")
        raw["model"].update(section.pop("routing", {}))  # the router's keys were flat ``model`` keys too
        raw["model"].update(_flat_options(section))  # and the windows, attention, FiLM and injection
        flats = {key: flat for flat, (kinds, key) in FLAT_KEYS.items() if kind in kinds}
        raw["model"].update({"plan": kind, **{flats[key]: value for key, value in section.items()}})
        with pytest.warns(ConfigDeprecationWarning, match="deprecated; write it in the plan's section"):
            again = config_from_dict(raw)
        assert again.model.execution_plan().to_dict() == cfg.model.execution_plan().to_dict(), path.name
        assert again.model.to_dict() == cfg.model.to_dict(), path.name


def test_saved_config_round_trips_without_deprecation():
    """``to_dict`` (what run_config.yaml holds) loads back as the same plan, silently."""
    for path in sorted(PAPER.glob("*.yaml")):
        cfg = load_config(path, check_data=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigDeprecationWarning)
            again = config_from_dict(cfg.to_dict())
        assert again.model.execution_plan().to_dict() == cfg.model.execution_plan().to_dict(), path.name


def test_python_construction_reads_the_older_spelling_too():
    with pytest.warns(ConfigDeprecationWarning, match="model.num_blocks is now model.plan.layers"):
        m = ModelConfig(plan="dense", num_blocks=3)
    assert m.plan.kind == "dense" and m.plan.layers == 3 and build_plan(m).num_stored_blocks == 3


def test_schedule_comparisons_live_in_the_plan_package():
    """Nothing outside ``megatron_lol/plan`` compares plan names: everything asks the plan."""
    pattern = r"plan(\.kind)? (==|!=)|plan(\.kind)? (not )?in \("
    assert subprocess.run(["grep", "-E", pattern], input='if m.plan.kind == "lol":', text=True).returncode == 0
    out = subprocess.run(["grep", "-rnE", pattern, "megatron_lol"], cwd=REPO, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if ".pyc" not in l]
    assert all(l.startswith(os.path.join("megatron_lol", "plan") + os.sep) for l in lines), lines


def test_hf_export_carries_the_schedule():
    """The exported config.json holds the plan's steps; the remote code runs them (no re-derivation)."""
    import torch

    from megatron_lol.convert.hf_modeling.configuration_lol import LoLConfig
    from megatron_lol.convert.to_hf import lol_config_json

    for model in (
        dict(plan="lol", num_blocks=3, routed_depth=5),
        dict(plan="accordion", loop_window=3, loop_budgets=[0, 1, 3], loop_budget=1),
    ):
        cfg = config_from_dict({"model": dict(BASE, **model)})
        conf = lol_config_json(cfg, 96, torch.float32, {"eod_id": 0}, loop_budget=None)
        plan = cfg.model.execution_plan()
        assert conf["execution_plan"] == plan.to_dict()
        hf = LoLConfig(**{k: v for k, v in conf.items() if k not in ("architectures", "auto_map", "model_type")})
        assert hf.core_depth == plan.depth
        assert [hf.depth_for_budget(k) for k in plan.budgets if k is not None] == [
            plan.depth_for(k) for k in plan.budgets if k is not None
        ]
