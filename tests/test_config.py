"""Bad configuration stops before any work with a one-line error naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from megatron_lol.config import ConfigError, config_from_dict, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "examples", "configs", "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "model,message",
    [
        ({"plan": {"kind": "lol", "windows": {"size": 0}}}, "model.plan.windows.size: must be > 0 (got 0)"),
        ({"plan": {"kind": "lol", "windows": {"size": -4}}}, "model.plan.windows.size: must be > 0 (got -4)"),
        (
            {"plan": {"kind": "lol", "windows": {"shift": 32}}},
            "model.plan.windows.shift: must be in [0, size=32) (got 32)",
        ),
        (
            {"plan": {"kind": "lol", "windows": {"shift": -1}}},
            "model.plan.windows.shift: must be in [0, size=32) (got -1)",
        ),
        (
            {"plan": {"kind": "dense", "layers": 2, "attention": "strided", "windows": {"size": 8, "shift": 8}}},
            "model.plan.windows.shift: must be in [0, size=8) (got 8)",
        ),
        (
            {"plan": {"kind": "dense", "layers": 2, "attention": "banded"}},
            "model.plan.attention: must be one of full, sliding, strided (got 'banded')",
        ),
        ({"plan": {"kind": "lol", "film": "depths"}}, "model.plan.film: must be one of off, depth, depth_block"),
        (
            {"plan": {"kind": "accordion", "window": 2, "film": "depth"}},
            "model.plan.film is not an option of plan accordion",
        ),
        (
            {"plan": {"kind": "lol", "attention": "sliding"}},
            "model.plan.attention is not an option of plan lol",
        ),
        ({"plan": {"kind": "lol", "windows": {"sise": 8}}}, "(did you mean 'model.plan.windows.size'?)"),
        (
            {"plan": {"kind": "looped", "layers": 2, "loops": 2, "film": "depth", "input_injektion": True}},
            "model.plan.input_injektion is not an option of plan looped; did you mean input_injection?",
        ),
        ({"routed_depth": 0}, "model.plan.routed_depth: must be > 0 (got 0)"),
        ({"num_blocks": 0}, "model.plan.num_blocks: must be > 0 (got 0)"),
        (
            {"hidden_size": 130, "num_attention_heads": 4},
            "model.num_attention_heads: 4 does not divide model.hidden_size=130",
        ),
        ({"plan": "moe"}, "model.plan: kind must be one of dense, looped, foil, lol, accordion (got 'moe')"),
        ({"plan": {"kind": "lol", "windows": {"size": "big"}}}, "model.plan.windows.size must be int (got 'big')"),
    ],
)
def test_bad_model_values(model, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": model})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "model,message",
    [
        ({"moe": {"num_expert": 4}}, "unknown key 'model.moe.num_expert' (did you mean 'model.moe.num_experts'?)"),
        ({"moe": {"router_top_k": 2}}, "unknown key 'model.moe.router_top_k' (did you mean 'model.moe.router_topk'?)"),
        (
            {"precision": {"param_dtype": "bf16"}},
            "unknown key 'model.precision.param_dtype' (did you mean 'model.precision.params_dtype'?)",
        ),
        ({"precision": {"fp9": "e4m3"}}, "unknown key 'model.precision.fp9' (did you mean 'model.precision.fp8'?)"),
        (
            {"plan": {"kind": "lol", "routing": {"balancng": "none"}}},
            "unknown key 'model.plan.routing.balancng' (did you mean 'model.plan.routing.balancing'?)",
        ),
        (
            {"plan": {"kind": "lol", "routng": {}}},
            "model.plan.routng is not an option of plan lol; did you mean routing?",
        ),
        (
            {"plan": {"kind": "dense", "layers": 2, "routing": {}}},
            "model.plan.routing is not an option of plan dense",
        ),
        ({"moe": {"layers": "some"}}, "model.moe.layers: must be one of none, fixed, all (got 'some')"),
        ({"moe": {"layers": "fixed"}}, "model.moe.num_experts: model.moe.layers=fixed needs num_experts >= 1"),
        (
            {"moe": {"layers": "fixed", "num_experts": 4, "router_topk": 5}},
            "model.moe.router_topk: must be in [1, num_experts=4] (got 5)",
        ),
        ({"moe": {"z_loss_coeff": 0.1}}, "model.moe.z_loss_coeff: needs MoE layers (model.moe.layers is none)"),
        ({"precision": {"params_dtype": "fp16"}}, "model.precision.params_dtype: fp16 is not offered"),
        ({"precision": {"params_dtype": "fp64"}}, "model.precision.params_dtype: must be one of auto, fp32, bf16"),
        (
            {"plan": {"kind": "lol", "routing": {"balancing": "bias"}}},
            "model.plan.routing.balancing: must be one of loss_free, aux_loss, none (got 'bias')",
        ),
        (
            {"plan": {"kind": "lol", "routing": {"router_only_filler": 3}}},
            "model.plan.routing.router_only_filler: set without model.plan.routing.router_only_tokens",
        ),
        (
            {"plan": {"kind": "lol", "routing": {"bias_update_stop_fraction": 2}}},
            "model.plan.routing.bias_update_stop_fraction: must be in [0, 1] (got 2.0)",
        ),
    ],
)
def test_section_keys_are_named_as_written(model, message):
    """The ``moe``, ``precision`` and ``plan.routing`` sections: an unknown key gets a did-you-mean over the
    section's own keys, a bad value a message naming the key by its full path."""
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": model})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "plan,key",
    [
        ({"kind": "dense"}, "model.plan.layers"),
        ({"kind": "looped", "layers": 2}, "model.plan.loops"),
        ({"kind": "looped", "loops": 2}, "model.plan.layers"),
        ({"kind": "foil", "layers": 2, "loops": 2}, "model.plan.experts"),
        ({"kind": "accordion"}, "model.plan.window"),
    ],
)
def test_a_required_option_of_each_built_in_kind(plan, key):
    """(lol's two options have defaults: ``plan: lol`` alone is a model.)"""
    moe = {"layers": "all", "num_experts": 4} if plan["kind"] == "foil" else {}
    with pytest.raises(ConfigError, match=rf"^{key}: plan {plan['kind']} needs it$"):
        config_from_dict({"model": {"plan": plan, "moe": moe}})


