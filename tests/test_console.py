"""The training console and the CLI around it.

One real training run (``examples/configs/tiny-cpu.yaml`` for 6 iterations on a
stdlib corpus, in a subprocess) serves several checks: the Megatron-style console
line, ``metrics.jsonl``, the TensorBoard event file read back with TensorBoard's
own event reader, a W&B offline run written without network, and a quiet stderr.
The rest runs in-process: CLI polish (``--version``, per-verb ``--help``, "did you
mean", ``params`` vocabulary from the config's tokenizer, ``preprocess`` output
directories), the warning filter, the progress reporter and the readable plots.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "configs" / "tiny-cpu.yaml"
LOGGED = (2, 4, 6)


def _env(**extra) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTHONWARNINGS",
        "MEGATRON_LOL_VERBOSE",
    ):
        env.pop(k, None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus_fixtures import indexed_corpus

    root = tmp_path_factory.mktemp("console_corpus")
    prefix, tok = indexed_corpus(str(root), max_bytes=150_000, max_doc=4000, vocab_size=384)
    return {"root": root, "prefix": prefix, "tokenizer": tok}


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """``megatron-lol train`` of the tiny config with TensorBoard and W&B (offline)."""
    root = tmp_path_factory.mktemp("console_run")
    save, wandb_home = root / "run", root / "wandb-home"
    cmd = [
        sys.executable,
        "-m",
        "megatron_lol",
        "train",
        "--config",
        str(TINY),
        "--data-path",
        corpus["prefix"],
        "--tokenizer-model",
        corpus["tokenizer"],
        "--set",
        f"data.cache_dir={root / 'cache'}",
        "--save",
        str(save),
        "--train-iters",
        "6",
        "--log-interval",
        "2",
        "--eval-interval",
        "4",
        "--eval-iters",
        "1",
        "--seq-length",
        "64",
        "--lr-warmup-iters",
        "1",
        "--tensorboard-dir",
        str(save / "tb"),
        "--wandb-project",
        "megatron-lol-ci",
        "--wandb-exp-name",
        "tiny-console",
        "--wandb-save-dir",
        str(save / "wb"),
    ]
    env = _env(
        WANDB_MODE="offline",
        WANDB_SILENT="false",
        WANDB_CONFIG_DIR=str(wandb_home),
        WANDB_CACHE_DIR=str(wandb_home),
        WANDB_DATA_DIR=str(wandb_home),
        WANDB_API_KEY="",
    )
    proc = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {"save": save, "stdout": proc.stdout, "stderr": proc.stderr, "records": records}


# ------------------------------------------------------------------ one training run
def test_console_line_and_metrics_jsonl(run):
    lines = run["stdout"].splitlines()
    assert lines[0].startswith("megatron-lol ") and " train: " in lines[0] and "importing megatron-core" in lines[0]
    assert "TensorBoard + W&B" in lines[0]
    first_training = next(i for i, ln in enumerate(lines) if ln.startswith("training:"))
    assert first_training > 0  # the start-up line came before megatron-core was imported
    by_step = {r["step"]: r for r in run["records"] if "loss" in r}
    assert sorted(by_step) == list(LOGGED)
    assert [r["step"] for r in run["records"] if "loss" not in r] == [0]  # eval_at_start of the tiny config
    for step in LOGGED:
        r = by_step[step]
        assert r["consumed_samples"] == 8 * step and r["consumed_tokens"] == 8 * step * 64
        assert r["skipped_iterations"] == 0 and r["nan_iterations"] == 0
        assert r["ms_per_iteration"] > 0 and r["peak_memory_bytes"] > 2**20 and r["peak_memory_kind"] == "rss"
        assert r["eta_s"] >= 0 and (step < 6 or r["eta_s"] == 0)
        assert len(r["routing_entropy"]) == r["depth"] == len(r["block_utilisation"])
        assert all(0 <= h <= math.log(4) + 1e-9 for h in r["routing_entropy"])
        assert r["bias_spread"] >= 0
        line = next(ln for ln in lines if re.match(rf"\s*iteration\s+{step}/6 \|", ln))
        for text in (
            f"samples {8 * step}",
            f"tokens {8 * step * 64:,}",
            "ms/iter ",
            f"loss {r['loss']:.4f}",
            f"depth {r['depth']}",
            "skipped 0",
            "nan 0",
            "peak mem ",
            "ETA ",
            "blocks [",
        ):
            assert text in line, (text, line)
    assert by_step[4]["eval_loss"] > 0 and "eval loss" in next(ln for ln in lines if " 4/6 |" in ln)


def test_tensorboard_event_file_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["save"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "batch-size",
        "depth",
        "balance-loss",
        "routing-entropy",
        "lm loss vs samples",
        "iteration-time",
        "throughput",
        "lm loss validation",
        "bias-spread",
        "mem-peak-rss-bytes",
    ):
        assert tag in tags, tag

    def series(tag):
        return {e.step: e.value for e in acc.Scalars(tag)}

    assert sorted(series("lm loss")) == [1, 2, 3, 4, 5, 6]  # --tensorboard-log-interval 1 (the default)
    assert sorted(series("iteration-time")) == list(LOGGED)
    assert sorted(series("lm loss validation")) == [0, 4, 6]
    assert sorted(series("lm loss vs samples")) == [8 * s for s in range(1, 7)]
    by_step = {r["step"]: r for r in run["records"] if "loss" in r}
    for step in LOGGED:
        r = by_step[step]
        assert series("lm loss")[step] == pytest.approx(r["loss"], rel=1e-6)
        assert series("learning-rate")[step] == pytest.approx(r["lr"], rel=1e-6)
        assert series("depth")[step] == r["depth"]
        for d, row in enumerate(r["block_utilisation"], start=1):
            got = [series(f"block-utilisation/depth-{d}/block-{b}")[step] for b in range(4)]
            assert got == pytest.approx(row, abs=1e-6)
            assert sum(got) == pytest.approx(1.0, abs=1e-5)
    assert series("depth")[1] == 2 and series("depth")[6] == 4  # the growing depth of the tiny config


def test_wandb_offline_run_files(run):
    runs = glob.glob(str(run["save"] / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    logs = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert len(logs) == 1 and os.path.getsize(logs[0]) > 0
    data = Path(logs[0]).read_bytes()
    # the history records name the logged keys (protobuf strings are stored as they are)
    for key in (b"lm loss", b"learning-rate", b"depth", b"block-utilisation/depth-1/block-0", b"megatron-lol-ci"):
        assert key in data, key


def test_quiet_start_up(run):
    own = [ln for ln in run["stderr"].splitlines() if ln.strip() and not ln.startswith("wandb:")]
    assert len(own) <= 1, own
    assert "not installed. Falling back" not in run["stderr"] and "cuda_graph_scope" not in run["stderr"]
    if own:
        assert own[0].startswith("note: Apex / Transformer Engine are not installed")


# ------------------------------------------------------------------ console pieces
def test_console_interval_and_counters():
    """--tensorboard-log-interval decides which iterations reach the sinks; skipped / NaN
    iterations are counted once per iteration and reset at each console line."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.training.console import TrainingConsole
    from megatron_lol.training.trainer import StepResult

    class Recorder:
        def __init__(self):
            self.points = []

        def write(self, scalars, step, samples=None):
            self.points.append((step, scalars))

        def flush(self):
            pass

    cfg = config_from_dict(
        {
            "model": {"window_size": 8, "window_shift": 4},
            "training": {"train_iters": 10, "tensorboard_log_interval": 3, "seq_length": 16},
        }
    )
    console = TrainingConsole(cfg, None, global_batch_size=4, world_size=1, rank0=True)
    console.sinks = Recorder()
    nan = float("nan")
    for step in range(1, 7):
        bad = step in (2, 3)
        res = StepResult(
            step=step,
            loss=nan if step == 2 else 1.0,
            aux_loss=0.0,
            lr=1e-3,
            grad_norm=nan if bad else 1.0,
            depth=2,
            tokens=64,
            seconds=0.1,
            skipped=bad,
            utilisation=[[0.5, 0.5], [1.0, 0.0]],
        )
        console.observe(res, 4 * step)
        console.observe(res, 4 * step)  # the hook and the log call both see an iteration: counted once
        if step == 4:
            rec = console.log_step(
                res,
                tokens_per_s=640.0,
                tflops_per_device=0.0,
                mfu=None,
                eval_loss=None,
                eval_by_budget=None,
                consumed_samples=16,
            )
            assert rec["skipped_iterations"] == 2 and rec["nan_iterations"] == 1
            assert rec["ms_per_iteration"] == pytest.approx(100.0)
            assert rec["routing_entropy"] == pytest.approx([math.log(2), 0.0])
    assert [step for step, scalars in console.sinks.points if "lm loss" in scalars] == [3, 6]
    assert console.skipped == 0 and console.nan == 0


