"""A plan kind's options live only in ``model.plan``, the MoE and precision settings only in
``model.moe`` / ``model.precision``; earlier spellings are rewritten by the tables of one module.

``megatron_lol/config/migration.py`` is the only module that names an option by
its flat ``model`` key. The scan below reads every module of the package and
fails on a read of a flat key from anything but a section or a module's own
attribute; the runtime checks make sure the flat names are not attributes of
``ModelConfig`` either (a read fails, an assignment is refused).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_lol.config import ModelConfig, config_from_dict, load_config
from megatron_lol.config.migration import (
    FLAT_KEYS,
    MOVED_KEYS,
    OPTION_KEYS,
    ROUTING_KEYS,
    RUNTIME_KEYS,
    ConfigDeprecationWarning,
)
from megatron_lol.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_lol"
MIGRATION = PACKAGE / "config" / "migration.py"
# the exported HF model's own config (config.json's published keys), not a ModelConfig
HF_REMOTE_CODE = PACKAGE / "convert" / "hf_modeling"
# what a flat name may be read from: a plan's section or options (``m.plan.num_blocks``,
# ``self.options.untie_attention``, a kind's ``o``), a module's or a plan's own attribute
# (``self.loop_gates``, a parameter), a ParamCounts (``counts.loop_gates``, a parameter
# category) and the CLI's arguments / a loaded run (``args.loop_budget``, a flag)
ALLOWED_BASES = {"plan", "options", "o", "self", "counts", "args", "loaded", "run"}
# a moved MoE / precision key may also be read from its own section and from megatron-core's
# TransformerConfig (``config.fp8``, ``tconfig.params_dtype``, ``core_cfg``), which has the same names
SECTION_BASES = ALLOWED_BASES | {"moe", "precision", "config", "tconfig", "core_cfg", "c", "block"}
# a router / balancing key: from the routing sub-section (``m.plan.routing``, ``routing_of(m)``) or a
# router module's own attribute
# (``moe.aux_loss_coeff`` is the MoE section's own key of that name)
ROUTING_BASES = ALLOWED_BASES | {"routing", "routing_of", "moe"}
# a window / attention / FiLM / injection key: from the plan's section (``m.plan.windows.size``,
# ``windows_of(m).shift``, ``pass_parts_of(m).film``), megatron-core's TransformerConfig
# (``config.window_size``: its own sliding-window attention) or an object's own attribute
OPTION_BASES = ALLOWED_BASES | {"windows", "windows_of", "pass_parts_of", "config", "tconfig", "core_cfg"}


def _flagged(key: str, base: str) -> bool:
    if key in RUNTIME_KEYS:  # how the model runs: from its section only (``cfg.parallel.routed_core``, ParallelConfig)
        return base not in ("parallel", "self")
    if key in FLAT_KEYS and base not in ALLOWED_BASES:
        return True
    if key in ROUTING_KEYS:
        return base not in ROUTING_BASES
    if key in OPTION_KEYS:
        return base not in OPTION_BASES
    return key in MOVED_KEYS and base not in SECTION_BASES


def flat_reads(source: str) -> list:
    """``(line, text)`` of every read of a flat plan key that is not one of the allowed kinds."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            value = node.value.func if isinstance(node.value, ast.Call) else node.value  # routing_of(m).key
            if _flagged(node.attr, ast.unparse(value).split(".")[-1]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func).split(".")[-1]
            first = ast.unparse(node.args[0]).split(".")[-1] if node.args else ""
            if name == "ModelConfig" or (name == "replace" and first not in SECTION_BASES - ALLOWED_BASES):
                found += [
                    (node.lineno, f"{name}({k.arg}=...)")
                    for k in node.keywords
                    if k.arg in FLAT_KEYS
                    or k.arg in ROUTING_KEYS
                    or (k.arg in OPTION_KEYS and (name == "ModelConfig" or first not in OPTION_BASES))
                    or (k.arg in RUNTIME_KEYS and name == "ModelConfig")
                    or (k.arg in MOVED_KEYS and (name == "ModelConfig" or first != "plan"))
                ]
            if name in ("getattr", "setattr", "hasattr") and len(node.args) > 1:
                key = node.args[1]
                if isinstance(key, ast.Constant) and _flagged(str(key.value), first):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_flat_reads():
    """The scan is not blind: each way of reading a flat key is caught, the section's spelling is not."""
    bad = """
m.loop_window
cfg.model.num_blocks
replace(m, core_layers=3)
ModelConfig(loop_gates=False)
getattr(model, "foil_experts")
cfg.model.num_experts
m.moe_router_topk
model.params_dtype
replace(m, fp8=None)
ModelConfig(use_transformer_engine=False)
getattr(cfg.model, "fp8", None)
cfg.model.balancing
self.cfg.router_noise
ModelConfig(router_tied=False)
cfg.model.routed_core
ModelConfig(routed_core="grouped")
getattr(model, "routed_core")
cfg.model.window_size
self.cfg.window_shift
m.dense_attention
model.film
cfg.input_injection
ModelConfig(window_size=8)
replace(m, film="depth")
getattr(cfg.model, "input_injection", False)
"""
    assert len(flat_reads(bad)) == 25
    good = (
        "m.plan.window\nm.plan.num_blocks\nself.loop_gates\ncounts.second_pass_router\nreplace(m.plan, budget=1)\n"
        "m.moe.num_experts\ncfg.model.precision.fp8\ntconfig.params_dtype\nreplace(core_cfg, fp8=None)\n"
        "replace(m.precision, fp8=None)\ngetattr(config, 'fp8', None)\n"
        "m.plan.routing.balancing\nrouting_of(m).router_only_filler\nrouting.router_tied\n"
        "cfg.parallel.routed_core\nParallelConfig(routed_core='grouped')\n"
        "m.plan.windows.size\nwindows_of(m).shift\npass_parts_of(cfg.model).film\nm.plan.input_injection\n"
        "self.options.attention\nconfig.window_size\nreplace(tconfig, window_size=(7, 0))\n"
        "replace(m.plan, film='depth')\n"
    )
    assert flat_reads(good) == []


