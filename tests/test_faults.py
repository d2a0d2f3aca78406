"""Faults an operator meets: kills, missing or corrupt files, full disks, two writers, bad values.

Each case must either continue correctly or stop at once with a one-line error
naming the file, flag or value, exit non-zero and leave every earlier
checkpoint and dataset as it was. Cases that could hang run under a timeout
that turns the hang into a failure. The training runs are the tiny LoL model
of ``test_checkpointing.py`` (4 iterations, a checkpoint every 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import corpus_fixtures as T
import numpy as np
import pytest
from suite_support import scheduling_slack
from test_checkpointing import (
    REPO,
    kill9,
    launch,
    make_corpus,
    metrics,
    subprocess_env,
    tracker,
    wait_for,
    write_config,
)

TRAIN_ITERS = 4
RUN_TIMEOUT = 55  # a hang guard: one tiny training run takes ~10 s on the idle machine
# tests that use the module fixtures: the one training run they share is not billed to the first of them.
# Above run_timeout()'s ceiling, so a hung run is ended (and killed) by the test's own wait, not left running
TIMEOUT = pytest.mark.timeout(300, func_only=True)


def run_timeout() -> float:
    """RUN_TIMEOUT grown with the machine's load (a run beside a second suite took over 55 s at a load
    average of 50), at most 240 s: below the TIMEOUT mark."""
    return min(scheduling_slack(RUN_TIMEOUT), 240.0)


# ------------------------------------------------------------------ helpers
def train(config: Path, save: Path, *args, env=None, timeout: float | None = None) -> tuple:
    """``(status, output)`` of one ``megatron-lol train`` process (a hang fails the test; default
    :func:`run_timeout`)."""
    timeout = run_timeout() if timeout is None else timeout
    log = save.parent / f"{save.name}.log"
    log.write_bytes(b"")
    proc = launch(config, save, *args, env=env, log=log)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill9(proc)
        pytest.fail(f"train did not finish within {timeout} s (hang?): {log.read_text()[-2000:]}")
    return rc, log.read_text()


def error_line(output: str) -> str:
    """The CLI's one error line; asserts there is exactly one and no traceback."""
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("megatron-lol") and "error:" in line]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


