"""``megatron-lol plan-layout``: paper configs fitted to 1-16 nodes of 8 GPUs, the Slurm examples as
written, and the scripts stopping before anything is queued or launched when a layout does not fit.

The planner and ``train --dry-run`` run in this process (the world size is faked through
``WORLD_SIZE``, as a launcher sets it); only the shell scripts' own behaviour starts processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lol.cli import main
from megatron_lol.config.loader import load_config
from megatron_lol.perf.planner import USABLE_FRACTION, memory_bytes, run_length

REPO = Path(__file__).resolve().parents[1]
PAPER = sorted((REPO / "examples" / "configs" / "paper").glob("*.yaml"))
NODES = (1, 2, 4, 8, 16)
GIB = 2**30


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A small tokenizer of each type the configs name (theirs are placeholders or Hub names): the dry run
    reads the tokenizer, the layout does not depend on it (every paper config sets model.vocab_size)."""
    import corpus_fixtures as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tokenizers")
    words = "the a of to and in is it that was for on are with as".split()
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(d / "tokenizer.json"))
    sp = T.train_sentencepiece(T.stdlib_documents(max_bytes=300_000), str(d / "sp"), vocab_size=600)
    return {"HuggingFaceTokenizer": str(d / "tokenizer.json"), "SentencePieceTokenizer": sp}