def test_no_module_outside_the_migration_table_reads_a_flat_plan_key():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == MIGRATION or HF_REMOTE_CODE in path.parents:
            continue
        hits += [f"{path.relative_to(REPO)}:{line}: {text}" for line, text in flat_reads(path.read_text())]
    assert hits == [], "\n".join(hits)


def test_model_config_has_no_flat_plan_fields():
    m = ModelConfig(plan={"kind": "accordion", "window": 3, "budgets": [0, 3]})
    for key, (_, option) in FLAT_KEYS.items():
        assert not hasattr(m, key), key
        with pytest.raises(AttributeError, match=f"lives in model.plan.{option}"):
            setattr(m, key, 1)
    for key, (section, option) in MOVED_KEYS.items():
        assert not hasattr(m, key), key
        with pytest.raises(AttributeError, match=f"lives in model.{section}.{option}"):
            setattr(m, key, 1)
    for key in ROUTING_KEYS:
        assert not hasattr(m, key), key
        with pytest.raises(AttributeError, match=f"lives in model.plan.routing.{key}"):
            setattr(m, key, 1)
    assert (m.plan.kind, m.plan.window, m.plan.budgets, m.plan.gates) == ("accordion", 3, [0, 3], True)
    for key, (option, _) in OPTION_KEYS.items():
        assert not hasattr(m, key), key
        with pytest.raises(AttributeError, match=f"it lives in model.plan.{option}"):
            setattr(m, key, 1)
    for key, (section, option) in RUNTIME_KEYS.items():
        assert not hasattr(m, key), key
        with pytest.raises(AttributeError, match=f"how the model runs; it lives in {section}.{option}"):
            setattr(m, key, "grouped")


