"""Training budgets in FLOPs (``training.train_flops``): the steps per depth of a growing run against
counting them one by one, the iterations a budget buys (the largest run within it), validation, the
four 1B math configs at matched compute (the FLOP model and ``megatron-lol params``), and the trainer
deriving ``train_iters`` at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatron_lol.config import config_from_dict, load_config
from megatron_lol.errors import ConfigError
from megatron_lol.perf.budget import RunFlops, iterations_for_flops, run_training_flops
from megatron_lol.perf.flops import training_flops_per_step
from megatron_lol.plan import depth_at, steps_per_depth

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "examples" / "configs" / "paper"
MATH = ["math-1b-lol", "math-1b-dense-full", "math-1b-dense-sliding", "math-1b-dense-strided"]
TINY = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    n_prelude=1,
    n_coda=1,
    num_blocks=3,
    routed_depth=4,
    window_size=8,
    window_shift=4,
    vocab_size=128,
)


@pytest.mark.parametrize(
    "n,D,D0,fraction",
    [
        (100, 8, 1, 0.75),
        (38_000, 8, 1, 0.75),
        (9, 16, 1, 1.0),
        (7, 4, 4, 0.5),
        (1, 8, 1, 0.75),
        (13, 5, 2, 0.29),
        (0, 4, 1, 0.5),
    ],
)
def test_steps_per_depth_counts_every_step(n, D, D0, fraction):
    assert steps_per_depth(n, D, D0, fraction) == dict(Counter(depth_at(t, D, D0, fraction, n) for t in range(n)))


def _cfg(model=None, curriculum=None, **training):
    tr = dict(global_batch_size=4, micro_batch_size=2, seq_length=32)
    tr.update(training)
    return config_from_dict({"model": dict(TINY, **(model or {})), "curriculum": curriculum or {}, "training": tr})


def test_run_flops_sums_the_steps_and_the_budget_buys_the_largest_run():
    cfg = _cfg(curriculum={"initial_depth": 1, "growth_fraction": 0.75})
    run = RunFlops(cfg, 128)
    previous = 0.0
    for n in range(1, 40):
        by_step = sum(training_flops_per_step(cfg, depth_at(t, 4, 1, 0.75, n), 4, 32, vocab_size=128) for t in range(n))
        assert run(n) == pytest.approx(by_step, rel=1e-12)
        assert run(n) > previous  # strictly increasing: a bisection finds the iterations
        previous = run(n)
    for n in (1, 7, 23, 39):
        assert iterations_for_flops(cfg, 128, run(n)) == n
        assert iterations_for_flops(cfg, 128, run(n + 1) * (1 - 1e-9)) == n
    with pytest.raises(ConfigError, match=r"^training\.train_flops: .* less than one iteration"):
        iterations_for_flops(cfg, 128, run(1) / 2)


def test_validation_one_line_errors():
    ok = _cfg(train_flops=1e12)
    assert ok.training.train_iters is None and ok.training.train_flops == 1e12
    assert _cfg().training.train_iters == 100  # neither given: the default
    for training, message in (
        (
            dict(train_flops=1e12, train_iters=5),
            r"^training\.train_iters: 5 cannot be combined with "
            r"training\.train_flops=1e\+12",
        ),
        (dict(train_flops=1e12, global_batch_size=None), r"^training\.train_flops: needs training\.global_batch_size"),
        (dict(train_flops=-1.0), r"^training\.train_flops: must be > 0"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            _cfg(**training)
        assert "\n" not in str(err.value)
    # --train-iters on a budgeted config is refused, naming the way out
    with pytest.raises(ConfigError, match=r"training\.train_flops=null"):
        load_config(PAPER / "math-1b-lol.yaml", [("training.train_iters", 5, "--train-iters")], check_data=False)
    cfg = load_config(
        PAPER / "math-1b-lol.yaml",
        [("training.train_flops", None, "--set"), ("training.train_iters", 5, "--train-iters")],
        check_data=False,
    )
    assert cfg.training.train_iters == 5


def test_math_configs_at_matched_compute():
    """The paper compares the four "at matched FLOPs, about 90 ExaFLOPs": within 2% of each other."""
    totals = {}
    for name in MATH:
        cfg = load_config(PAPER / f"{name}.yaml", check_data=False)
        assert cfg.training.train_flops == 9.0e19 and cfg.training.train_iters is None
        n = iterations_for_flops(cfg, cfg.model.vocab_size)
        totals[name] = run_training_flops(cfg, cfg.model.vocab_size, n)
        assert 0.98 * 9.0e19 <= totals[name] <= 9.0e19
    assert max(totals.values()) / min(totals.values()) - 1 < 0.02
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "params", "--config", str(PAPER / "math-1b-lol.yaml"), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    training = json.loads(out.stdout)["training"]
    assert training["training_flops"] == pytest.approx(totals["math-1b-lol"], rel=1e-12)
    assert training["train_flops_budget"] == 9.0e19
    # the growing core makes LoL's early steps cheap: more steps than the dense models at one budget
    assert sum(training["steps_per_depth"].values()) == training["train_iters"] > 38_000


def test_trainer_derives_and_logs_the_iterations(megatron_env, capsys):
    from test_parallel_lol import SEQ, SyntheticTokens, TinyTokenizer

    from megatron_lol.training.trainer import Trainer

    raw = {
        "model": TINY,
        "curriculum": {"initial_depth": 1, "growth_fraction": 0.5},
        "training": dict(
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
    budget = RunFlops(config_from_dict({**raw, "training": dict(raw["training"], train_iters=1)}), 128)(3)
    cfg = config_from_dict({**raw, "training": dict(raw["training"], train_flops=budget)})
    trainer = Trainer(cfg, tokenizer=TinyTokenizer(), datasets=(SyntheticTokens(16, 0), None, None)).setup()
    assert cfg.training.train_iters == trainer.schedule_iters == 3
    assert f"training.train_flops {budget:.4g}: 3 iterations of 2 x {SEQ} tokens" in capsys.readouterr().out
    assert [trainer.depth_at(t) for t in range(3)] == [depth_at(t, 4, 1, 0.5, 3) for t in range(3)]
    outcome = trainer.train(callbacks=[])
    assert [r.step for r in outcome.results] == [1, 2, 3]
    # what a checkpoint's run_config.yaml records reloads: the budget, not the derived count
    from megatron_lol.training.checkpointing.state import run_config_dict

    saved = run_config_dict(trainer)
    saved.pop("checkpoint")
    assert saved["training"]["train_iters"] is None
    assert config_from_dict(saved).training.train_flops == budget