def test_megatron_flags_set_the_sections(tmp_path):
    """Megatron-LM's MoE and precision flags land in ``model.moe`` / ``model.precision``."""
    import argparse

    from megatron_lol.config.loader import add_config_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        ["--config", "x.yaml", "--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "32"]
        + ["--bf16", "--fp8-format", "hybrid", "--transformer-impl", "local"]
    )
    keys = {key: value for key, value, _ in overrides_from_args(args)}
    assert keys == {
        "model.moe.num_experts": 4,
        "model.moe.router_topk": 1,
        "model.moe.ffn_hidden_size": 32,
        "model.precision.params_dtype": "bf16",
        "model.precision.fp8": "hybrid",
        "model.precision.transformer_engine": False,
    }
    path = _write(tmp_path, {"model": {"moe": {"layers": "fixed"}}})
    overrides = [(k, v, "flag") for k, v in keys.items() if k.startswith("model.moe")]
    cfg = load_config(path, overrides, check_data=False)
    assert (cfg.model.moe.num_experts, cfg.model.moe.router_topk, cfg.model.moe.ffn_hidden_size) == (4, 1, 32)


def _write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_unknown_yaml_key_names_file_and_key(tmp_path):
    path = _write(tmp_path, {"model": {"num_blocks": 4, "num_blokcs": 8}})
    with pytest.raises(ConfigError, match=r"cfg.yaml: unknown key 'model.num_blokcs'"):
        load_config(path, check_data=False)
    path = _write(tmp_path, {"modle": {}})
    with pytest.raises(ConfigError, match=r"unknown key 'modle'"):
        load_config(path, check_data=False)