def test_only_rank0_writes(tmp_path, capsys):
    from types import SimpleNamespace

    from megatron_lol.config import config_from_dict
    from megatron_lol.training.console import TrainingConsole
    from megatron_lol.training.trainer import StepResult

    cfg = config_from_dict(
        {
            "training": {
                "tensorboard_dir": str(tmp_path / "tb"),
                "wandb_project": "p",
                "wandb_save_dir": str(tmp_path / "wb"),
            }
        }
    )
    console = TrainingConsole(cfg, str(tmp_path / "metrics.jsonl"), global_batch_size=4, world_size=2, rank0=False)
    console.on_start(SimpleNamespace(iteration=0))
    res = StepResult(
        step=1, loss=1.0, aux_loss=0.0, lr=1e-3, grad_norm=1.0, depth=1, tokens=64, seconds=0.1, skipped=False
    )
    console.on_step_end(SimpleNamespace(consumed_train_samples=4, _step_flops=lambda r: 0.0, _log=lambda *a: None), res)
    assert (
        console.log_step(
            res,
            tokens_per_s=640.0,
            tflops_per_device=0.0,
            mfu=None,
            eval_loss=1.0,
            eval_by_budget=None,
            consumed_samples=4,
        )
        is None
    )
    console.log_eval(1.0, depth=1)
    console.on_end(None, None)
    assert console.sinks is None and list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""


