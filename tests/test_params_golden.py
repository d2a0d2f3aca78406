"""``megatron-lol params`` keeps its numbers: every count of every config in examples/configs against
tests/golden/params.json, recorded from the analytic counter before counts were derived from the built
model. A config without ``model.vocab_size`` (its tokenizer is built by a pipeline) is counted at 8,000
tokens padded as the trainer pads them. The process state is the suite's (size 1), so the
counting builds run in place."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_lol.config import load_config
from megatron_lol.config.schema import ModelConfig
from megatron_lol.convert import mapping
from megatron_lol.model import inventory
from megatron_lol.model.params import category, count_parameters, expert_index
from megatron_lol.perf.params_cli import pad_vocab

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
GOLDEN = json.loads((Path(__file__).parent / "golden" / "params.json").read_text())


def test_golden_covers_every_example_config():
    assert sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml")) == sorted(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_counts_match_golden(megatron_env, name):
    cfg = load_config(CONFIGS / name, check_data=False)
    m = cfg.model
    vocab = m.vocab_size if m.vocab_size is not None else pad_vocab(8000, m.make_vocab_size_divisible_by)
    got = json.loads(json.dumps(count_parameters(m, vocab).to_dict()))
    want = GOLDEN[name]
    assert sorted(got) == sorted(want)
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not diff, f"{name}: (now, golden) {diff}"


def test_a_parameter_without_a_convention_is_refused():
    assert category("core.blocks.3.mlp.experts.local_experts.7.linear_fc1.weight") == "experts"
    assert expert_index("coda.0.mlp.experts.local_experts.7.linear_fc2.weight") == 7
    with pytest.raises(ValueError, match="core.new_part: no counting convention"):
        category("core.new_part")


def test_a_parallel_run_counts_in_a_child_process():
    # the trainer's FLOP / memory figures under TP > 1 count through a lone child process: same walk
    cfg = load_config(CONFIGS / "paper" / "foil-2.yaml", check_data=False)
    small = dataclasses.replace(cfg.model, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    assert inventory._walk_in_child(small, 256) == inventory._walk(small, 256)


SHAPES = json.loads((Path(__file__).parent / "golden" / "native_shapes.json").read_text())


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_checkpoint_names_and_shapes_match_golden(megatron_env, case):
    # the checkpoint / HF export's tensor inventory (convert.mapping.native_shapes), one case per plan and
    # option, recorded from the hand-written map before it was derived from the built model
    model = ModelConfig(**SHAPES[case]["model"])
    got = {name: list(shape) for name, shape in mapping.native_shapes(model, 96).items()}
    assert got == dict(SHAPES[case]["shapes"])


def test_counting_keeps_a_live_runs_moe_loss_tracker(megatron_env):
    # building an MoE model clears megatron-core's process-global tracker; a run that counts mid-training
    # (profile's memory model) keeps its own entries
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    tracker["live-run-entry"] = {"values": None}
    try:
        model = ModelConfig(**SHAPES["moe-dense-fixed"]["model"])
        count_parameters(dataclasses.replace(model, hidden_size=48, num_attention_heads=4), 96)
        assert "live-run-entry" in tracker
    finally:
        tracker.pop("live-run-entry", None)