def test_missing_data_path_is_named(tmp_path):
    cfg = yaml.safe_load(open(TINY))
    cfg["data"]["paths"] = [str(tmp_path / "nowhere_text_document")]
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"data.paths: .*nowhere_text_document.bin does not exist"):
        load_config(path)
    cfg["data"]["paths"] = []
    with pytest.raises(ConfigError, match=r"^data.paths: no data path given"):
        load_config(_write(tmp_path, cfg))


def test_overrides_are_typed_and_checked(tmp_path):
    path = _write(tmp_path, {"model": {"plan": {"kind": "lol", "num_blocks": 4}}})
    cfg = load_config(path, [("model.plan.num_blocks", 8, "--set model.plan.num_blocks=8")], check_data=False)
    assert cfg.model.plan.num_blocks == 8
    with pytest.raises(ConfigError, match=r"--set model.nope=1: unknown key 'model.nope'"):
        load_config(path, [("model.nope", 1, "--set model.nope=1")], check_data=False)


def test_cli_stops_before_any_work(tmp_path):
    cfg = yaml.safe_load(open(TINY))
    cfg["model"]["plan"]["windows"]["shift"] = 40
    cfg["training"]["save"] = str(tmp_path / "run")
    path = _write(tmp_path, cfg)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", path],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines == ["megatron-lol train: error: model.plan.windows.shift: must be in [0, size=32) (got 40)"]
    assert not (tmp_path / "run").exists()
    # a Megatron-LM flag is checked the same way
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "train",
            "--config",
            path,
            "--set",
            "model.plan.windows.shift=16",
            "--micro-batch-size",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "training.micro_batch_size (--micro-batch-size): must be > 0 (got 0)" in proc.stderr


# ------------------------------------------------------------------ validation without torch
def test_a_cpu_build_of_torch_is_recognised_by_its_libraries(tmp_path):
    import torch

    from megatron_lol.config.target import installed_torch_lacks_gpu_libraries

    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    assert not installed_torch_lacks_gpu_libraries(tmp_path / "torch")  # no libtorch_cpu: not a torch, ask torch
    (lib / "libtorch_cpu.so").write_bytes(b"")
    assert installed_torch_lacks_gpu_libraries(tmp_path / "torch")
    for gpu_library in ("libc10_cuda.so", "libtorch_hip.so"):
        (lib / gpu_library).write_bytes(b"")
        assert not installed_torch_lacks_gpu_libraries(tmp_path / "torch"), gpu_library
        (lib / gpu_library).unlink()
    # the installed build: a CPU wheel exactly when torch itself says it has neither CUDA nor ROCm
    assert installed_torch_lacks_gpu_libraries() == (torch.version.cuda is None and torch.version.hip is None)


def test_validating_a_config_imports_torch_only_when_the_build_could_have_a_gpu():
    """``params_dtype: auto`` and the layer spec ask whether CUDA is present; with a CPU build of torch
    the answer needs no ``import torch`` (``train --dry-run`` and submit_pipeline.sh's checks)."""
    code = (
        "import sys; from megatron_lol.config import load_config; "
        "from megatron_lol.config.target import installed_torch_lacks_gpu_libraries as cpu_build; "
        "cfg = load_config('examples/configs/tiny-cpu.yaml', check_data=False); "
        "print(cfg.model.precision.params_dtype, cfg.model.precision.uses_transformer_engine(), "
        "'torch' in sys.modules, cpu_build())"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dtype, te, torch_imported, cpu_build = res.stdout.split()
    if cpu_build == "True":
        assert (dtype, te, torch_imported) == ("fp32", "False", "False")
    else:
        assert torch_imported == "True"