def test_format_helpers():
    from megatron_lol.training.console import format_bytes, format_count, format_duration

    assert format_duration(3725.4) == "1:02:05" and format_duration(90000) == "1d 1:00:00"
    assert format_duration(None) == "-"
    assert format_count(81920) == "81,920" and format_count(3.34e9) == "3.34B"
    assert format_bytes(612 * 2**20) == "612 MiB" and format_bytes(3 * 2**30) == "3.00 GiB"


def test_known_warnings_become_one_note():
    from megatron_lol.cli import quiet_known_warnings

    stream = io.StringIO()
    shown = []
    old_show = warnings.showwarning
    warnings.showwarning = lambda message, *rest, **kw: shown.append(str(message))
    try:
        restore = quiet_known_warnings(stream)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            core = "/site-packages/megatron/core/optimizer/__init__.py"
            for text in (
                "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                "Apex is not installed. Falling back to Torch Norm",
                "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
            ):
                warnings.warn_explicit(text, UserWarning, core, 24)
            warnings.warn_explicit("a real problem", UserWarning, core, 30)  # other megatron warnings still show
            warnings.warn_explicit("Apex is not installed", UserWarning, "/home/me/train.py", 3)  # not megatron's
            # the distributed optimizer's zero_grad on its FP32 shard views, and torch's deprecations of its collectives
            warnings.warn_explicit(
                "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its "
                ".grad attribute won't be populated",
                UserWarning,
                "/site-packages/megatron/core/optimizer/optimizer.py",
                66,
            )
            c10d = "/site-packages/torch/distributed/c10d_logger.py"
            for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
                warnings.warn_explicit(
                    f"`torch.distributed.{name}` is deprecated. Please use ...", FutureWarning, c10d, 83
                )
            warnings.warn_explicit("`torch.distributed.broadcast_object_list` is deprecated", FutureWarning, c10d, 83)
        restore()
    finally:
        warnings.showwarning = old_show
    assert stream.getvalue().count("\n") == 1 and stream.getvalue().startswith("note: Apex / Transformer Engine")
    assert shown == [
        "a real problem",
        "Apex is not installed",
        "`torch.distributed.broadcast_object_list` is deprecated",
    ]