def snapshot(directory: Path) -> dict:
    """relative path -> (inode, SHA-256) of every file but the writer lock: equal snapshots = nothing
    rewritten."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != ".writer.lock":
            out[str(path.relative_to(directory))] = (path.stat().st_ino, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def rewrite_manifest_entry(ckpt: Path, name: str) -> None:
    """What an attacker who edits a file also does: update its checksum."""
    if not (ckpt / "checksums.json").exists():
        return
    manifest = json.loads((ckpt / "checksums.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checksums.json").write_text(json.dumps(manifest))


class _Marker:
    """A pickle that, when unpickled, creates the file named by ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def write_dataset(prefix: str, docs: list) -> str:
    from megatron_lol.data.indexed import StreamingIndexWriter

    writer = StreamingIndexWriter(prefix, np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return prefix


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    prefix, tok = make_corpus(root / "data")
    config = write_config(
        root / "tiny.yaml", prefix, tok, str(root / "cache"), train_iters=TRAIN_ITERS, save_interval=2
    )
    return {"root": root, "prefix": prefix, "tokenizer": tok, "config": config}


@pytest.fixture(scope="module")
def trained(corpus):
    """A finished run: iter_0000002, iter_0000004, the tracker, metrics of steps 1-4."""
    save = corpus["root"] / "trained"
    rc, out = train(corpus["config"], save)
    assert rc == 0, out[-3000:]
    assert tracker(save) == TRAIN_ITERS and sorted(metrics(save)) == [1, 2, 3, 4]
    return save


def copy_run(trained: Path, name: str) -> Path:
    dst = trained.parent / name
    shutil.copytree(trained, dst)
    (dst / ".writer.lock").unlink(missing_ok=True)
    return dst


def config_with(corpus, name: str, **data) -> Path:
    """The tiny config with other ``data:`` paths / split (a YAML file next to the corpus)."""
    import yaml

    raw = yaml.safe_load(Path(corpus["config"]).read_text())
    raw["data"].update(data)
    path = corpus["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ------------------------------------------------------------------ 1. missing tracker
@TIMEOUT
def test_missing_tracker_resumes_the_complete_newest_and_never_deletes(corpus, trained):
    save = copy_run(trained, "no_tracker")
    (save / "latest_checkpointed_iteration.txt").unlink()
    before = snapshot(save / "iter_0000002")
    rc, out = train(corpus["config"], save, "--train-iters", "6", "--override-opt_param-scheduler")
    assert rc == 0, out[-3000:]
    assert "no latest_checkpointed_iteration.txt" in out and "starting at iteration 4" in out
    assert snapshot(save / "iter_0000002") == before  # never rewritten
    assert tracker(save) == 6


@TIMEOUT
def test_missing_tracker_and_an_incomplete_newest_checkpoint_stop_the_run(corpus, trained):
    save = copy_run(trained, "no_tracker_partial")
    (save / "latest_checkpointed_iteration.txt").unlink()
    shard = next((save / "iter_0000004").glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a partial copy
    before = snapshot(save)
    rc, out = train(corpus["config"], save)
    line = error_line(out)
    assert rc == 2 and "iter_0000002, iter_0000004" in line and "latest_checkpointed_iteration.txt" in line
    assert snapshot(save) == before


# ------------------------------------------------------------------ 2. truncated .zst
@pytest.mark.timeout(60)
def test_truncated_zst_input_is_an_error(tmp_path, capsys):
    import zstandard

    from megatron_lol.cli import main

    tok = T.build_all(str(tmp_path.parent / "fault_tokenizers"))
    lines = [json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 20}) for i in range(4000)]
    blob = zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode())
    for cut, extra in ((len(blob) // 2, []), (len(blob) - 3, []), (len(blob) // 2, ["--skip-bad-lines"])):
        inp = tmp_path / "in" / "c.jsonl.zst"
        inp.parent.mkdir(exist_ok=True)
        inp.write_bytes(blob[:cut])
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        rc = main(
            [
                "preprocess",
                "--no-progress",
                "--input",
                str(inp),
                "--output-prefix",
                str(out / "ds"),
                *extra,
                *T.tokenizer_argv("sentencepiece", tok),
            ]
        )
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert f"{inp}: truncated zstd file" in err
        assert os.listdir(out) == []
    inp.write_bytes(blob + zstandard.ZstdCompressor().compress(b'{"text": "second frame"}\n'))
    assert (
        main(
            [
                "preprocess",
                "--no-progress",
                "--input",
                str(inp),
                "--output-prefix",
                str(out / "ds"),
                *T.tokenizer_argv("sentencepiece", tok),
            ]
        )
        == 0
    )
    assert "4,001 documents" in capsys.readouterr().out


# ------------------------------------------------------------------ 3. split without tokens
@TIMEOUT
def test_split_without_tokens_stops_instead_of_hanging(corpus, tmp_path):
    from megatron_lol.data.datasets import build_train_valid_test_datasets
    from megatron_lol.data.tokenizers import build_tokenizer
    from megatron_lol.errors import CliError as DatasetError  # the data layer's DatasetError is one

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["tokenizer"])
    rng = np.random.default_rng(0)
    twenty = write_dataset(str(tmp_path / "twenty"), [rng.integers(3, 500, 200) for _ in range(20)])
    one = write_dataset(str(tmp_path / "one"), [rng.integers(3, 500, 5000)])
    sizes = (16, 4, 4)
    for prefix, split, part in ((twenty, "98,2,0", "valid"), (one, "98,2,0", "valid"), (twenty, "96,2,2", "test")):
        with pytest.raises(DatasetError, match=rf"{prefix}\.idx: .*the {part} split .*hold no tokens"):
            build_train_valid_test_datasets([prefix], split, 64, 1, str(tmp_path / "cache"), sizes, tok)
    # corrupt arrays: every length zeroed (the pointers no longer follow)
    zeroed = write_dataset(str(tmp_path / "zeroed"), [rng.integers(3, 500, 100) for _ in range(30)])
    with open(zeroed + ".idx", "r+b") as f:
        f.seek(34)
        f.write(np.zeros(30, np.int32).tobytes())
    with pytest.raises(DatasetError, match=rf"{zeroed}\.idx: .*corrupt index"):
        build_train_valid_test_datasets([zeroed], "90,10,0", 64, 1, str(tmp_path / "cache"), sizes, tok)
    # nothing asked of an empty split (eval_iters 0): it builds
    train_ds, valid, _ = build_train_valid_test_datasets(
        [twenty], "98,2,0", 64, 1, str(tmp_path / "cache"), (16, 0, 0), tok
    )
    assert len(train_ds) >= 16
    # end to end: one line, exit 2, well before the timeout
    rc, out = train(config_with(corpus, "split_twenty", paths=[twenty], split="98,2,0"), tmp_path / "run")
    assert rc == 2 and "the valid split" in error_line(out) and twenty in error_line(out)


# ------------------------------------------------------------------ 4. dead preprocess worker
def _big_jsonl(path: Path, mb: int) -> Path:
    docs = T.stdlib_documents(3_000_000, 20_000)
    with open(path, "w") as f:
        written = 0
        while written < mb << 20:
            for d in docs:
                line = json.dumps({"text": d}) + "\n"
                f.write(line)
                written += len(line)
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["while_writing", "as_it_starts"])
def test_killed_preprocess_worker_fails_the_run_instead_of_hanging(tmp_path, when):
    import psutil

    tok = T.build_all(str(tmp_path.parent / "fault_tokenizers"))
    inp = _big_jsonl(tmp_path / "c.jsonl", 24)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "preprocess",
            "--input",
            str(inp),
            "--output-prefix",
            str(out / "o"),
            "--no-progress",
            "--workers",
            "2",
            *T.tokenizer_argv("sentencepiece", tok),
        ],
        cwd=str(REPO),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 30
        victim = None
        while time.time() < deadline and victim is None:
            assert proc.poll() is None, proc.communicate()
            kids = psutil.Process(proc.pid).children()
            if when == "as_it_starts" and kids:  # before preprocess has seen the worker start
                victim = kids[0]
            elif len(kids) >= 2 and any(".bin.tmp-" in n for n in os.listdir(out)):
                victim = kids[0]
            time.sleep(0.05 if when == "while_writing" else 0.001)
        assert victim is not None, "no worker appeared"
        victim.kill()  # what the OOM killer does
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("preprocess hung after one of its workers was killed")
    err = err.decode().strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "worker process killed by SIGKILL" in err and str(inp) in err
    assert os.listdir(out) == []  # temporary files removed


