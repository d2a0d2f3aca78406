"""Checkpoints, resume, preemption and numerical faults of ``megatron-lol train``.

The end-to-end tests launch ``python -m megatron_lol train`` as subprocesses on a
tiny LoL model (hidden 32, seq 64, 12 iterations, a 512-piece SentencePiece
trained here on stdlib text) and compare per-step losses *bit for bit* (the
floats in metrics.jsonl round-trip exactly) against one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAULT_RUNNER = REPO / "tests" / "fault_rank_runner.py"  # faults injected through the trainer's FaultHooks
TRAIN_ITERS = 12
SAVE_INTERVAL = 4
LAUNCH_TIMEOUT = 240

TINY_CONFIG = """\
model:
  plan:
    kind: lol
    windows:
      size: 16
      shift: 8
  hidden_size: 32
  num_attention_heads: 4
  ffn_hidden_size: 64
  n_prelude: 1
  n_coda: 1
  num_blocks: 4
  routed_depth: 4
  make_vocab_size_divisible_by: 64
curriculum:
  initial_depth: 2
  growth_fraction: 0.5
data:
  paths: [{prefix}]
  split: "90,10,0"
  tokenizer_type: SentencePieceTokenizer
  tokenizer_model: {tokenizer}
  cache_dir: {cache}
optimizer:
  lr: 3.0e-3
  min_lr: 3.0e-4
  lr_warmup_iters: 2
training:
  train_iters: {train_iters}
  micro_batch_size: 2
  global_batch_size: 4
  seq_length: 64
  log_interval: 1
  eval_interval: 5
  eval_iters: 1
  save_interval: {save_interval}
"""


# ------------------------------------------------------------------ helpers (also used by test_slurm)
def make_corpus(out_dir: Path, max_bytes: int = 300_000) -> tuple:
    """A SentencePiece model and one Megatron indexed dataset: (prefix, tokenizer_model)."""
    from corpus_fixtures import indexed_corpus

    return indexed_corpus(str(out_dir), max_bytes=max_bytes, max_doc=8000, vocab_size=512)


def write_config(
    path: Path,
    prefix: str,
    tokenizer: str,
    cache: str,
    train_iters: int = TRAIN_ITERS,
    save_interval: int = SAVE_INTERVAL,
    extra: str = "",
) -> Path:
    path.write_text(
        TINY_CONFIG.format(
            prefix=prefix, tokenizer=tokenizer, cache=cache, train_iters=train_iters, save_interval=save_interval
        )
        + extra
    )
    return path


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(config: Path, save: Path, *args, env=None, log: Path = None, nproc: int = 1, faults=()):
    """``megatron-lol train`` on ``nproc`` processes; ``faults`` (``pause=8:60``, ``nan=6``) run it
    through tests/fault_rank_runner.py. The processes are forked from the preloaded forkserver
    (tests/cli_processes.py), ranks as ``srun`` starts them (the launches that need a real
    ``torchrun`` are in tests/test_cluster_faults.py and tests/test_parallel_config.py)."""
    import cli_processes

    entry = [str(FAULT_RUNNER), *faults, "--"] if faults else ["-m", "megatron_lol"]
    train = [*entry, "train", "--config", str(config), "--save", str(save), *map(str, args)]
    out = log or os.devnull
    if nproc == 1:
        return cli_processes.start(train, env=subprocess_env(**(env or {})), log=out, cwd=REPO)
    return cli_processes.start_ranks(train, nproc, env=subprocess_env(**(env or {})), log=out, cwd=REPO)


def run(config: Path, save: Path, *args, env=None, log: Path = None, nproc: int = 1, faults=()) -> int:
    proc = launch(config, save, *args, env=env, log=log, nproc=nproc, faults=faults)
    try:
        return proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None or any(r.poll() is None for r in getattr(proc, "ranks", [])):
            kill9(proc)


def metrics(save: Path) -> dict:
    """step -> the *last* record logged for it (a resumed run re-logs the steps it redid)."""
    out = {}
    path = save / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by kill -9
                continue
            out[rec["step"]] = rec
    return out


def wait_for(predicate, proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT, what: str = ""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every descendant: torchrun starts its workers in their own
    process sessions, so killing the launcher's process group alone leaves them running."""
    import psutil

    victims = []
    for rank in getattr(proc, "ranks", [proc]):  # a RankGroup: every rank's session
        try:
            victims += psutil.Process(rank.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)
    for child in victims:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
    proc.wait()


def tracker(save: Path):
    p = save / "latest_checkpointed_iteration.txt"
    return int(p.read_text()) if p.exists() else None