def test_routed_core_moves_to_parallel(tmp_path):
    """``model.routed_core`` (how the model runs) of an earlier config or ``run_config.yaml`` reads as
    ``parallel.routed_core``, as does ``--set model.routed_core``; both places at odds are refused, the model
    section alone (``ModelConfig(routed_core=...)``) is refused naming where it lives, and
    ``--routed-core`` sets it."""
    from megatron_lol.config.loader import add_config_arguments, config_from_args

    with pytest.warns(ConfigDeprecationWarning, match=r"model.routed_core is deprecated; write it as parallel"):
        cfg = config_from_dict({"model": {"routed_core": "reference"}})
    assert cfg.parallel.routed_core == "reference" and "routed_core" not in cfg.model.to_dict()
    with pytest.warns(ConfigDeprecationWarning):
        same = config_from_dict({"model": {"routed_core": "grouped"}, "parallel": {"routed_core": "grouped"}})
    assert same.parallel.routed_core == "grouped"
    with pytest.raises(ConfigError, match=r"model.routed_core='grouped' given together with parallel.routed_core"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            config_from_dict({"model": {"routed_core": "grouped"}, "parallel": {"routed_core": "reference"}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"plan": "lol"}}))
    with pytest.warns(ConfigDeprecationWarning, match="model.routed_core is deprecated"):
        cfg = load_config(path, [("model.routed_core", "grouped", "--set model.routed_core=grouped")], check_data=False)
    assert cfg.parallel.routed_core == "grouped"
    with pytest.raises(
        ConfigError, match=r"ModelConfig: model.routed_core says how the model runs.*parallel.routed_core"
    ):
        ModelConfig(routed_core="grouped")
    with pytest.raises(ConfigError, match=r"parallel.routed_core: must be one of"):
        config_from_dict({"parallel": {"routed_core": "fast"}})
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--routed-core", "reference"])
    assert config_from_args(args, check_data=False).parallel.routed_core == "reference"


def test_each_flat_key_moves_into_its_kinds_section():
    """Every row of the table, written flat, reads (with a deprecation) as its section key."""
    values = {
        "num_blocks": 3,
        "routed_depth": 5,
        "core_layers": 3,
        "loop_layers": 2,
        "loop_count": 3,
        "foil_experts": 6,
        "foil_layers": 2,
        "foil_loops": 2,
        "untie_attention": False,
        "loop_window": 3,
        "loop_budgets": [0, 2],
        "loop_budget": 2,
        "second_pass_router": "separate",
        "loop_gates": False,
    }
    assert set(values) == set(FLAT_KEYS)
    moe = {"moe_layers": "all", "num_experts": 4}
    for key, value in values.items():
        kinds, option = FLAT_KEYS[key]
        kind = kinds[-1]
        model = {"plan": kind, key: value, **(moe if kind in ("foil", "accordion") else {})}
        required = {
            "dense": {"layers": 2},
            "looped": {"layers": 2, "loops": 2},
            "accordion": {"window": 3, "budgets": [0, 2]},
        }
        required["foil"] = dict(required["looped"], experts=4)
        model["plan"] = {"kind": kind, **{k: v for k, v in required.get(kind, {}).items() if k != option}}
        with pytest.warns(ConfigDeprecationWarning, match=f"model.{key} is deprecated"):
            cfg = config_from_dict({"model": model})
        assert getattr(cfg.model.plan, option) == value, key


def test_a_flat_key_against_the_section_is_refused():
    with pytest.raises(ConfigError, match=r"model.loop_window=4 given together with model.plan.window=3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            config_from_dict({"model": {"plan": {"kind": "accordion", "window": 3}, "loop_window": 4}})


def test_set_of_a_flat_key_sets_the_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"plan": {"kind": "dense", "layers": 2}}}))
    with pytest.warns(ConfigDeprecationWarning, match="model.core_layers is deprecated"):
        cfg = load_config(path, [("model.core_layers", 5, "--set model.core_layers=5")], check_data=False)
    assert cfg.model.plan.layers == 5 and cfg.model.execution_plan().num_stored_blocks == 5