@pytest.fixture(autouse=True)
def _signals_kept():
    """``train`` installs its SIGTERM / SIGUSR1 handlers; give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _cli(*argv, world: int | None = None) -> tuple:
    """``(status, stdout, stderr)`` of ``megatron-lol ARGV`` in this process (``WORLD_SIZE=world``)."""
    out, err = io.StringIO(), io.StringIO()
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.pop("RANK", None)
    if world is not None:
        os.environ["WORLD_SIZE"] = str(world)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, out.getvalue(), err.getvalue()


def _dry_run(config, world: int, tokenizers: dict, extra=()) -> str:
    """``train --dry-run=config`` of ``config`` at ``world`` ranks, with a local tokenizer of its type."""
    kind = load_config(config, check_data=False).data.tokenizer_type
    code, out, err = _cli(
        "train", "--config", config, "--dry-run=config", "--tokenizer-model", tokenizers[kind], *extra, world=world
    )
    assert code == 0, f"{config} at world size {world}: {err.strip()}"
    assert f"world size {world} " in out, out
    return out


def _tokens(cfg) -> int:
    iters, _ = run_length(cfg, cfg.model.vocab_size)
    return iters * cfg.training.global_batch_size * cfg.training.seq_length


def test_paper_configs_at_every_cluster_size_take_the_first_proposal(tmp_path, tokenizers):
    """Every paper config at 1, 2, 4, 8 and 16 nodes x 8 GPUs of 80 GB: the first proposal (written by
    ``--output``) passes the dry run at that world size, fits the memory it reports (the estimator's
    figure for the written config, under 80 GiB) and keeps the total tokens within 1%."""
    assert len(PAPER) >= 20
    changed_batch = 0
    for config in PAPER:
        base = load_config(config, check_data=False)
        tokens = _tokens(base)
        for nodes in NODES:
            world = 8 * nodes
            derived = tmp_path / f"{config.stem}-{nodes}x8.yaml"
            code, out, err = _cli(
                "plan-layout", "--config", config, "--nodes", nodes, "--gpus-per-node", 8,
                "--device-memory", 80, "--top", 1, "--json", "--output", derived,
            )  # fmt: skip
            assert code == 0, f"{config.name} on {nodes} nodes: {err}"
            first = json.loads(out)["proposals"][0]
            _dry_run(derived, world, tokenizers)
            cfg = load_config(derived, check_data=False)
            assert cfg.training.micro_batch_size == first["micro_batch"]
            assert cfg.training.global_batch_size == first["global_batch"]
            assert (
                cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size * first["dp"]
                == world
            )
            cfg.model.precision.params_dtype = "bf16"  # the target's (auto is fp32 on this CPU machine)
            need = memory_bytes(cfg, cfg.model.vocab_size, world)
            assert first["fits"] and need == pytest.approx(first["memory_bytes"], rel=1e-9)
            assert need <= USABLE_FRACTION * 80 * GIB, f"{config.name} on {nodes} nodes: {need / GIB:.1f} GiB"
            got = _tokens(cfg)
            assert got == first["tokens"]
            assert abs(got / tokens - 1) <= 0.01, f"{config.name} on {nodes} nodes: {got} vs {tokens} tokens"
            changed_batch += cfg.training.global_batch_size != base.training.global_batch_size
    assert changed_batch > 0  # some sizes need another batch: the rescaling was exercised


def test_a_changed_batch_rescales_every_iteration_setting():
    """lol-360m-L4 on 32 GPUs: 1,040 -> 1,024 sequences; the schedule, intervals and run length follow."""
    code, out, err = _cli(
        "plan-layout", "--config", REPO / "examples/configs/paper/lol-360m-L4.yaml", "--nodes", 4, "--json"
    )
    assert code == 0, err
    plan = json.loads(out)
    assert "1040 is not a multiple of micro_batch_size x data_parallel_size = 832" in plan["config_error"]
    first = plan["proposals"][0]
    assert first["global_batch"] == 1024 and (first["tp"], first["pp"], first["dp"]) == (1, 1, 32)
    ch = first["changes"]
    assert ch["training.train_iters"] == [9390, 9537]  # 9390 x 1040 / 1024 = 9536.7
    assert ch["optimizer.lr_warmup_iters"] == [500, 508]
    assert ch["training.eval_interval"] == [500, 508] and ch["training.save_interval"] == [1000, 1016]
    assert ch["training.eval_iters"] == [20, 21]  # rounded up: at least 20 x 1040 validation sequences
    assert "training.log_interval" not in ch


def test_check_passes_a_fitting_layout_and_refuses_another_with_the_first_proposal(tmp_path, tokenizers):
    config = REPO / "examples/configs/paper/lol-360m-L8.yaml"
    code, out, err = _cli("plan-layout", "--config", config, "--nodes", 1, "--check")
    assert code == 0 and "layout OK at 1 x 8 = 8 ranks" in out, err
    code, out, err = _cli("plan-layout", "--config", config, "--nodes", 16, "--check")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("megatron-lol plan-layout: error: training.global_batch_size: 1040 is not a multiple")
    assert "first proposal for 16 x 8 ranks" in lines[1] and "--global-batch-size 1024" in lines[1]
    # the flags printed are what train takes: with them the run validates at 128 ranks
    flags = shlex.split(lines[1].split("writes it): ", 1)[1])
    assert "world size 128" in _dry_run(config, 128, tokenizers, flags)
    # a layout over the device memory, when the memory is given
    code, out, err = _cli("plan-layout", "--config", config, "--nodes", 1, "--device-memory", 16, "--check")
    assert code == 2 and "more than --device-memory 16 GiB" in err, err
    assert not list(tmp_path.iterdir())


def test_bad_allocation_flags_are_one_line_errors(tmp_path):
    config = REPO / "examples/configs/paper/lol-360m-L8.yaml"
    for argv, text in (
        (("--nodes", 0), "--nodes: must be >= 1 (got 0)"),
        (("--nodes", 2, "--mfu", 1.5), "--mfu: must be in (0, 1] (got 1.5)"),
        (("--nodes", 2, "--output", tmp_path / "no" / "x.yaml"), "--output: directory"),
    ):
        code, out, err = _cli("plan-layout", "--config", config, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and text in err, err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ the examples, as written
def _joined(lines) -> list:
    """Shell lines with backslash continuations joined."""
    out, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def _example_groups() -> list:
    """(where, [command lines]) of every example: the sbatch scripts' and submit_pipeline.sh's headers
    (comment lines before the first ``#SBATCH`` / ``set``), and docs/slurm.md's bash blocks."""
    groups = []
    for script in sorted((REPO / "slurm").glob("*.sbatch")) + [REPO / "slurm/submit_pipeline.sh"]:
        head = []
        for line in script.read_text().splitlines()[1:]:
            if not line.startswith("#") or line.startswith("#SBATCH"):
                break
            head.append(line[1:].strip())
        groups.append((script.name, _joined(head)))
    text = (REPO / "docs/slurm.md").read_text()
    for i, block in enumerate(text.split("```bash\n")[1:]):
        groups.append((f"docs/slurm.md block {i + 1}", _joined(block.split("```")[0].splitlines())))
    return groups


def _training_runs(words: list) -> list:
    """(config, nodes, processes per node, extra train args, device memory) of the training stages a
    command submits."""
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[:1] == ["sbatch"]:
        opts = dict(w[2:].split("=", 1) for w in words[1:-1] if w.startswith("--") and "=" in w)
        script = Path(words[-1]).name
        if script not in ("pretrain.sbatch", "context_extension.sbatch", "profile.sbatch"):
            return []
        exports = dict(kv.split("=", 1) for kv in opts.get("export", "").split(",") if "=" in kv)
        env.update(exports)
        procs = int(env.get("PROCS_PER_NODE") or opts.get("gpus-per-node") or 1)
        default = "tiny-context-ext.yaml" if script == "context_extension.sbatch" else "tiny-slurm.yaml"
        config = env.get("CONFIG") or str(REPO / "examples/configs" / default)
        return [(config, int(opts.get("nodes", 1)), procs, shlex.split(env.get("TRAIN_ARGS", "")), None)]
    if words[:1] == ["bash"] and words[1].endswith("submit_pipeline.sh"):
        gpus = int(env.get("GPUS_PER_NODE") or 0)
        nodes, procs = int(env.get("NODES", 2)), int(env.get("PROCS_PER_NODE") or gpus or 1)
        runs = [
            (
                env.get("PRETRAIN_CONFIG") or str(REPO / "examples/configs/tiny-slurm.yaml"),
                nodes,
                procs,
                shlex.split(env.get("PRETRAIN_ARGS", "")),
                env.get("DEVICE_MEMORY"),
            )
        ]
        context = env.get("CONTEXT_CONFIG", str(REPO / "examples/configs/tiny-context-ext.yaml"))
        if context:
            runs.append((context, nodes, procs, shlex.split(env.get("CONTEXT_ARGS", "")), env.get("DEVICE_MEMORY")))
        return runs
    return []


def test_the_slurm_examples_validate_as_written(tmp_path, monkeypatch, tokenizers):
    """Every ``megatron-lol`` command of the examples runs (here: plan-layout, in order, so a derived
    config is there for the submission after it), and every training stage an ``sbatch`` or
    ``submit_pipeline.sh`` example submits passes the layout check and the dry run at the world size of
    its allocation. ``/repo`` is this repository; data and tokenizer paths are the site's (a local
    tokenizer of the config's type stands in)."""
    for name in ("examples", "slurm"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    checked, planned = [], 0
    for where, lines in _example_groups():
        for line in lines:
            line = line.replace("/repo/", f"{REPO}/")
            first = line.split(maxsplit=1)[0] if line.strip() else ""
            if first not in ("megatron-lol", "sbatch") and not (
                re.match(r"[A-Z_]+=", first) and "submit_pipeline.sh" in line
            ):
                continue  # prose, variable tables, cd, preprocess array examples
            words = shlex.split(line, comments=True)
            if words[0] == "megatron-lol":
                code, out, err = _cli(*words[1:])
                assert code == 0, f"{where}: {line}: {err.strip()}"
                planned += words[1] == "plan-layout"
                continue
            for config, nodes, per_node, extra, memory in _training_runs(words):
                world = nodes * per_node
                argv = ["plan-layout", "--check", "--config", config, "--nodes", nodes, "--gpus-per-node", per_node]
                code, out, err = _cli(*argv, *(["--device-memory", memory] if memory else []), *extra)
                assert code == 0, f"{where}: {line}: {err.strip()}"
                _dry_run(config, world, tokenizers, extra)
                checked.append((where, Path(config).name, world))
    assert planned >= 4
    names = {(w, c, n) for w, c, n in checked}
    assert ("pretrain.sbatch", "lol-360m-L4-4x8.yaml", 32) in names
    assert any(c == "lol-360m-L4-16x8.yaml" and n == 128 for _, c, n in names)  # docs' 16-node pipeline
    assert ("submit_pipeline.sh", "lol-360m-L4-16x8.yaml", 128) in names


# ------------------------------------------------------------------ the scripts stop before sbatch / srun
def _recorder(bindir: Path, name: str, log: Path, output: str = "") -> None:
    """A fake ``name`` on PATH that appends its arguments to ``log`` (and prints ``output``)."""
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\n{output}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def _script_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK"))}
    env.update(
        PATH=f"{tmp_path / 'bin'}:{env['PATH']}",
        MEGATRON_LOL_PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        **{k: str(v) for k, v in extra.items()},
    )
    return env


def test_submit_pipeline_queues_nothing_when_the_layout_does_not_fit(tmp_path, tokenizers):
    """NODES=4 x 8 GPUs with the paper config as shipped: status 2, the reason and the planner's first
    proposal, and sbatch never called; with the config plan-layout writes for 4 x 8, the whole
    pipeline is submitted."""
    log = tmp_path / "sbatch.log"
    _recorder(tmp_path / "bin", "sbatch", log, output="echo 4242")
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text('{"text": "the a of"}\n')
    common = dict(
        INPUT=corpus,
        TOKENIZER_TYPE="HuggingFaceTokenizer",
        TOKENIZER_MODEL=tokenizers["HuggingFaceTokenizer"],
        NODES=4,
        GPUS_PER_NODE=8,
        CONTEXT_CONFIG="",
        WORK_DIR=tmp_path / "work",
    )
    paper = REPO / "examples/configs/paper/lol-360m-L4.yaml"
    run = subprocess.run(
        ["bash", str(REPO / "slurm/submit_pipeline.sh")],
        cwd=tmp_path,
        env=_script_env(tmp_path, PRETRAIN_CONFIG=paper, **common),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith("submit_pipeline.sh: pretrain stage: megatron-lol plan-layout: error: ")
    assert "1040 is not a multiple" in lines[0] and lines[0].endswith("-- nothing submitted")
    assert "first proposal for 4 x 8 ranks" in lines[1] and "--global-batch-size 1024" in lines[1]
    assert not log.exists()

    fitted = tmp_path / "lol-360m-L4-4x8.yaml"
    code, out, err = _cli("plan-layout", "--config", paper, "--nodes", 4, "--output", fitted)
    assert code == 0, err
    run = subprocess.run(
        ["bash", str(REPO / "slurm/submit_pipeline.sh")],
        cwd=tmp_path,
        env=_script_env(tmp_path, PRETRAIN_CONFIG=fitted, **common),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and calls[2].endswith("slurm/pretrain.sbatch") and "--nodes=4" in calls[2]


def test_submit_pipeline_resolves_a_hub_tokenizer_before_queueing_and_the_jobs_run_offline(tmp_path, tokenizers):
    """TOKENIZER_MODEL=<Hub name>: resolved on the submitting host (here from a prepared Hub cache: this
    machine has no Hub), validated with it, and every job submitted with HF_HUB_OFFLINE=1 in its
    environment (sbatch exports the submitting shell's); a name the Hub cannot give stops the script with
    one line, status 2, nothing queued."""
    from corpus_fixtures import hub_cache

    name = "EleutherAI/gpt-neox-20b"
    snapshot = hub_cache(tmp_path / "hub", name, tokenizers["HuggingFaceTokenizer"])
    log = tmp_path / "sbatch.log"
    _recorder(tmp_path / "bin", "sbatch", log, output='echo "offline=$HF_HUB_OFFLINE" >> "' + str(log) + '"; echo 4242')
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text('{"text": "the a of"}\n')
    fitted = tmp_path / "lol-360m-L4-1x8.yaml"
    code, out, err = _cli(
        "plan-layout", "--config", REPO / "examples/configs/paper/lol-360m-L4.yaml", "--nodes", 1, "--output", fitted
    )
    assert code == 0, err

    def submit(tokenizer):
        env = _script_env(
            tmp_path,
            INPUT=corpus,
            TOKENIZER_TYPE="HuggingFaceTokenizer",
            TOKENIZER_MODEL=tokenizer,
            NODES=1,
            GPUS_PER_NODE=8,
            CONTEXT_CONFIG="",
            WORK_DIR=tmp_path / "work",
            PRETRAIN_CONFIG=fitted,
            HF_HUB_CACHE=tmp_path / "hub",
            HF_HUB_OFFLINE=1,  # the prepared cache stands in for the Hub
        )
        return subprocess.run(
            ["bash", str(REPO / "slurm/submit_pipeline.sh")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    run = submit("nobody/no-such-tokenizer")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("submit_pipeline.sh: TOKENIZER_MODEL=nobody/no-such-tokenizer: ")
    assert lines[0].endswith("-- nothing submitted") and not log.exists()

    run = submit(name)
    assert run.returncode == 0, run.stderr
    assert f"tokenizer: {name} from the Hub cache ({snapshot / 'tokenizer.json'})" in run.stdout
    calls = log.read_text().splitlines()
    jobs = [c for c in calls if c.startswith("sbatch ")]
    assert len(jobs) == 3 and calls.count("offline=1") == 3, calls


def test_submit_pipeline_without_any_tokenizer_queues_nothing(tmp_path):
    """No TOKENIZER_MODEL and a config that names none: one line saying what to set, status 2, sbatch never
    called and no directory made (a config whose tokenizer file is missing: tests/test_slurm.py)."""
    config = tmp_path / "no-tokenizer.yaml"
    text = (REPO / "examples/configs/tiny-slurm.yaml").read_text()
    config.write_text(text.replace("  tokenizer_model: runs/pipeline/data/tokenizer.model\n", ""))
    log = tmp_path / "sbatch.log"
    _recorder(tmp_path / "bin", "sbatch", log, output="echo 4242")
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text('{"text": "the a of"}\n')
    env = _script_env(tmp_path, INPUT=corpus, PRETRAIN_CONFIG=config, CONTEXT_CONFIG="", WORK_DIR=tmp_path / "work")
    for key in ("TOKENIZER_TYPE", "TOKENIZER_MODEL"):
        env.pop(key, None)
    run = subprocess.run(
        ["bash", str(REPO / "slurm/submit_pipeline.sh")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("submit_pipeline.sh: no tokenizer: set TOKENIZER_MODEL (a file, or a Hub name")
    assert run.stderr.rstrip().endswith(f"data.tokenizer_model in {config} -- nothing submitted"), run.stderr
    assert not log.exists() and not (tmp_path / "work").exists()


def test_pretrain_sbatch_launches_nothing_when_the_layout_does_not_fit(tmp_path):
    """The job's own check (before srun): status 2, the planner's first proposal in the log."""
    log = tmp_path / "srun.log"
    _recorder(tmp_path / "bin", "srun", log)
    env = _script_env(
        tmp_path,
        MEGATRON_LOL_ROOT=REPO,
        SLURM_JOB_NUM_NODES=4,
        GPUS_PER_NODE=8,
        CONFIG=REPO / "examples/configs/paper/lol-360m-L4.yaml",
        SAVE_DIR=tmp_path / "save",
    )
    run = subprocess.run(
        ["bash", str(REPO / "slurm/pretrain.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "layout check failed (status 2), nothing launched" in run.stdout
    assert "1040 is not a multiple" in run.stderr and "--global-batch-size 1024" in run.stderr
    assert not log.exists()