def assert_same_losses(got: dict, ref: dict, steps) -> None:
    for s in steps:
        assert s in got, f"step {s} missing"
        assert (got[s]["loss"], got[s]["grad_norm"], got[s]["lr"]) == (
            ref[s]["loss"],
            ref[s]["grad_norm"],
            ref[s]["lr"],
        ), f"step {s}: {got[s]} != {ref[s]}"


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    prefix, tok = make_corpus(root / "data")
    config = write_config(root / "tiny.yaml", prefix, tok, str(root / "cache"))
    return root, config


@pytest.fixture(scope="module")
def reference(setup):
    """One uninterrupted run: per-step metrics."""
    root, config = setup
    save = root / "ref"
    rc = run(config, save, log=root / "ref.log")
    assert rc == 0, (root / "ref.log").read_text()[-3000:]
    ref = metrics(save)
    assert sorted(ref) == list(range(1, TRAIN_ITERS + 1))
    assert tracker(save) == TRAIN_ITERS
    return ref


# ------------------------------------------------------------------ tests
@pytest.mark.slow
def test_kill9_anywhere_and_during_save_then_resume_is_bit_exact(setup, reference):
    root, config = setup
    save, log = root / "kill", root / "kill.log"
    # 1. kill -9 at an arbitrary step (here: somewhere after step 6, past the checkpoint of 4)
    proc = launch(config, save, log=log)
    wait_for(lambda: max(metrics(save), default=0) >= 6, proc, what="step 6")
    kill9(proc)
    assert max(metrics(save)) >= 6 and tracker(save) == 4
    # 2. relaunch; it resumes from 4; kill -9 it in the middle of saving iteration 8
    proc = launch(config, save, log=log, faults=["pause=8:60"])
    wait_for(lambda: "pausing" in log.read_text(), proc, what="the save of iteration 8")
    assert "loaded" in log.read_text() and "iter_0000004" in log.read_text()
    assert (save / ".tmp_iter_0000008").is_dir() and any((save / ".tmp_iter_0000008").iterdir())
    kill9(proc)
    assert tracker(save) == 4 and not (save / "iter_0000008").exists()
    # 3. relaunch: loads 4 again (not the half-written 8), drops the leftover, finishes
    assert run(config, save, log=log) == 0, log.read_text()[-3000:]
    last = log.read_text().split("pausing")[-1]
    assert "loaded" in last and "iter_0000004" in last
    got = metrics(save)
    assert_same_losses(got, reference, range(1, TRAIN_ITERS + 1))
    assert got[TRAIN_ITERS]["consumed_samples"] == reference[TRAIN_ITERS]["consumed_samples"]
    assert tracker(save) == TRAIN_ITERS
    assert not (save / ".tmp_iter_0000008").exists() and (save / "iter_0000008").is_dir()


@pytest.mark.slow
def test_sigusr1_and_exit_duration_save_exit_85_and_resume_bit_exact(setup, reference):
    from megatron_lol.training.signals import EXIT_REQUEUE, REQUEUE_MARKER

    root, config = setup
    save, log = root / "preempt", root / "preempt.log"
    proc = launch(config, save, log=log)
    # after the first save: checkpoint-writer helper processes exist and get the signal too
    wait_for(lambda: max(metrics(save), default=0) >= 5 and tracker(save) == 4, proc, what="step 5")
    os.killpg(proc.pid, signal.SIGUSR1)  # to every process, as Slurm does (checkpoint writers included)
    rc = proc.wait(timeout=LAUNCH_TIMEOUT)
    assert rc == EXIT_REQUEUE, log.read_text()[-3000:]
    first = tracker(save)
    assert first is not None and 5 <= first < TRAIN_ITERS - 1
    assert max(metrics(save)) == first  # saved at the very step boundary it stopped at
    assert (save / REQUEUE_MARKER).read_text().startswith(str(first))
    assert "received SIGUSR1" in log.read_text()
    # a wall-clock limit already passed: one step, save, exit 85 again
    rc = run(config, save, "--exit-duration-in-mins", "0.0001", log=log)
    assert rc == EXIT_REQUEUE, log.read_text()[-3000:]
    assert tracker(save) == first + 1
    assert "exit_duration_in_mins" in log.read_text()
    # and the rest; async saves this time
    assert run(config, save, "--async-save", "--set", "training.keep_last=2", log=log) == 0, log.read_text()[-3000:]
    assert not (save / REQUEUE_MARKER).exists()
    assert_same_losses(metrics(save), reference, range(1, TRAIN_ITERS + 1))
    assert tracker(save) == TRAIN_ITERS and (save / f"iter_{TRAIN_ITERS:07d}" / "metadata.json").exists()
    assert sorted(p.name for p in save.iterdir() if "iter_" in p.name) == ["iter_0000008", "iter_0000012"]