MOVED_VALUES = {
    "num_experts": 4,
    "moe_ffn_hidden_size": 48,
    "moe_router_topk": 1,
    "moe_layers": "fixed",
    "core_num_experts": None,
    "moe_shared_expert_intermediate_size": 32,
    "moe_aux_loss_coeff": 0.03,
    "moe_z_loss_coeff": 1e-3,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 2e-3,
    "moe_loss_average_over_executions": True,
    "params_dtype": "fp32",
    "use_transformer_engine": False,
    "fp8": None,
    "fp8_recipe": None,
    "fp8_margin": 1,
    "fp8_amax_history_len": 4,
    "fp8_amax_compute_algo": "max",
}


def test_each_moved_key_reads_as_its_section_key():
    """The flat MoE / precision keys of the previous layout, all at once, read (with a deprecation each)
    as ``model.moe.*`` / ``model.precision.*``."""
    assert set(MOVED_VALUES) == set(MOVED_KEYS)
    with pytest.warns(ConfigDeprecationWarning) as caught:
        cfg = config_from_dict({"model": dict(MOVED_VALUES)})
    for key, value in MOVED_VALUES.items():
        section, option = MOVED_KEYS[key]
        assert getattr(getattr(cfg.model, section), option) == value, key
        assert any(f"model.{key} is deprecated; write it as model.{section}.{option}" in str(w.message) for w in caught)
    assert "num_experts" not in cfg.to_dict()["model"] and cfg.to_dict()["model"]["moe"]["num_experts"] == 4


def test_set_of_a_moved_key_and_python_construction(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"moe": {"layers": "fixed", "num_experts": 2}}}))
    with pytest.warns(ConfigDeprecationWarning, match="model.num_experts is deprecated"):
        cfg = load_config(path, [("model.num_experts", 6, "--set model.num_experts=6")], check_data=False)
    assert cfg.model.moe.num_experts == 6 and cfg.model.moe.layers == "fixed"
    with pytest.warns(ConfigDeprecationWarning, match="model.params_dtype is deprecated"):
        m = ModelConfig(params_dtype="bf16", moe={"layers": "fixed", "num_experts": 2})
    assert m.precision.params_dtype == "bf16" and m.moe.num_experts == 2
    with pytest.raises(ConfigError, match=r"model.num_experts=3 given together with model.moe.num_experts=2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            config_from_dict({"model": {"moe": {"layers": "fixed", "num_experts": 2}, "num_experts": 3}})


ROUTING_VALUES = {
    "router_tied": False,
    "router_noise": False,
    "router_noise_clamp": 5.0,
    "router_input": "windows",
    "router_only_tokens": [5, 6],
    "router_only_filler": 7,
    "balancing": "aux_loss",
    "bias_update_speed": 2e-3,
    "bias_clamp": 8.0,
    "bias_update_stop_fraction": 0.5,
    "per_depth_bias": True,
    "seq_aux_loss_coeff": 1e-2,
    "aux_loss_coeff": 0.05,
}


ROUTING_DEFAULTS = ModelConfig().to_dict()["plan"]["routing"]


def test_each_router_key_reads_as_its_routing_key():
    """The flat router / balancing keys read (with a deprecation each) as ``model.plan.routing.*`` of a
    kind that routes; for a kind without a router they are dropped (the router-only tokens refused)."""
    assert set(ROUTING_VALUES) == set(ROUTING_KEYS)
    with pytest.warns(ConfigDeprecationWarning) as caught:
        cfg = config_from_dict({"model": {"plan": {"kind": "lol", "num_blocks": 2}, **ROUTING_VALUES}})
    for key, value in ROUTING_VALUES.items():
        assert getattr(cfg.model.plan.routing, key) == value, key
        assert any(f"model.{key} is deprecated; write it as model.plan.routing.{key}" in str(w.message) for w in caught)
    assert cfg.to_dict()["model"]["plan"]["routing"]["balancing"] == "aux_loss"
    dense = config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}, "balancing": "loss_free"}})
    assert not hasattr(dense.model.plan, "routing")  # a default of the flat layout: dropped
    with pytest.warns(ConfigDeprecationWarning, match="plan dense has no window router: dropped"):
        config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}, "balancing": "none"}})
    with pytest.raises(ConfigError, match=r"^<dict>: model.router_only_tokens: plan dense has no window router"):
        config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}, "router_only_tokens": [3]}})
    with pytest.warns(ConfigDeprecationWarning, match="model.router_tied is deprecated"):
        m = ModelConfig(router_tied=False, plan={"kind": "lol", "routing": {"per_depth_bias": True}})
    assert (m.plan.routing.router_tied, m.plan.routing.per_depth_bias) == (False, True)