def _python_quietly(script: str) -> str:
    """stdout of ``python -c script``, which must exit 0 and print nothing on stderr (no traceback)."""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=str(REPO), env=subprocess_env(), capture_output=True, text=True, timeout=45
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return out.stdout


_FORKED_BEFORE_INIT_SCRIPT = """
import os, signal, sys, time
from megatron_lol.data import workers

workers.raise_on_sigterm()
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:  # a tokenizer worker between fork and its initializer: the parent's handler still set
    os.write(ready_w, b"x")
    time.sleep(30)
    os._exit(0)
os.read(ready_r, 1)
os.kill(pid, signal.SIGTERM)  # what the executor does to the workers of a broken pool
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
try:
    os.kill(os.getpid(), signal.SIGTERM)  # in the main process the handler still unwinds the run
    time.sleep(5)
except workers.Terminated:
    print("terminated")
"""


@pytest.mark.timeout(60)
def test_sigterm_in_a_forked_worker_before_its_initializer_ends_it_quietly():
    """preprocess's SIGTERM handler raises Terminated only in the process that installed it; a forked
    worker that gets the executor's SIGTERM before its initializer resets the handler dies of the
    signal, with no traceback under the run's one-line error (seen with a worker killed as it starts)."""
    out = _python_quietly(_FORKED_BEFORE_INIT_SCRIPT)
    assert out.split() == ["True", "terminated"], out


_STOP_WORKERS_SCRIPT = """
import os, signal, sys, time, multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from megatron_lol.data import workers

pool = ProcessPoolExecutor(2, mp_context=mp.get_context("fork"))
procs = workers.process_table(pool)
futures = [pool.submit(time.sleep, 5) for _ in range(6)]
while len(procs) < 2:
    time.sleep(0.01)
manager = pool._executor_manager_thread
os.kill(next(iter(procs)), signal.SIGKILL)  # what the OOM killer does
workers.stop_workers(pool, procs)
print(manager.is_alive(), sorted(p.exitcode is None for p in procs.values()))
"""