@pytest.mark.slow
def test_nan_loss_skipped_or_stops_without_checkpoint(setup, reference):
    root, config = setup
    save, log = root / "nan_skip", root / "nan_skip.log"
    rc = run(config, save, "--set", "training.skip_nonfinite_steps=1", log=log, faults=["nan=6"])
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "non-finite" in text and "iteration 6: step skipped" in text
    got = metrics(save)
    assert got[6]["skipped"] and got[6]["loss"] != got[6]["loss"]  # NaN
    assert_same_losses(got, reference, range(1, 6))  # untouched before the fault
    assert all(not got[s]["skipped"] for s in range(7, TRAIN_ITERS + 1))
    assert tracker(save) == TRAIN_ITERS

    save, log = root / "nan_stop", root / "nan_stop.log"
    rc = run(config, save, log=log, faults=["nan=6"])
    text = log.read_text()
    assert rc == 3, text[-3000:]
    assert "non-finite loss" in text and "iteration 6" in text
    assert tracker(save) == 4
    assert sorted(p.name for p in save.iterdir() if "iter_" in p.name) == ["iter_0000004"]


@pytest.mark.slow
def test_checkpoint_layout_and_run_config(setup, reference):
    """The contract a converter relies on: tracker, iter dir, run_config.yaml, model.* keys."""
    from megatron_lol.training.checkpointing import read_run_config

    root, _ = setup
    save = root / "ref"
    it = tracker(save)
    ckpt = save / f"iter_{it:07d}"
    cfg, info = read_run_config(str(ckpt))
    assert info["iteration"] == it and info["key_prefix"] == "model."
    assert cfg.model.vocab_size == info["padded_vocab_size"] == 512
    assert info["tokenizer"]["eod_id"] == 2 and (ckpt / info["tokenizer"]["copied_files"]["tokenizer_model"]).exists()
    assert cfg.training.train_iters == TRAIN_ITERS
    assert not [p for p in save.iterdir() if p.name.startswith(".tmp")]
    from megatron.core.dist_checkpointing import load_tensors_metadata

    out = sorted(load_tensors_metadata(str(ckpt)))
    model_keys = [k for k in out if k.startswith("model.")]
    assert "model.core.balancer.bias" in model_keys
    assert "model.embedding.word_embeddings.weight" in model_keys
    assert any(k.startswith("optimizer.") for k in out)


def test_tracker_helpers(tmp_path):
    from megatron_lol.training import checkpointing as ck

    assert ck.read_tracker(str(tmp_path)) is None
    ck.write_tracker(str(tmp_path), 123)
    assert ck.read_tracker(str(tmp_path)) == 123
    assert ck.checkpoint_dir("/x", 123) == "/x/iter_0000123"
    with pytest.raises(ck.CheckpointNotFoundError):
        ck.latest_checkpoint(str(tmp_path))  # tracker names a directory that is not there
    (tmp_path / "iter_0000123").mkdir()
    (tmp_path / "iter_0000123" / "metadata.json").write_text("{}")
    (tmp_path / "iter_0000007").mkdir()
    (tmp_path / ".tmp_iter_0000200").mkdir()
    assert ck.latest_checkpoint(str(tmp_path)) == 123
    assert ck.list_checkpoints(str(tmp_path)) == [7, 123]


def test_nonfinite_weights_are_never_saved(tmp_path):
    import types

    import torch

    from megatron_lol.training import checkpointing as ck

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    trainer = types.SimpleNamespace(
        model=model,
        iteration=5,
        cfg=types.SimpleNamespace(training=types.SimpleNamespace(save=str(tmp_path), keep_last=None, async_save=False)),
    )
    with pytest.raises(ck.NonFiniteWeightsError, match="non-finite|NaN/Inf"):
        ck.Checkpointer(trainer).save()
    assert list(tmp_path.iterdir()) == []


def _killed_after_the_checkpoint_of_4(config, save, log, layout, nproc):
    """Train on ``nproc`` processes until the checkpoint of iteration 4 exists, then kill -9 (the save of
    iteration 8 pauses, so the run cannot race past it)."""
    proc = launch(config, save, *layout, log=log, nproc=nproc, faults=["pause=8:120"])
    wait_for(
        lambda: tracker(save) == 4 and "pausing" in log.read_text(),
        proc,
        what=f"the checkpoint of iteration 4 at {' '.join(layout)}",
    )
    kill9(proc)
    return save, log