def test_set_of_a_routing_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"plan": {"kind": "lol", "routing": {"bias_clamp": 4.0}}}}))
    cfg = load_config(
        path, [("model.plan.routing.balancing", "none", "--set model.plan.routing.balancing=none")], check_data=False
    )
    assert (cfg.model.plan.routing.balancing, cfg.model.plan.routing.bias_clamp) == ("none", 4.0)
    with pytest.warns(ConfigDeprecationWarning, match="model.per_depth_bias is deprecated"):
        cfg = load_config(path, [("model.per_depth_bias", True, "--set model.per_depth_bias=true")], check_data=False)
    assert cfg.model.plan.routing.per_depth_bias is True and cfg.model.plan.routing.bias_clamp == 4.0
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'model.plan.routing.balancng' \(did you mean 'model.plan.routing.balancing'\?\)",
    ):
        load_config(path, [("model.plan.routing.balancng", "none", "--set")], check_data=False)


OPTION_VALUES = {
    "window_size": 64,
    "window_shift": 8,
    "dense_attention": "strided",
    "film": "depth",
    "input_injection": True,
}


def test_each_option_key_reads_as_its_section_key():
    """The flat window / attention / FiLM / injection keys read (with a deprecation each) as their keys in
    ``model.plan`` of a kind that has them, for YAML / a dict, ``--set``, ``ModelConfig(...)`` and
    ``dataclasses.replace``."""
    assert set(OPTION_VALUES) == set(OPTION_KEYS)
    with pytest.warns(ConfigDeprecationWarning) as caught:
        cfg = config_from_dict({"model": {"plan": {"kind": "dense", "layers": 2}, **OPTION_VALUES}})
    plan = cfg.model.plan
    assert (plan.windows.size, plan.windows.shift, plan.attention, plan.film, plan.input_injection) == (
        64,
        8,
        "strided",
        "depth",
        True,
    )
    for key, (path, _) in OPTION_KEYS.items():
        assert any(f"model.{key} is deprecated; write it as model.plan.{path}" in str(w.message) for w in caught)
    assert cfg.model.execution_plan().step(1).attention == "strided"
    with pytest.warns(ConfigDeprecationWarning, match="model.window_shift is deprecated"):
        m = ModelConfig(window_shift=4, plan={"kind": "lol", "windows": {"size": 8}, "film": "depth_block"})
    assert (m.plan.windows.size, m.plan.windows.shift, m.plan.film) == (8, 4, "depth_block")
    with pytest.warns(ConfigDeprecationWarning, match="model.film is deprecated"):
        replaced = dataclasses.replace(m, film="off")
    assert replaced.plan.film == "off" and replaced.plan.windows.shift == 4