@pytest.mark.timeout(60)
def test_stopping_a_broken_worker_pool_ends_its_management_thread_before_exit():
    """stop_workers waits for the executor's management thread: one still running at interpreter exit
    races concurrent.futures' exit hook (`_ThreadWakeup.wakeup` writes to a pipe the thread closes) and
    adds "OSError: [Errno 9] Bad file descriptor" under preprocess's one-line error."""
    for _ in range(3):
        out = _python_quietly(_STOP_WORKERS_SCRIPT)
        assert out.split("\n")[0] == "False [False, False]", out  # thread ended, workers gone


# ------------------------------------------------------------------ 5. convert-hf over the checkpoint
@TIMEOUT
def test_convert_hf_refuses_a_save_that_overlaps_the_checkpoint(trained, capsys):
    from megatron_lol.cli import main

    save = copy_run(trained, "convert_overlap")
    before = snapshot(save)
    for target in (save, save.parent, save / "iter_0000004", save / "hf"):
        rc = main(["convert-hf", "--load", str(save), "--save", str(target), "--force", "--no-tokenizer"])
        # one error line (a first megatron-core import in this process may add its start-up note before it)
        err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note:"))
        assert rc == 2 and len(err.splitlines()) == 1 and "overlaps --load" in err, err
    assert snapshot(save) == before
    other = copy_run(trained, "convert_other_ckpt")
    rc = main(["convert-hf", "--load", str(save), "--save", str(other), "--force", "--no-tokenizer"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds a training checkpoint" in err and (other / "iter_0000004").is_dir()


# ------------------------------------------------------------------ 6. two writers
@TIMEOUT
@pytest.mark.multiprocess
def test_second_run_on_the_same_save_is_refused(corpus, tmp_path):
    save, log = tmp_path / "shared", tmp_path / "first.log"
    first = launch(corpus["config"], save, log=log, faults=["pause=2:40"])
    try:
        wait_for(lambda: "pausing" in log.read_text(), first, timeout=50, what="the first run's save")
        tmp_before = sorted(p.name for p in (save / ".tmp_iter_0000002").iterdir())
        rc, out = train(corpus["config"], save)
        line = error_line(out)
        assert rc == 2 and "in use by another training run" in line and f"pid {first.pid}" in line
        assert sorted(p.name for p in (save / ".tmp_iter_0000002").iterdir()) == tmp_before
    finally:
        kill9(first)
    # the killed run's lock is not stale: the next run takes it
    from megatron_lol.training.checkpointing import SaveDirLock

    lock = SaveDirLock(str(save))
    assert lock.acquire() is None
    lock.release()


# ------------------------------------------------------------------ 7. orphans after kill -9
_FORK_SCRIPT = """
import os, sys, time
from megatron_lol.process_guard import guard_forked_children
guard_forked_children()
if os.fork() == 0:
    time.sleep(120)
    os._exit(0)
print("forked", flush=True)
time.sleep(120)
"""


@TIMEOUT
def test_kill9_of_the_trainer_leaves_no_orphans(corpus, tmp_path):
    import psutil

    save, log = tmp_path / "orphans", tmp_path / "orphans.log"
    proc = launch(corpus["config"], save, "--async-save", log=log, faults=["pause=4:60"])
    try:
        wait_for(lambda: "pausing" in log.read_text(), proc, timeout=45, what="the save of iteration 4")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no helper processes (checkpoint-writer manager, resource tracker)"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the trainer only, as the OOM killer would
        proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    survivors = [p.pid for p in alive if _running(p)]
    for p in alive:
        p.kill()
    assert not survivors, f"orphans left by kill -9 of the trainer: {survivors}"
    # a child forked by megatron-core's writer path dies with its parent too
    fork = subprocess.Popen([sys.executable, "-c", _FORK_SCRIPT], env=subprocess_env(), stdout=subprocess.PIPE)
    assert fork.stdout.readline().strip() == b"forked"
    grandchild = psutil.Process(fork.pid).children()[0]
    fork.kill()
    fork.wait()
    gone, alive = psutil.wait_procs([grandchild], timeout=10)
    assert not [p for p in alive if _running(p)]


_WRITER_MANAGER_SCRIPT = """
import json, os, queue, signal, time
if __name__ == "__main__":
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult
    from megatron_lol.training.checkpointing import writer_manager
    writer_manager.prepare_writer_processes()
    results = filesystem_async._results_queue
    pid = writer_manager._WRITER_MANAGER._process.pid
    os.kill(pid, signal.SIGUSR1)  # what Slurm sends every process of a step before its time limit
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    # what a save's writers put: torch.distributed.checkpoint results, or an exception
    written = {0: [WriteResult(MetadataIndex("w", (0,)), 8, None)], 1: []}
    results.put(written)
    results.put(RuntimeError("disk full"))
    got = [results.get_nowait(), results.get_nowait()]
    try:
        results.get_nowait()
        empty = False
    except queue.Empty:
        empty = True
    with open(f"/proc/{pid}/maps") as maps:
        torch_mapped = "libtorch" in maps.read()
    print(json.dumps({
        "torch_mapped": torch_mapped,
        "results": got[0] == written,
        "error": repr(got[1]),
        "empty_raises_queue_empty": empty,
    }))
"""


@TIMEOUT
def test_the_checkpoint_writer_manager_never_imports_torch_and_outlives_preemption_signals(tmp_path):
    """The Manager is a spawned interpreter: it imports only its initializer's module, and its queue holds
    pickled bytes. Were either torch's (the checkpointer module; unpickling the write results), every
    training process that saves would spend ~2 s of CPU on it."""
    script = tmp_path / "writer_manager.py"  # a file: spawn re-imports the main module by path
    script.write_text(_WRITER_MANAGER_SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {
        "torch_mapped": False,
        "results": True,
        "error": "RuntimeError('disk full')",
        "empty_raises_queue_empty": True,
    }


def _running(proc) -> bool:
    """Alive and not a zombie (a dead orphan waits for a PID 1 that may never reap it)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ 8. validation gaps
@TIMEOUT
def test_nonfinite_lr_bad_blend_weights_and_wide_window_are_refused(corpus, tmp_path):
    from megatron_lol.config import load_config
    from megatron_lol.errors import ConfigError

    config, prefix = corpus["config"], corpus["prefix"]
    cases = [
        (("optimizer.lr", "nan"), "optimizer.lr: must be a finite number > 0 (got nan)"),
        (("optimizer.lr", "inf"), "optimizer.lr: must be a finite number > 0 (got inf)"),
        (("data.paths", [-1, prefix, 1, prefix]), "weight -1 must be a finite number >= 0"),
        (("data.paths", ["nan", prefix, 1, prefix]), "weight 'nan' must be a finite number >= 0"),
        (("data.paths", [0, prefix, 0, prefix]), "the blend weights sum to zero"),
        (("model.plan.windows.size", 128), "model.plan.windows.size: 128 is larger than training.seq_length=64"),
    ]
    for (key, value), message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(config, [(key, value, "--set")])
        assert message in str(info.value)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "train",
            "--config",
            str(config),
            "--lr",
            "nan",
            "--save",
            str(tmp_path / "s"),
        ],
        cwd=str(REPO),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1
    assert "optimizer.lr (--lr): must be a finite number > 0 (got nan)" in err[0]
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------ 9. corrupt files: one line each
@TIMEOUT
def test_corrupt_dataset_files_give_one_line_errors(corpus, tmp_path):
    from megatron_lol.data.datasets import build_train_valid_test_datasets
    from megatron_lol.data.tokenizers import build_tokenizer
    from megatron_lol.errors import CliError as DatasetError  # the data layer's DatasetError is one

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["tokenizer"])
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 500, 300) for _ in range(40)]

    def fresh(name):
        return write_dataset(str(tmp_path / name), docs)

    def build(prefix, **vocab):
        train_ds = build_train_valid_test_datasets(
            [prefix], "90,10,0", 64, 1, str(tmp_path / "cache"), (8, 4, 0), tok, **vocab
        )[0]
        return [train_ds[i]["tokens"] for i in range(len(train_ds))]

    p = fresh("truncated_bin")
    with open(p + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(p + ".bin") - 100)
    with pytest.raises(DatasetError, match=rf"{p}\.bin: truncated"):
        build(p)
    p = fresh("bad_header")
    raw = bytearray(Path(p + ".idx").read_bytes())
    raw[:4] = b"XXXX"
    Path(p + ".idx").write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match=rf"{p}\.idx: not a Megatron MMIDIDX index"):
        build(p)
    p = fresh("cut_idx")
    with open(p + ".idx", "r+b") as f:
        f.truncate(60)
    with pytest.raises(DatasetError, match=rf"{p}\.idx: truncated index"):
        build(p)
    p = write_dataset(str(tmp_path / "empty"), [])
    with pytest.raises(DatasetError, match=rf"{p}\.idx: the dataset holds no documents"):
        build(p)
    p = write_dataset(str(tmp_path / "big_ids"), docs[:5] + [np.array([7, 900, 8])] + docs[5:])
    with pytest.raises(
        DatasetError,
        match=rf"{p}\.bin: token ids reach 900, outside the model's vocabulary "
        r"of 512 \(the first at document 5, position 1\)",
    ):
        build(p, vocab_size=512)
    assert len(build(fresh("fine"), vocab_size=512)) >= 8  # and a sound dataset builds
    # end to end: the IndexError deep in the embedding becomes one line before training
    rc, out = train(config_with(corpus, "big_ids", paths=[p]), tmp_path / "run")
    assert rc == 2 and "token ids reach 900" in error_line(out) and "iteration      1" not in out


def _corrupt_run(trained, name, corrupt) -> tuple:
    save = copy_run(trained, name)
    corrupt(save)
    before = snapshot(save)
    return save, before


TRACKER_CASES = {
    "garbage_tracker": (
        "not a number\n",
        "latest_checkpointed_iteration.txt: expected an iteration number, got 'not a number'",
    ),
    "missing_iteration": ("7\n", "names iteration 7 but"),
}


@TIMEOUT
@pytest.mark.parametrize("case", sorted(TRACKER_CASES))
def test_bad_tracker_gives_a_one_line_error(corpus, trained, case):
    text, message = TRACKER_CASES[case]
    save, before = _corrupt_run(trained, case, lambda s: (s / "latest_checkpointed_iteration.txt").write_text(text))
    rc, out = train(corpus["config"], save)
    line = error_line(out)
    assert rc == 2 and message in line and str(save) in line, line
    assert snapshot(save) == before


def _cut_common(save: Path) -> None:
    common = save / "iter_0000004" / "common.pt"
    common.write_bytes(common.read_bytes()[:500])


@TIMEOUT
@pytest.mark.parametrize("verify", [True, False])
def test_truncated_common_pt_gives_a_one_line_error(corpus, trained, verify):
    save, before = _corrupt_run(trained, f"truncated_common_{verify}", _cut_common)
    if verify:
        rc, out = train(corpus["config"], save)
        expected = "iter_0000004/common.pt is corrupted or truncated"
    else:  # without the checksum check, megatron-core's reader fails: still one line naming common.pt
        rc, out = train(corpus["config"], save, "--set", "training.verify_checksums=false")
        expected = "iter_0000004/common.pt cannot be read"
    line = error_line(out)
    assert rc == 2 and expected in line, line
    assert snapshot(save) == before


def _cut(pattern: str):
    def corrupt(save: Path) -> None:
        path = next((save / "iter_0000004").glob(pattern))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return corrupt


@TIMEOUT
def test_truncated_shard_gives_a_one_line_error(corpus, trained):
    save, before = _corrupt_run(trained, "truncated_shard", _cut("__0_1.distcp"))
    rc, out = train(corpus["config"], save)
    line = error_line(out)
    assert rc == 2 and "iter_0000004/__0_1.distcp is corrupted or truncated" in line, line
    assert snapshot(save) == before


@TIMEOUT
@pytest.mark.parametrize("rehash", [False, True])
def test_truncated_metadata_gives_a_one_line_error(corpus, trained, rehash):
    def corrupt(save):
        _cut(".metadata")(save)
        if rehash:  # its checksum updated too: the restricted reader itself names the file
            rewrite_manifest_entry(save / "iter_0000004", ".metadata")

    save, before = _corrupt_run(trained, f"truncated_metadata_{rehash}", corrupt)
    rc, out = train(corpus["config"], save)
    line = error_line(out)
    expected = ".metadata is truncated or corrupt" if rehash else ".metadata is corrupted or truncated"
    assert rc == 2 and f"iter_0000004/{expected}" in line, line
    assert snapshot(save) == before


_ENOSPC_RUNNER = """
import builtins, errno, os, sys
_open = builtins.open

class Full:
    def __init__(self, f):
        self._f = f
    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self._f.close()

def full_open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    if ".tmp_iter_0000002" in str(file) and str(file).endswith(".distcp") and "w" in mode:
        return Full(f)
    return f

if __name__ == "__main__":  # not in the spawned checkpoint-writer manager
    builtins.open = full_open
    from megatron_lol.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@TIMEOUT
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_a_save_says_enospc_and_keeps_the_last_checkpoint(corpus, tmp_path, mode):
    save = tmp_path / "full"
    runner = tmp_path / "enospc_runner.py"
    runner.write_text(_ENOSPC_RUNNER)
    extra = ["--async-save"] if mode == "async" else []
    proc = subprocess.run(
        [
            sys.executable,
            str(runner),
            "train",
            "--config",
            str(corpus["config"]),
            "--save",
            str(save),
            "--save-interval",
            "1",
            *extra,
        ],
        cwd=str(REPO),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=run_timeout(),
    )
    line = error_line(proc.stdout + proc.stderr)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "saving iteration 2" in line and "No space left on device (ENOSPC)" in line, line
    assert "last complete checkpoint is iter_0000001" in line
    assert tracker(save) == 1 and (save / "iter_0000001" / "checksums.json").is_file()
    assert not any(p.name.startswith(".tmp_") for p in save.iterdir())


# ------------------------------------------------------------------ 10. silent corruption
@TIMEOUT
def test_flipped_bytes_in_a_shard_are_caught_on_load(corpus, trained):
    from megatron_lol.convert.checkpoint import DistCheckpointReader
    from megatron_lol.errors import CliError

    def flip(save):
        shard = save / "iter_0000004" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 4096] = bytes(b ^ 0xFF for b in data[mid : mid + 4096])
        shard.write_bytes(bytes(data))

    save, before = _corrupt_run(trained, "flipped", flip)
    rc, out = train(corpus["config"], save)
    line = error_line(out)
    assert rc == 2 and "iter_0000004/__0_0.distcp is corrupted or truncated: its SHA-256 differs" in line, line
    assert snapshot(save) == before
    reader = DistCheckpointReader(str(save / "iter_0000004"))
    with pytest.raises(CliError, match="__0_0.distcp is corrupted"):
        for key in reader.keys():
            reader.read(key)
    # training.verify_checksums=false skips the check (for checkpoints too large to hash on every load)
    import types

    from megatron_lol.training.checkpointing import Checkpointer, CheckpointError

    def checkpointer(verify):
        training = types.SimpleNamespace(save=None, keep_last=None, async_save=False, verify_checksums=verify)
        return Checkpointer(types.SimpleNamespace(cfg=types.SimpleNamespace(training=training)))

    checkpointer(False).verify(str(save / "iter_0000004"))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        checkpointer(True).verify(str(save / "iter_0000004"))


# ------------------------------------------------------------------ 11. untrusted pickles
@TIMEOUT
def test_crafted_metadata_and_index_cache_are_never_unpickled(corpus, trained, tmp_path, capsys):
    from megatron_lol.cli import main

    marker = tmp_path / "pwned"
    save = copy_run(trained, "evil_metadata")
    ckpt = save / "iter_0000004"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Marker(str(marker))))
    rewrite_manifest_entry(ckpt, ".metadata")
    rc, out = train(corpus["config"], save)
    assert rc == 2 and "refusing to load posix.system" in error_line(out)
    assert not marker.exists()
    rc = main(
        [
            "analyze",
            "utilisation",
            "--load",
            str(save),
            "--data-path",
            corpus["prefix"],
            "--output",
            str(tmp_path / "an"),
            "--max-examples",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "refusing to load posix.system" in err and not marker.exists()
    # objects stored as bytes in the shards (RNG states, _extra_state): torch's planner would
    # torch.load(weights_only=False) them; every load of the package runs under restricted_unpickling
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_lol.training.checkpointing import restricted_unpickling

    dcp.save({"rng_state": _Marker(str(marker)), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with restricted_unpickling(), pytest.raises(BaseException, match="Weights only load failed"):
        dcp.load({"rng_state": None, "w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert not marker.exists()
    # the dataset index cache: a pickle planted as a cached index is not loaded, the cache is rebuilt
    from megatron_lol.data.datasets import build_train_valid_test_datasets
    from megatron_lol.data.tokenizers import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["tokenizer"])
    cache = tmp_path / "cache"
    args = ([corpus["prefix"]], "90,10,0", 64, 1, str(cache), (16, 4, 0), tok)
    first = build_train_valid_test_datasets(*args)[0]
    samples = [first[i]["tokens"].tolist() for i in range(4)]
    planted = sorted(cache.glob("*-train-shuffle_index.npy"))
    assert planted, sorted(os.listdir(cache))
    with open(planted[0], "wb") as f:
        pickle.dump(_Marker(str(marker)), f)
    again = build_train_valid_test_datasets(*args)[0]
    assert [again[i]["tokens"].tolist() for i in range(4)] == samples
    assert not marker.exists()
    assert np.load(planted[0], allow_pickle=False).dtype.kind in "iu"  # rewritten as plain numbers


# ------------------------------------------------------------------ 12. smaller ones
@TIMEOUT
def test_resumed_run_does_not_repeat_metrics_steps(corpus, trained):
    save = copy_run(trained, "metrics_resume")
    shutil.rmtree(save / "iter_0000004")  # killed after logging step 4, before its save
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    with open(save / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0')  # a line cut by the kill
    rc, out = train(corpus["config"], save)
    assert rc == 0, out[-3000:]
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert metrics(save)[4]["loss"] == metrics(trained)[4]["loss"]  # resumed bit-exactly


@pytest.mark.timeout(60)
def test_preprocess_removes_temporary_files_of_dead_runs_and_on_sigterm(tmp_path):
    tok = T.build_all(str(tmp_path.parent / "fault_tokenizers"))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i} text"}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = [
        out / f"o_text_document.bin.tmp-{dead.pid}",
        out / f"o_text_document.idx.tmp-{dead.pid}-{host}",
        out / f"o_text_document.lengths.tmp-{dead.pid}-{host}",
    ]
    live = [
        out / f"o_text_document.bin.tmp-{os.getppid()}-{host}",
        out / f"o_text_document.bin.tmp-{dead.pid}-elsewhere",
    ]
    for p in stale + live:
        p.write_bytes(b"partial")
    T.run_preprocess(
        ["--input", str(small), "--output-prefix", str(out / "o"), *T.tokenizer_argv("sentencepiece", tok)]
    )
    names = sorted(os.listdir(out))
    assert all(p.name not in names for p in stale) and all(p.name in names for p in live), names
    assert "o_text_document.bin" in names and "o_text_document.idx" in names
    # SIGTERM (scancel, a timeout): one line, non-zero, no temporary file left
    sig_out = tmp_path / "sig"
    sig_out.mkdir()
    big = _big_jsonl(tmp_path / "big.jsonl", 16)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "preprocess",
            "--input",
            str(big),
            "--output-prefix",
            str(sig_out / "o"),
            "--no-progress",
            *T.tokenizer_argv("sentencepiece", tok),
        ],
        cwd=str(REPO),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 30
    while not any(".bin.tmp-" in n for n in os.listdir(sig_out)):
        assert proc.poll() is None and time.time() < deadline, "no temporary output appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    err = err.decode().strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "stopped by SIGTERM" in err, err
    assert os.listdir(sig_out) == []


@pytest.mark.timeout(60)
def test_lone_surrogate_error_is_one_clean_line(tmp_path):
    tok = T.build_all(str(tmp_path.parent / "fault_tokenizers"))
    inp = tmp_path / "c.jsonl"
    inp.write_bytes(b'{"text": "fine"}\n{"text": "bad \\ud800 surrogate"}\n')
    for kind in ("sentencepiece", "huggingface"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_lol",
                "preprocess",
                "--input",
                str(inp),
                "--output-prefix",
                str(tmp_path / kind),
                "--no-progress",
                *T.tokenizer_argv(kind, tok),
            ],
            cwd=str(REPO),
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        err = proc.stderr.strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, err
        assert f"{inp}:2: key 'text' holds a lone surrogate U+D800 at character 4" in err
        assert "C++" not in err and "PYBIND" not in err