@pytest.fixture(scope="module")
def multi_process_saves(setup):
    """Checkpoints of iteration 4 saved at TP=2 and at TP=2 x PP=2, made by the whole-machine reshard test
    below; the one-core test after it resumes them on one process."""
    root, config = setup
    tp2 = ["--tensor-model-parallel-size", "2"]
    return {
        "tp2": _killed_after_the_checkpoint_of_4(config, root / "tp2_to_1", root / "tp2_to_1.log", tp2, 2),
        "tp2pp2": _killed_after_the_checkpoint_of_4(
            config, root / "tp2pp2_to_1", root / "tp2pp2_to_1.log", [*tp2, "--pipeline-model-parallel-size", "2"], 4
        ),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reshard_one_process_to_pp2_and_save_at_tp2_and_tp2_pp2(setup, reference, multi_process_saves):
    """Save on 1 process and resume at PP=2: losses continue within 1e-5 of the uninterrupted 1-process
    run. The fixture saves at TP=2 and at TP=2 x PP=2 for the one-process resumes of the next test."""
    import shutil

    root, config = setup
    for save, _ in multi_process_saves.values():
        assert tracker(save) == 4
    # 1 -> PP=2: the reference's (1-process) checkpoint of iteration 4, resumed with 2 pipeline stages
    save, log = root / "one_to_pp2", root / "one_to_pp2.log"
    save.mkdir()
    shutil.copytree(root / "ref" / "iter_0000004", save / "iter_0000004")
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert run(config, save, "--pipeline-model-parallel-size", "2", log=log, nproc=2) == 0, log.read_text()[-3000:]
    got = metrics(save)
    assert sorted(got) == list(range(5, TRAIN_ITERS + 1))
    for s in got:
        assert abs(got[s]["loss"] - reference[s]["loss"]) < 1e-5, (s, got[s]["loss"], reference[s]["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_checkpoint_saved_at_tp2_or_tp2_pp2_resumes_on_one_process(setup, reference, multi_process_saves, layout):
    """The TP=2 and TP=2 x PP=2 checkpoints of iteration 4 (the fixture's killed runs) resume on 1 process:
    losses continue within 1e-5 of the uninterrupted 1-process run, optimizer state included."""
    root, config = setup
    save, log = multi_process_saves[layout]
    assert run(config, save, log=log) == 0, log.read_text()[-3000:]
    resumed = log.read_text().split("pausing")[-1]
    assert "parallel layout changed" in resumed and "optimizer loaded" in resumed
    got = metrics(save)
    for s in range(1, TRAIN_ITERS + 1):
        assert abs(got[s]["loss"] - reference[s]["loss"]) < 1e-5, (s, got[s]["loss"], reference[s]["loss"])


@pytest.mark.slow
@pytest.mark.timeout(240, func_only=True)
@pytest.mark.multiprocess
def test_optimizer_state_across_the_expert_parallel_boundary_is_refused_in_one_line(setup):
    """megatron-core gives expert parameters (here: LoL's block library, sharded over EP) their own
    optimizer only under expert parallelism, so optimizer state saved at EP=2 does not fit one
    process: the resume stops with one line naming both EP sizes and the way out, the checkpoint is
    left as it was, and the way out (its weights into a new --save with training.reset_optimizer)
    trains on."""
    import hashlib

    import yaml

    root, config = setup
    raw = yaml.safe_load(config.read_text())
    raw["training"].update(train_iters=2, save_interval=2, eval_interval=100)
    raw["optimizer"].update(lr_warmup_iters=1)
    ep = root / "ep.yaml"
    ep.write_text(yaml.safe_dump(raw))
    save, log = root / "ep2", root / "ep2.log"
    assert run(ep, save, "--expert-model-parallel-size", "2", log=log, nproc=2) == 0, log.read_text()[-3000:]

    def files():
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in save.rglob("*")
            if p.is_file() and p.name != ".writer.lock" and p.suffix != ".log" and p.name != "metrics.jsonl"
        }

    before = files()

    log = root / "ep1.log"
    assert run(ep, save, "--train-iters", "4", log=log) == 2, log.read_text()[-3000:]
    out = log.read_text()
    errors = [line for line in out.splitlines() if "error:" in line]
    assert "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert "expert-model-parallel-size 2, now 1" in errors[0] and "training.reset_optimizer: true" in errors[0]
    assert tracker(save) == 2
    assert files() == before

    fresh, log = root / "ep1_fresh", root / "ep1_fresh.log"
    assert (
        run(ep, fresh, "--load", save, "--train-iters", "4", "--set", "training.reset_optimizer=true", log=log) == 0
    ), log.read_text()[-3000:]
    assert "optimizer fresh" in log.read_text() and sorted(metrics(fresh)) == [3, 4]