def test_an_option_key_for_a_kind_without_it():
    """For a kind without the option: dropped at the flat key's default; refused otherwise, as the previous
    version refused it (attention other than full for lol and accordion, FiLM / injection for accordion);
    a window geometry, which that version took with any kind, dropped with a warning."""
    accordion = {"kind": "accordion", "window": 2, "budgets": [0, 2]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at the defaults: dropped silently
        cfg = config_from_dict(
            {"model": {"plan": accordion, "film": "off", "input_injection": False, "dense_attention": "full"}}
        )
        lol = config_from_dict({"model": {"plan": "lol", "dense_attention": "full"}})
    assert not hasattr(cfg.model.plan, "film") and not hasattr(lol.model.plan, "attention")
    with pytest.raises(
        ConfigError, match=r"^<dict>: model.film='depth': not used by plan accordion \(an option of plan"
    ):
        config_from_dict({"model": {"plan": accordion, "film": "depth"}})
    with pytest.raises(ConfigError, match=r"model.input_injection=True: not used by plan accordion"):
        ModelConfig(plan=accordion, input_injection=True)
    with pytest.raises(
        ConfigError, match=r"model.dense_attention='sliding': not used by plan lol .*model.plan.attention"
    ):
        config_from_dict({"model": {"plan": "lol", "dense_attention": "sliding"}})
    with pytest.warns(ConfigDeprecationWarning, match="plan accordion has no windows: dropped"):
        config_from_dict({"model": {"plan": accordion, "window_size": 64}})
    with pytest.raises(ConfigError, match=r"model.window_size=64 given together with model.plan.windows.size=16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            config_from_dict({"model": {"plan": {"kind": "lol", "windows": {"size": 16}}, "window_size": 64}})


def test_set_of_an_option_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"plan": {"kind": "looped", "layers": 2, "loops": 2, "film": "depth"}}}))
    with pytest.warns(ConfigDeprecationWarning, match="model.window_size is deprecated"):
        cfg = load_config(path, [("model.window_size", 64, "--set model.window_size=64")], check_data=False)
    assert (cfg.model.plan.windows.size, cfg.model.plan.windows.shift, cfg.model.plan.film) == (64, 16, "depth")
    cfg = load_config(path, [("model.plan.windows.shift", 4, "--set model.plan.windows.shift=4")], check_data=False)
    assert (cfg.model.plan.windows.size, cfg.model.plan.windows.shift) == (32, 4)
    with pytest.raises(ConfigError, match=r"model.plan.windows.shift: must be in \[0, size=32\) \(got 40\)"):
        load_config(path, [("model.plan.windows.shift", 40, "--set")], check_data=False)
    with pytest.raises(ConfigError, match=r"did you mean 'model.plan.windows.shift'"):
        load_config(path, [("model.plan.windows.shfit", 4, "--set")], check_data=False)


FLAT_RUN_CONFIG_OF_DENSE = {
    # a run_config.yaml of the flat version: every kind's keys, the other kinds' at their defaults
    "plan": "dense",
    "num_blocks": None,
    "routed_depth": None,
    "core_layers": 3,
    "loop_layers": None,
    "loop_count": None,
    "foil_experts": None,
    "foil_layers": None,
    "foil_loops": None,
    "loop_window": None,
    "untie_attention": None,
    "loop_budgets": [0],
    "loop_budget": None,
    "second_pass_router": "shared",
    "loop_gates": True,
    "window_size": 32,
    "window_shift": 16,
    "dense_attention": "full",
    "film": "off",
    "input_injection": False,
    "hidden_size": 32,
    "num_attention_heads": 4,
}


