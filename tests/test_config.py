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
        ({"window_size": 0}, "model.window_size: must be > 0 (got 0)"),
        ({"window_size": -4}, "model.window_size: must be > 0 (got -4)"),
        ({"window_shift": 32}, "model.window_shift: must be in [0, window_size=32) (got 32)"),
        ({"window_shift": -1}, "model.window_shift: must be in [0, window_size=32) (got -1)"),
        ({"routed_depth": 0}, "model.plan.routed_depth: must be > 0 (got 0)"),
        ({"num_blocks": 0}, "model.plan.num_blocks: must be > 0 (got 0)"),
        (
            {"hidden_size": 130, "num_attention_heads": 4},
            "model.num_attention_heads: 4 does not divide model.hidden_size=130",
        ),
        ({"plan": "moe"}, "model.plan: kind must be one of dense, looped, foil, lol, accordion (got 'moe')"),
        ({"window_size": "big"}, "model.window_size must be int (got 'big')"),
    ],
)
def test_bad_model_values(model, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": model})
    assert message in str(err.value) and "\n" not in str(err.value)


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
    cfg["model"]["window_shift"] = 40
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
    assert lines == ["megatron-lol train: error: model.window_shift: must be in [0, window_size=32) (got 40)"]
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
            "model.window_shift=16",
            "--micro-batch-size",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "training.micro_batch_size (--micro-batch-size): must be > 0 (got 0)" in proc.stderr
