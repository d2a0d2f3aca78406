"""A Megatron-LM user's first hour: smoke runs, Megatron-LM's flags and checkpoint semantics,
layout-independent defaults, traces, the memory estimate, a fast evaluate, and the small points.

Cheap checks run in this process. The training journeys share two launches:

* one process (:func:`_one_process`): the bundled config's default optimizer at TP=1 (duplicated
  and blockwise Muon, equal at one process), then ``megatron-lol train`` in-process on a tiny
  corpus: a warm-up longer than the run, ``--exit-interval`` and ``--profile`` (a torch.profiler
  Chrome trace with the routed-depth, router, dispatch and block ranges); a resume with another
  ``--train-iters`` stopped with one line, then continued with each scheduler flag;
  ``--use-checkpoint-args`` without ``--config``; ``evaluate``'s packed training forward against
  the plain-PyTorch model's per-document losses on that checkpoint;
* two processes (:func:`_two_processes`): the same optimizer at TP=2 (within 1e-5 of one process
  over 5 steps; blockwise measurably not), and the packed evaluation at TP=2 (the same losses).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "tiny-cpu.yaml"
STEPS = 5


def _parse(*argv):
    from megatron_lol.cli import Parser
    from megatron_lol.config import config_from_args
    from megatron_lol.training import cli as train_cli

    parser = Parser(prog="megatron-lol train")
    train_cli.add_arguments(parser)
    return config_from_args(parser.parse_args([str(a) for a in argv]), check_data=False)


def _main(capsys, *argv) -> tuple:
    """``(status, stdout, the error line of stderr or all of it)`` of ``megatron-lol ARGV`` in this process."""
    from megatron_lol.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: the usage, then the error line
        code = exc.code
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if ": error: " in line]
    return code, out.out, errors[-1] if errors else out.err


# ------------------------------------------------------------------ flags
def test_megatron_lm_flags_alias_their_keys():
    cfg = _parse(
        "--config",
        TINY,
        "--hidden-size",
        96,
        "--num-attention-heads",
        6,
        "--ffn-hidden-size",
        256,
        "--num-query-groups",
        2,
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--data-cache-path",
        "/tmp/cache",
        "--exit-interval",
        7,
        "--override-opt_param-scheduler",
        "--profile",
        "--profile-step-start",
        3,
        "--profile-step-end",
        5,
        "--profile-ranks",
        0,
        1,
        "--use-pytorch-profiler",
    )
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    assert (m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.num_query_groups) == (96, 6, 256, 2)
    assert (par.recompute_granularity, par.recompute_method, cfg.data.cache_dir) == ("full", "uniform", "/tmp/cache")
    assert (
        tr.exit_interval,
        tr.override_opt_param_scheduler,
        tr.profile,
        tr.profile_step_start,
        tr.profile_step_end,
        tr.profile_ranks,
        tr.use_pytorch_profiler,
    ) == (7, True, True, 3, 5, [0, 1], True)
    from megatron_lol.errors import ConfigError

    with pytest.raises(ConfigError, match="recompute_method: block is not offered"):
        _parse("--config", TINY, "--recompute-granularity", "full", "--recompute-method", "block")
    with pytest.raises(ConfigError, match="recompute_method: uniform needs recompute_granularity: full"):
        _parse("--config", TINY, "--recompute-method", "uniform")
    with pytest.raises(ConfigError, match="cannot be combined"):
        _parse("--config", TINY, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    # a warm-up longer than the run is a valid smoke run of a long config
    assert _parse("--config", TINY, "--train-iters", 10).optimizer.lr_warmup_iters == 30
    # the bundled optimizer is layout-independent by default; blockwise under TP is said at start-up
    from megatron_lol.training.console import layout_dependence_note

    assert _parse("--config", TINY).optimizer.muon_tp_mode == "duplicated"
    assert layout_dependence_note(_parse("--config", TINY, "--tensor-model-parallel-size", 2)) is None
    note = layout_dependence_note(
        _parse("--config", TINY, "--tensor-model-parallel-size", 2, "--muon-tp-mode", "blockwise")
    )
    assert note.startswith("note: optimizer.muon_tp_mode blockwise (--muon-tp-mode)") and "depend on" in note


def test_megatron_lm_flags_without_equivalent_and_abbreviations(capsys):
    code, _, err = _main(capsys, "train", "--config", TINY, "--num-layers", 24)
    assert code == 2 and "--num-layers: a LoL model has no single layer count" in err and "--min-lr" not in err
    code, _, err = _main(capsys, "params", "--config", TINY, "--max-position-embeddings", 4096)
    assert code == 2 and "--max-position-embeddings: RoPE has no position table" in err
    code, _, err = _main(capsys, "train", "--config", TINY, "--train-iter", 5)  # no abbreviations
    assert code == 2 and "unrecognized arguments: --train-iter" in err
    code, _, err = _main(capsys, "train", "--config", TINY, "--exit-intervall", 5)  # a typo still gets a guess
    assert code == 2 and "--exit-interval" in err


@pytest.mark.multiprocess
def test_configuration_error_names_the_flag_and_is_printed_once(tmp_path):
    """The two ranks of a launch with a bad value (torchrun's environment; the value is refused before
    any process group): rank 0 prints one line naming key and flag, rank 1 nothing; both exit 2."""
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
            PYTHONWARNINGS="ignore",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="1",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megatron_lol",
                    "train",
                    "--config",
                    str(TINY),
                    "--micro-batch-size",
                    "0",
                    "--save",
                    str(tmp_path / "run"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=env,
            )
        )
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [r[0] for r in results] == [2, 2]
    assert results[0][2].strip().splitlines() == [
        "megatron-lol train: error: training.micro_batch_size (--micro-batch-size): must be > 0 (got 0)"
    ]
    assert results[1][2].strip() == "" and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ small points
def test_empty_corpus_is_refused_by_preprocess_and_by_the_dataset_check(corpus, tmp_path, capsys):
    from megatron_lol.config import load_config
    from megatron_lol.data.indexed import StreamingIndexWriter
    from megatron_lol.errors import ConfigError

    tok = corpus["tokenizer"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n')
    code, _, err = _main(
        capsys,
        "preprocess",
        "--input",
        empty,
        "--output-prefix",
        tmp_path / "out",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        tok,
        "--append-eod",
        "--workers",
        1,
        "--no-progress",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no document with text" in err, err
    assert not list(tmp_path.glob("out*"))
    import numpy as np

    writer = StreamingIndexWriter(str(tmp_path / "none_text_document"), np.uint16)  # an empty dataset on disk
    writer.finalize()
    raw = yaml.safe_load(TINY.read_text())
    raw["data"].update(paths=[str(tmp_path / "none_text_document")], tokenizer_model=tok)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^data.paths: .*none_text_document.idx holds no documents"):
        load_config(tmp_path / "cfg.yaml")  # what train (and --dry-run) validates before any work


def test_quickstart_suggests_the_bundled_split():
    from megatron_lol.data.quickstart import BUNDLED_SPLIT

    assert yaml.safe_load(TINY.read_text())["data"]["split"] == BUNDLED_SPLIT
    quickstart = (REPO / "docs" / "data.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"`(\d+,\d+,\d+)`", quickstart) == [BUNDLED_SPLIT]  # the docs say what the config has


def test_convert_hf_refuses_an_existing_save_before_importing_torch(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    code = (
        "import sys; from megatron_lol.cli import main; "
        f"rc = main(['convert-hf', '--load', {str(tmp_path / 'ckpt')!r}, '--save', {str(tmp_path / 'out')!r}]); "
        "print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "exists and is not empty (pass --force" in proc.stderr


def test_exported_safetensors_follow_the_umask(tmp_path):
    import torch

    from megatron_lol.convert.to_hf import ShardWriter

    old = os.umask(0o027)
    try:
        writer = ShardWriter(str(tmp_path), 1 << 20)
        writer.add("a", torch.zeros(4))
        writer.finish()
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"model-00001-of-00001.safetensors": 0o640, "model.safetensors.index.json": 0o640}


def test_known_warnings_are_quiet_on_cpu():
    import warnings

    from megatron_lol.cli import quiet_known_warnings

    shown = []
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        restore = quiet_known_warnings()
        try:
            for text, where in (
                (
                    "When using async grad allreduce it is recommended to set the environment variable "
                    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
                    "megatron/core/tensor_parallel/layers.py",
                ),
                (
                    "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead.",
                    "megatron/core/dist_checkpointing/strategies/torch.py",
                ),
                ("something else", "megatron/core/other.py"),
            ):
                warnings.showwarning(UserWarning(text), UserWarning, where, 1)
        finally:
            restore()
    assert shown == ["something else"]


def test_profile_warns_when_step_times_vary():
    from megatron_lol.training.profile import step_time_warning

    assert step_time_warning([0.3, 0.31, 0.32]) is None
    assert "vary 8.0x" in step_time_warning([0.3, 2.4, 0.31])


# ------------------------------------------------------------------ memory estimate
def test_memory_estimate_follows_the_layout(capsys):
    from megatron_lol.config import load_config
    from megatron_lol.perf.memory import Layout, rank_memory

    def est(world=None, **par):
        cfg = load_config(
            TINY,
            [(f"parallel.{k}", v, "t") for k, v in par.items()]
            + [("model.vocab_size", 8064, "t"), ("training.global_batch_size", 16, "t")],
            check_data=False,
        )
        layout = Layout.of(cfg, world)
        return [rank_memory(cfg, 8064, layout, r) for r in range(layout.pp)]

    one, tp2, pp2 = est()[0], est(tensor_model_parallel_size=2)[0], est(pipeline_model_parallel_size=2)
    assert 0.45 < tp2.params / one.params < 0.55 and 0.45 < tp2.logits / one.logits < 0.55
    from megatron_lol.model.params import count_parameters

    counts = count_parameters(load_config(TINY, check_data=False).model, 8064)
    library = 4 * counts.block.total + counts.router + counts.depth_vectors  # the core's stored parts
    assert pp2[0].logits == 0 and pp2[1].logits == one.logits
    # both stages host routed depths, so both hold the library and router; 1F1B: stage 0 holds 2 micro-batches
    assert sum(r.params for r in pp2) - one.params == library and (pp2[0].in_flight, pp2[1].in_flight) == (2, 1)
    dist = est(2, use_distributed_optimizer=True)[0]
    assert dist.optimizer == pytest.approx(one.optimizer / 2) and dist.weights == one.weights
    sp = est(tensor_model_parallel_size=2, sequence_parallel=True)[0]
    full = est(recompute_granularity="full")[0]
    assert sp.activations < tp2.activations and full.activations < one.activations / 5
    code, out, _ = _main(
        capsys,
        "memory",
        "--config",
        TINY,
        "--pipeline-model-parallel-size",
        2,
        "--world-size",
        4,
        "--set",
        "training.global_batch_size=16",
        "--device-memory",
        1,
        "--vocab-size",
        8000,
    )
    assert code == 0 and "TP 1 x PP 2 x DP 2" in out and "stage 1" in out and "of the device (1.00 GiB)" in out
    code, plain, _ = _main(capsys, "params", "--config", TINY, "--vocab-size", 8000)
    code, laid, _ = _main(
        capsys,
        "params",
        "--config",
        TINY,
        "--vocab-size",
        8000,
        "--tensor-model-parallel-size",
        2,
        "--pipeline-model-parallel-size",
        2,
        "--use-distributed-optimizer",
    )
    assert code == 0 and laid.startswith(plain.rstrip("\n")) and "per rank (TP 2 x PP 2" in laid


def test_memory_estimates_the_target_device_not_the_login_node(capsys):
    """params_dtype auto is BF16 on the GPU the job will have, on this CPU machine too (--target gpu, the
    default); --target cpu estimates a CPU run; an explicit dtype is kept."""
    import json

    paper = REPO / "examples" / "configs" / "paper" / "lol-360m-L8.yaml"
    runs = {}
    for extra in ((), ("--target", "cpu"), ("--set", "model.precision.params_dtype=fp32")):
        code, out, err = _main(capsys, "memory", "--config", paper, "--world-size", 8, "--json", *extra)
        assert code == 0, err
        runs[extra[:2]] = json.loads(out)
    gpu, cpu, fp32 = runs[()], runs[("--target", "cpu")], runs[("--set", "model.precision.params_dtype=fp32")]
    assert (gpu["target"], gpu["params_dtype"], cpu["params_dtype"], fp32["params_dtype"]) == (
        "gpu",
        "bf16",
        "fp32",
        "fp32",
    )
    assert gpu["device_memory_bytes"] is None  # no local GPU here to compare with
    assert gpu["ranks"][0]["weights"] * 2 == cpu["ranks"][0]["weights"]
    assert gpu["ranks"][0]["total"] < cpu["ranks"][0]["total"]


# ------------------------------------------------------------------ --use-checkpoint-args
def test_use_checkpoint_args_takes_model_and_tokenizer_from_the_checkpoint(tmp_path):
    from megatron_lol.errors import ConfigError
    from megatron_lol.training.checkpoint_args import config_with_checkpoint_args

    saved = yaml.safe_load(TINY.read_text())
    saved["model"].update(hidden_size=64, num_attention_heads=2, vocab_size=8064)
    saved["data"]["tokenizer_model"] = "/elsewhere/tok.model"
    saved["checkpoint"] = {"tokenizer": {"copied_files": {"tokenizer_model": "tokenizer/tok.model"}}}
    it = tmp_path / "run" / "iter_0000004"
    (it / "tokenizer").mkdir(parents=True)
    (it / "tokenizer" / "tok.model").write_text("x")
    (it / "run_config.yaml").write_text(yaml.safe_dump(saved))
    (it / "metadata.json").write_text("{}")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("4")
    save = [("training.save", str(tmp_path / "run"), "--save")]
    cfg = config_with_checkpoint_args(
        str(TINY), save + [("training.train_iters", 9, "--train-iters")], check_data=False
    )
    assert (cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.vocab_size) == (64, 2, 8064)
    assert cfg.data.tokenizer_model == str(it / "tokenizer" / "tok.model") and cfg.training.train_iters == 9
    assert cfg.data.paths == yaml.safe_load(TINY.read_text())["data"]["paths"]  # the rest is --config's
    flagged = config_with_checkpoint_args(None, save + [("model.hidden_size", 32, "--hidden-size")], check_data=False)
    assert flagged.model.hidden_size == 32  # flags win
    with pytest.raises(ConfigError, match="--use-checkpoint-args: no checkpoint to take the arguments from"):
        config_with_checkpoint_args(str(TINY), [("training.save", str(tmp_path / "none"), "--save")], check_data=False)


# ------------------------------------------------------------------ launches
def _muon_losses(modes: list) -> dict:
    """The bundled config's optimizer section (with its defaults) on a small LoL model, STEPS steps."""
    from megatron_lol.config import load_config
    from megatron_lol.training.profile import SyntheticDataset, _StubTokenizer
    from megatron_lol.training.trainer import Trainer

    out = {}
    for name, extra in modes:
        over = {
            "model.hidden_size": 64,
            "model.ffn_hidden_size": 128,
            "model.plan.windows.size": 16,
            "model.plan.windows.shift": 8,
            "model.vocab_size": 256,
            "training.seq_length": 64,
            "training.micro_batch_size": 2,
            "training.global_batch_size": 4,
            "training.train_iters": STEPS,
            "curriculum.initial_depth": None,
            **extra,
        }
        cfg = load_config(TINY, [(k, v, "test") for k, v in over.items()], check_data=False)
        trainer = Trainer(
            cfg, tokenizer=_StubTokenizer(256, eod=2), datasets=(SyntheticDataset(64, 256, 2, seed=3), None, None)
        ).setup()
        data = trainer.data_iterator(trainer.train_ds, 0)
        out[name] = [trainer.train_step(data).loss for _ in range(STEPS)]
    return out