def test_a_flat_run_config_lists_every_kind_and_reads_as_its_own():
    with pytest.warns(ConfigDeprecationWarning, match="model.core_layers is deprecated"):
        cfg = config_from_dict({"model": dict(FLAT_RUN_CONFIG_OF_DENSE)})
    assert cfg.to_dict()["model"]["plan"] == {
        "kind": "dense",
        "layers": 3,
        "attention": "full",
        "windows": {"size": 32, "shift": 16},
        "film": "off",
        "input_injection": False,
    }
    with pytest.raises(ConfigError, match=r"model.loop_gates: not used by plan dense"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            config_from_dict({"model": dict(FLAT_RUN_CONFIG_OF_DENSE, loop_gates=False)})


# --------------------------------------------------------------------------- a checkpoint of the flat layout
TOKENS = 96


class _Tokenizer:
    vocab_size = TOKENS
    eod = 0


def _raw_run(save: Path, iters: int) -> dict:
    return {
        "model": {
            "plan": {"kind": "lol", "num_blocks": 3, "routed_depth": 3, "windows": {"size": 8, "shift": 4}},
            "hidden_size": 32,
            "num_attention_heads": 4,
            "ffn_hidden_size": 64,
            "make_vocab_size_divisible_by": 32,
        },
        "training": {
            "train_iters": iters,
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "seq_length": 32,
            "log_interval": 100,
            "eval_interval": 100,
            "eval_iters": 0,
            "seed": 7,
            "save": str(save),
            "save_interval": 2,
        },
        "optimizer": {"lr": 1e-2, "lr_warmup_iters": 0},
    }


def _train(cfg) -> dict:
    from megatron_lol.training.profile import SyntheticDataset
    from megatron_lol.training.trainer import Trainer

    ds = SyntheticDataset(cfg.training.seq_length, TOKENS, eod=0, seed=3)
    trainer = Trainer(cfg, tokenizer=_Tokenizer(), datasets=(ds, None, None)).setup()
    return {r.step: r.loss for r in trainer.train().results}


def flat_layout(model: dict) -> dict:
    """``model`` as the version before plan sections wrote it into run_config.yaml: ``plan`` the
    kind's name, every kind's options as flat keys (the other kinds' at their defaults), and the
    MoE / precision settings as flat keys."""
    from megatron_lol.config.migration import FLAT_DEFAULTS

    out = {k: v for k, v in model.items() if k not in ("plan", "moe", "precision")}
    for key, (name, option) in MOVED_KEYS.items():  # and the MoE / precision settings flat too
        out[key] = model[name][option]
    section = dict(model["plan"])
    out.update(section.pop("routing", {}))  # and the router's
    kind = section["kind"]
    out["plan"] = kind
    for key, (kinds, option) in FLAT_KEYS.items():
        out[key] = section[option] if kind in kinds else FLAT_DEFAULTS.get(key)
    for key, (path, default) in OPTION_KEYS.items():  # and the windows, attention, FiLM, injection
        head, _, sub = path.partition(".")  # a kind without the option: the flat key's default
        out[key] = section.get(head, {}).get(sub, default) if sub else section.get(head, default)
    out["routed_core"] = "auto"  # how the model runs: that version kept it in model
    return out


@pytest.mark.multiprocess  # the checkpoint writer starts a process of its own beside the trainer
def test_a_checkpoint_with_the_flat_run_config_resumes_bit_exact(megatron_env, tmp_path):
    """A 4-step run stopped and saved at step 2, its run_config.yaml rewritten to the flat layout, then
    resumed from it (``--use-checkpoint-args``): the same config, and the losses of an uninterrupted run."""
    from megatron_lol.training.checkpoint_args import config_with_checkpoint_args
    from megatron_lol.training.checkpointing.files import digest_files, read_manifest, write_manifest

    ref = _train(config_from_dict(_raw_run(tmp_path / "ref", 4)))
    stopped = _raw_run(tmp_path / "old", 4)
    stopped["training"]["exit_interval"] = 2  # saves at 2 and stops
    first = _train(config_from_dict(stopped))
    assert first == {1: ref[1], 2: ref[2]}
    run_config = tmp_path / "old" / "iter_0000002" / "run_config.yaml"
    saved = yaml.safe_load(run_config.read_text())
    assert saved["model"]["plan"] == {
        "kind": "lol",
        "num_blocks": 3,
        "routed_depth": 3,
        "routing": ROUTING_DEFAULTS,
        "windows": {"size": 8, "shift": 4},
        "film": "off",
        "input_injection": False,
    }
    saved["model"] = flat_layout(saved["model"])
    assert (saved["model"]["window_size"], saved["model"]["dense_attention"]) == (8, "full")
    run_config.write_text(yaml.safe_dump(saved))
    # the checkpoint that version saved lists this run_config.yaml in its checksum manifest
    files = read_manifest(str(run_config.parent))
    files.update(digest_files(str(run_config.parent), ["run_config.yaml"]))
    write_manifest(str(run_config.parent), files)
    overrides = [
        ("training.exit_interval", None, "--exit-interval"),
        ("training.save", str(tmp_path / "old"), "--save"),
    ]
    with pytest.warns(ConfigDeprecationWarning, match="model.num_blocks is deprecated"):
        cfg = config_with_checkpoint_args(None, overrides, check_data=False)
    section_layout = yaml.safe_load((tmp_path / "ref" / "iter_0000002" / "run_config.yaml").read_text())["model"]
    assert cfg.model.to_dict() == section_layout
    resumed = _train(cfg)
    assert sorted(resumed) == [3, 4] and resumed == {3: ref[3], 4: ref[4]}