def test_progress_bar_on_terminal_and_lines_otherwise():
    from megatron_lol.progress import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    assert list(progress(range(5), desc="convert-hf", unit="tensor", stream=tty)) == list(range(5))
    assert "convert-hf" in tty.getvalue() and "\r" in tty.getvalue()  # tqdm redraws one line
    log = io.StringIO()
    assert list(progress(iter(range(3)), desc="analyze: routing", unit="batch", total=3, stream=log, interval=0)) == [
        0,
        1,
        2,
    ]
    assert log.getvalue().splitlines()[:2] == [
        "analyze: routing: batch 1 of 3 (33%), 0 s",
        "analyze: routing: batch 2 of 3 (67%), 0 s",
    ]
    assert "batch 3 of 3 done in" in log.getvalue() and "\r" not in log.getvalue()
    quiet = io.StringIO()
    list(progress(range(3), desc="x", stream=quiet, interval=3600))
    assert quiet.getvalue() == ""  # short work on a non-terminal prints nothing


# ------------------------------------------------------------------ CLI polish
def _main(*argv) -> int:
    from megatron_lol.cli import main

    return main([str(a) for a in argv])


def test_version_and_help(capsys):
    from megatron_lol import __version__

    assert _main("--version") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"megatron-lol {__version__} (megatron-core ")
    assert re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1) == __version__
    for verb, absent, present in (
        (
            "params",
            ("--save", "--lr", "--async-save", "--train-iters", "--tensorboard-dir"),
            ("--tensor-model-parallel-size", "--tokenizer-model", "--vocab-size", "counting:", "parallelism:"),
        ),
        ("profile", ("--save", "--lr", "--async-save", "--wandb-project"), ("--micro-batch-size", "--steps")),
        (
            "train",
            (),
            (
                "--tensorboard-dir",
                "--tensorboard-log-interval",
                "--wandb-project",
                "--wandb-exp-name",
                "--wandb-save-dir",
                "logging (console",
                "checkpointing:",
                "--save",
                "--verbose",
            ),
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            _main(verb, "--help")
        assert exc.value.code == 0
        text = capsys.readouterr().out
        for flag in absent:
            assert flag not in text, (verb, flag)
        for flag in present:
            assert flag in text, (verb, flag)


# preprocess's own tiktoken options keep Megatron-LM's names without help text (owned by the data code)
HELPLESS_OK: set = set()  # (verb, option) pairs allowed without help text: none


def test_every_option_has_help():
    import argparse
    import importlib

    from megatron_lol.cli import VERBS, Parser, add_general_arguments

    missing = []

    def walk(parser, verb):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub, verb)
            elif action.option_strings and not action.help and (verb, action.option_strings[-1]) not in HELPLESS_OK:
                missing.append(f"{parser.prog} {action.option_strings[-1]}")

    for verb, (module, _) in VERBS.items():
        parser = Parser(prog=f"megatron-lol {verb}")
        importlib.import_module(module).add_arguments(parser)
        add_general_arguments(parser)
        walk(parser, verb)
    assert not missing, missing


def test_did_you_mean(tmp_path, capsys):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("model:\n  hiden_size: 64\n")
    assert _main("params", "--config", cfg, "--vocab-size", 100) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'model.hiden_size' (did you mean 'model.hidden_size'?)" in err
    assert _main("params", "--config", TINY, "--vocab-size", 100, "--set", "training.lr=1") == 2
    assert "did you mean 'optimizer.lr'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main("params", "--config", TINY, "--vocab-szie", 100)
    assert "did you mean: --vocab-szie -> --vocab-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main("paramz")
    assert "did you mean 'params'?" in capsys.readouterr().err


def test_flag_errors_are_one_line_with_a_suggestion_that_matches(capsys, monkeypatch):
    """No usage before the error (``--help`` prints it); a Megatron-LM flag without an equivalent is
    answered with its own line, not with the known flag it starts with; a refused value names the
    flag that asked for it; under torchrun only rank 0 speaks."""
    with pytest.raises(SystemExit) as stop:
        _main("train", "--config", TINY, "--weight-decay-incr-style", "linear")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and not err.startswith("usage:"), err
    assert "--weight-decay-incr-style: the weight decay is constant over the run: --weight-decay" in err
    assert "did you mean" not in err
    with pytest.raises(SystemExit):
        _main("train", "--config", TINY, "--weight-decay-incr")  # longer than --weight-decay: not its typo
    assert "did you mean: --weight-decay-incr -> --weight-decay?" not in capsys.readouterr().err
    assert _main("train", "--config", TINY, "--fp16", "--dry-run=config") == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-lol train: error: model.precision.params_dtype (--fp16): fp16 is not offered"), err
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stop:
        _main("train", "--config", TINY, "--lrr", 1)
    assert stop.value.code == 2 and capsys.readouterr().err == ""


def _params(cwd, *args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_lol", "params", "--config", str(TINY), *args],
        cwd=str(cwd),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_params_takes_the_vocabulary_from_the_config_tokenizer(corpus, tmp_path):
    # the quickstart's tokenizer is absent: one clear line, exit 2
    out = _params(tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "data/quickstart/tokenizer.model does not exist" in out.stderr
    assert "prepare-quickstart" in out.stderr and "--vocab-size" in out.stderr
    # present (a 384-piece SentencePiece model where the config looks for it): the counts, stderr empty
    (tmp_path / "data" / "quickstart").mkdir(parents=True)
    shutil.copy(corpus["tokenizer"], tmp_path / "data" / "quickstart" / "tokenizer.model")
    out = _params(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "vocab 384" in out.stdout and "non-embedding" in out.stdout and "total" in out.stdout
    assert len(out.stderr.splitlines()) <= 1, out.stderr
    out = _params(tmp_path, "--json", "--tensor-model-parallel-size", "2", "--verbose")
    d = json.loads(out.stdout)
    assert d["vocab_size_given"] == 384 and d["vocab_size"] == 384  # the same padding at every TP size
    assert d["embedding"] == 384 * 128


def test_preprocess_creates_the_output_directory(corpus, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(20)))
    prefix = tmp_path / "new" / "nested" / "out"
    assert (
        _main(
            "preprocess",
            "--input",
            src,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            corpus["tokenizer"],
            "--append-eod",
            "--no-progress",
        )
        == 0
    )
    assert (tmp_path / "new" / "nested" / "out_text_document.bin").stat().st_size > 0
    assert (tmp_path / "new" / "nested" / "out_text_document.idx").exists()


# ------------------------------------------------------------------ plots
def test_plots_name_their_axes_and_show_overlaps():
    import torch

    from megatron_lol.analysis import plots
    from megatron_lol.analysis.routing import pca

    fig = plots.utilisation_heatmap(torch.tensor([[3, 1, 0], [0, 2, 2]]), None)
    try:
        ax = fig.axes[0]
        assert ax.get_xlabel() == "block" and ax.get_ylabel() == "routed depth"
        assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2"]
        assert "%" in fig.axes[1].get_ylabel()  # the colour bar's unit
    finally:
        fig.clf()
    # 12 examples on 3 distinct paths: 3 markers, each numbered with its examples
    base = torch.eye(3, 6)
    vec = base[torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])]
    coords, ratio = pca(vec, 2)
    fig = plots.pca_scatter(coords, None, None, ratio)
    try:
        ax = fig.axes[0]
        assert sum(len(c.get_offsets()) for c in ax.collections) == 3
        assert sorted(t.get_text() for t in ax.texts if t.get_text().isdigit()) == ["3", "4", "5"]
        assert "% of variance" in ax.get_xlabel()
    finally:
        fig.clf()
    # two labels on one path sit apart, not on top of each other
    coords = torch.zeros(4, 2)
    fig = plots.pca_scatter(coords, ["a", "a", "b", "b"], None)
    try:
        points = [tuple(c.get_offsets()[0]) for c in fig.axes[0].collections]
        assert len(points) == 2 and points[0] != points[1]
    finally:
        fig.clf()