def _cli(*argv) -> tuple:
    """``(status, stdout + stderr)`` of ``megatron-lol ARGV`` run in this process."""
    from megatron_lol.cli import main

    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        code = main([str(a) for a in argv])
    return code, text.getvalue()


def _metrics(save: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def _heldout(corpus: dict) -> list:
    """Three documents: short, medium, and one long enough for several pieces of 64 tokens."""
    import sentencepiece as spm
    from corpus_fixtures import stdlib_documents

    sp = spm.SentencePieceProcessor(model_file=corpus["tokenizer"])
    texts = stdlib_documents(max_bytes=400_000, max_doc=4000)[-3:]
    return [sp.encode(texts[0][:120]), sp.encode(texts[1][:600]), sp.encode(texts[2][:2400])]


def _packed_nll(save: str, docs: list, tp: int = 1) -> list:
    from megatron_lol.convert.checkpoint import iteration_dir, read_run_config
    from megatron_lol.inference.evaluate import pieces
    from megatron_lol.inference.packed_eval import PackedScorer, build_model

    path, _ = iteration_dir(save)
    cfg, info, _ = read_run_config(path, save)
    eod = info["tokenizer"]["eod_id"]
    chunks = build_model(cfg, cfg.model.vocab_size, eod, path, tensor_parallel=tp)
    rows = [p for i, d in enumerate(docs) for p in pieces(i, d, eod, cfg.training.seq_length)]
    nll, _ = PackedScorer(chunks, 2, cfg.training.seq_length, eod).score(rows, len(docs))
    return nll.tolist()


def _one_process(corpus: dict, root: str) -> dict:
    from test_checkpointing import write_config

    from megatron_lol.inference.evaluate import pieces, score_rows
    from megatron_lol.inference.loading import load_model

    out = {"muon": _muon_losses([("duplicated", {}), ("blockwise", {"optimizer.muon_tp_mode": "blockwise"})])}
    root = Path(root)
    config = write_config(
        root / "tiny.yaml", corpus["prefix"], corpus["tokenizer"], str(root / "cache"), train_iters=3, save_interval=100
    )
    # smoke run: a warm-up longer than the run, --exit-interval, and --profile over iterations 0 and 1
    smoke = root / "smoke"
    code, text = _cli(
        "train",
        "--config",
        config,
        "--save",
        smoke,
        "--lr-warmup-iters",
        10,
        "--exit-interval",
        2,
        "--profile",
        "--use-pytorch-profiler",
        "--profile-step-start",
        0,
        "--profile-step-end",
        2,
    )
    out["smoke"] = (
        code,
        text,
        (smoke / "latest_checkpointed_iteration.txt").read_text().strip(),
        sorted(_metrics(smoke)),
    )
    trace = smoke / "profile" / "trace-rank0-iter0-2.json"
    events = json.loads(trace.read_text())["traceEvents"] if trace.exists() else []
    out["ranges"] = sorted({e.get("name") for e in events if e.get("cat") == "user_annotation"})
    # resumes: train_iters 3 -> 5 stops in one line; the checkpoint's schedule kept (decay over 3);
    # then this run's (decay over 8)
    save = root / "run"
    out["first"] = _cli("train", "--config", config, "--save", save)[0]
    out["mismatch"] = _cli("train", "--config", config, "--save", save, "--train-iters", 5)
    out["keep"] = _cli(
        "train", "--config", config, "--save", save, "--train-iters", 5, "--use-checkpoint-opt_param-scheduler"
    )[0]
    out["override"] = _cli(
        "train", "--config", config, "--save", save, "--train-iters", 8, "--override-opt_param-scheduler"
    )[0]
    out["lr"] = {s: r["lr"] for s, r in _metrics(save).items()}
    out["dry_run"] = _cli("train", "--use-checkpoint-args", "--save", save, "--dry-run")
    # evaluate: the packed training forward against the plain-PyTorch model, one piece per row
    docs = _heldout(corpus)
    loaded = load_model(str(save))
    rows = [p for i, d in enumerate(docs) for p in pieces(i, d, loaded.eod_id, loaded.seq_length)]
    reference = [0.0] * len(docs)
    for row, value in zip(rows, score_rows(loaded.model, rows, pad=0)):
        reference[row[0]] += value
    out["reference_nll"] = reference
    out["packed_nll"] = _packed_nll(str(save), docs)
    out["pieces"] = len(rows)
    return out


def _two_processes(save: str, docs: list) -> dict:
    return {
        "muon": _muon_losses(
            [
                (name, dict(extra, **{"parallel.tensor_model_parallel_size": 2}))
                for name, extra in (("duplicated", {}), ("blockwise", {"optimizer.muon_tp_mode": "blockwise"}))
            ]
        ),
        "packed_nll": _packed_nll(save, docs, tp=2),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus_fixtures import indexed_corpus

    root = tmp_path_factory.mktemp("journeys_corpus")
    prefix, tok = indexed_corpus(str(root), max_bytes=150_000, max_doc=4000, vocab_size=384)
    return {"prefix": prefix, "tokenizer": tok}


def _relative(got: list, ref: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The one-process journeys, in a process of their own (not a daemon: checkpoint saves start a writer
    process). Computed by the first test that asks, the one-core test below: the two-process test reuses
    its results and holds the whole machine only for its own launch."""
    root = tmp_path_factory.mktemp("journeys")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps([corpus, str(root)])],
        cwd=str(root),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, **json.loads((root / "one_process.json").read_text())}


@pytest.mark.timeout(900)
def test_training_journeys_of_one_process_traces_and_evaluate(one_process):
    one = one_process
    # the bundled optimizer's default: one process, duplicated == blockwise (the same update)
    assert one["muon"]["duplicated"] == one["muon"]["blockwise"]
    # smoke run: the warm-up note, exit at the interval with status 0 and a checkpoint
    code, text, tracked, steps = one["smoke"]
    assert code == 0 and tracked == "2" and steps == [1, 2], text[-2000:]
    assert "the run ends inside the warm-up" in text and "exit interval: stopping at iteration 2" in text
    # the trace holds the prelude, every routed depth with its router and dispatch, the blocks and the coda
    assert {"prelude", "depth 1", "depth 2", "router", "dispatch", "block 0", "coda"} <= set(one["ranges"]), one[
        "ranges"
    ]
    # a changed schedule on resume: one line, nothing trained; then each flag
    code, text = one["mismatch"]
    lines = [line for line in text.splitlines() if "error:" in line]
    assert one["first"] == 0 and code == 2 and len(lines) == 1, text[-2000:]
    assert "lr_decay_steps 3 -> 5 (--train-iters)" in lines[0] and "--override-opt_param-scheduler" in lines[0]
    assert "--use-checkpoint-opt_param-scheduler" in lines[0]
    assert one["keep"] == 0 and one["override"] == 0
    lr = {int(step): value for step, value in one["lr"].items()}
    assert sorted(lr) == list(range(1, 9))
    assert lr[4] == pytest.approx(3e-4) and lr[5] == pytest.approx(3e-4)  # the checkpoint's decay over 3
    assert lr[6] > 2 * 3e-4  # this run's decay over 8
    code, text = one["dry_run"]
    assert code == 0 and "config OK" in text, text
    # evaluate: the packed training forward gives the reference's per-document losses
    assert one["pieces"] > 3
    assert _relative(one["packed_nll"], one["reference_nll"]) < 1e-5, (one["packed_nll"], one["reference_nll"])


@pytest.mark.timeout(900)
@pytest.mark.multiprocess
def test_training_journeys_at_tp2_equal_one_process(one_process, corpus):
    one = one_process
    two = run_distributed(_two_processes, 2, str(one["root"] / "run"), _heldout(corpus), timeout=600)
    got = two[0]
    assert two[0]["muon"] == two[1]["muon"]
    ref = one["muon"]["duplicated"]
    assert ref[0] != ref[-1]
    assert _relative(got["muon"]["duplicated"], ref) < 1e-5, (got["muon"]["duplicated"], ref)
    assert _relative(got["muon"]["blockwise"], ref) > 1e-6  # blockwise (opt-in) depends on the TP size
    assert _relative(got["packed_nll"], one["packed_nll"]) < 1e-5
    assert all(math.isfinite(x) for x in got["packed_nll"])


if __name__ == "__main__":  # the one-process part of the journeys test
    import torch

    from megatron_lol.platform import init_distributed, setup_platform

    torch.set_num_threads(1)
    setup_platform()
    init_distributed()
    corpus_arg, root_arg = json.loads(sys.argv[1])
    result = _one_process(corpus_arg, root_arg)
    (Path(root_arg) / "one_process.json").write_text(json.dumps(result))
