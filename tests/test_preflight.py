"""``train --dry-run`` checks what the run checks (megatron_lol/training/preflight.py), and a run or an
analysis that fails at its start leaves nothing behind.

Each failure mode a run used to meet only after the dry run passed is checked here at the dry run:
its one-line message, exit status 2, and the directory tree unchanged. Everything runs in-process
(the dry run imports no torch), except the one check of what a real process prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from corpus_fixtures import write_tiny_dataset, write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]

CONFIG = """\
model: {plan: {kind: lol, num_blocks: 4, routed_depth: 3, windows: {size: 16, shift: 8}}, hidden_size: 32,
        num_attention_heads: 4, ffn_hidden_size: 64, n_prelude: 1, n_coda: 1, make_vocab_size_divisible_by: 64}
data: {paths: [%(prefix)s], split: "90,10,0", tokenizer_type: HuggingFaceTokenizer, tokenizer_model: %(tok)s}
optimizer: {lr: 3.0e-3, lr_warmup_iters: 1}
training: {train_iters: 3, micro_batch_size: 2, global_batch_size: 2, seq_length: 16, log_interval: 1,
           eval_interval: 100, eval_iters: 0}
"""


@pytest.fixture
def run_dir(tmp_path):
    """``(config, tokenizer.json, dataset prefix)`` under tmp_path."""
    tok = write_tiny_tokenizer(tmp_path / "tok")
    prefix = write_tiny_dataset(tmp_path / "corpus")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG % {"prefix": prefix, "tok": tok})
    return cfg, tok, prefix


def tree(root: Path) -> dict:
    """Every path under ``root`` with its size: what a failed command must leave as it was."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def dry_run(capsys, *argv) -> tuple:
    from megatron_lol.cli import main

    code = main(["train", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_exit_2(capsys, root: Path, *argv) -> str:
    before = tree(root)
    code, _, err = dry_run(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-lol train: error: "), err
    assert tree(root) == before  # nothing created, nothing removed
    return lines[0]


def test_dry_run_loads_the_tokenizer_checks_the_data_and_says_what_the_run_starts_from(run_dir, capsys):
    cfg, _, _ = run_dir
    code, out, err = dry_run(capsys, "--config", str(cfg), "--dry-run", "--save", str(cfg.parent / "new" / "save"))
    assert code == 0, err
    assert "tokenizer HuggingFaceTokenizer (8 tokens); 1 dataset(s) of 40 sequences, starts from scratch" in out
    assert not (cfg.parent / "new").exists()  # a dry run creates nothing


def test_tokenizer_type_against_the_files(run_dir, capsys, tmp_path):
    cfg, _, _ = run_dir
    sp = tmp_path / "tok.model"
    sp.write_bytes(b"\x0a\x05hello")
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run", "--tokenizer-type", "GPT2BPETokenizer",
        "--tokenizer-model", str(sp),
    )  # fmt: skip
    assert line == (
        "megatron-lol train: error: data.tokenizer_type (--tokenizer-type): GPT2BPETokenizer reads --vocab-file "
        f"and --merge-file (neither given); --tokenizer-model {sp} is a SentencePiece model: --tokenizer-type "
        "SentencePieceTokenizer"
    )
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run=config", "--tokenizer-model", str(sp))
    assert "HuggingFaceTokenizer cannot read" in line and "(a SentencePiece model): --tokenizer-type Sentence" in line
    # a file of the right name that does not load: the loader's own message, one line, under the key
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(sp),
    )  # fmt: skip
    assert line.startswith("megatron-lol train: error: data.tokenizer_model (--tokenizer-model): cannot load ")
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run", "--tokenizer-model", str(tmp_path / "missing.json")
    )
    assert line.endswith("missing.json does not exist")
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run=config", "--set", "data.tokenizer_model=null"
    )
    assert line == (
        "megatron-lol train: error: data.tokenizer_model (--tokenizer-model): --tokenizer-type "
        "HuggingFaceTokenizer needs --tokenizer-model"
    )


def test_corrupt_index_lengths(run_dir, capsys, tmp_path):
    cfg, _, prefix = run_dir
    from megatron_lol.data.indexed import IndexHeader

    h = IndexHeader(prefix + ".idx")
    with open(prefix + ".idx", "r+b") as f:  # sequence 1's int32 length
        f.seek(h.lengths_offset + 4)
        f.write(np.int32(-63217).tobytes())
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run")
    assert line == (
        f"megatron-lol train: error: data.paths (--data-path): {prefix}.idx: sequence 1 has a negative "
        "length (-63217): corrupt index"
    )
    with open(prefix + ".idx", "r+b") as f:  # a length that no longer matches the .bin
        f.seek(h.lengths_offset + 4)
        f.write(np.int32(7).tobytes())
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run")
    assert "sequence 2 starts at byte" in line and "corrupt index" in line
    # --dry-run=config leaves the data for later (a pipeline builds it)
    assert dry_run(capsys, "--config", str(cfg), "--dry-run=config")[0] == 0


def test_load_of_a_directory_that_is_not_a_checkpoint(run_dir, capsys, tmp_path):
    cfg, _, _ = run_dir
    notckpt = tmp_path / "not_a_checkpoint"
    notckpt.mkdir()
    (notckpt / "notes.txt").write_text("x")
    save = tmp_path / "runs" / "stage2"
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run", "--load", str(notckpt), "--save", str(save)
    )
    assert line == (
        f"megatron-lol train: error: training.load (--load): {notckpt} has no "
        "latest_checkpointed_iteration.txt: no checkpoint to load (found: none)"
    )
    # the run stops at the same check, before it creates its save directory or the writer lock
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--load", str(notckpt), "--save", str(save))
    assert "no checkpoint to load" in line
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run", "--load", str(tmp_path / "nowhere"))
    assert line.endswith("nowhere: no such directory: no checkpoint to load")
    # a tracker that names a missing iteration; a save holding checkpoints with --no-resume
    (notckpt / "latest_checkpointed_iteration.txt").write_text("5\n")
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run", "--load", str(notckpt))
    assert "names iteration 5 but" in line and "iter_0000005 is missing or incomplete" in line
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run", "--save", str(notckpt), "--no-resume")
    assert line.startswith("megatron-lol train: error: training.save (--save): ") and "already holds" in line


def test_save_directory_must_be_creatable(run_dir, capsys, tmp_path):
    cfg, _, _ = run_dir
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run=config", "--save", str(blocker / "save"))
    assert line.endswith(f"{blocker / 'save'} cannot be created: {blocker} is not a directory")
    line = one_line_exit_2(capsys, tmp_path, "--config", str(cfg), "--dry-run", "--set", f"data.cache_dir={blocker}")
    assert line == f"megatron-lol train: error: data.cache_dir (--data-cache-path): {blocker} is not a directory"


def test_hub_tokenizer_offline_from_the_cache(run_dir, capsys, tmp_path, monkeypatch):
    """A Hub name is read from the Hub cache exactly as the run reads it; offline and not cached, one line."""
    import huggingface_hub.constants as hub

    cfg, tok, _ = run_dir
    name = "EleutherAI/gpt-neox-20b"
    commit = "0" * 40
    repo = tmp_path / "hub" / f"models--{name.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "tokenizer.json").write_bytes(tok.read_bytes())
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    code, out, err = dry_run(capsys, "--config", str(cfg), "--dry-run", "--tokenizer-model", name)
    assert code == 0 and "tokenizer HuggingFaceTokenizer (8 tokens)" in out, err
    line = one_line_exit_2(
        capsys, tmp_path, "--config", str(cfg), "--dry-run=config", "--tokenizer-model", "nobody/none"
    )
    assert "HuggingFace tokenizer nobody/none: not a local file or directory, and the Hub could not" in line


def test_profile_synthetic_data_needs_no_tokenizer(monkeypatch):
    """Random tokens take the config's vocabulary: a Hub name that no cache holds is not looked up."""
    import huggingface_hub.constants as hub

    from megatron_lol.config import config_from_dict
    from megatron_lol.training import profile, trainer

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    built = {}

    class Recorder:
        def __init__(self, cfg, tokenizer=None, datasets=None):
            built.update(tokenizer=tokenizer, datasets=datasets)

        def setup(self):
            return self

    monkeypatch.setattr(trainer, "Trainer", Recorder)
    raw = {
        "model": {"vocab_size": 50304},
        "data": {"paths": ["nowhere"], "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "nobody/none"},
    }
    profile.build_trainer(config_from_dict(raw, check_data=False), synthetic=True)
    assert built["tokenizer"].vocab_size == 50304 and built["datasets"][0].vocab == 50304


def test_a_failed_start_removes_its_lock_and_save_directory(tmp_path):
    from megatron_lol.training.checkpointing.lock import LOCK_FILE, SaveDirLock

    lock = SaveDirLock(str(tmp_path / "runs" / "a"))
    assert lock.acquire() is None and (tmp_path / "runs" / "a" / LOCK_FILE).exists()
    lock.discard()
    assert list(tmp_path.iterdir()) == []
    # an existing save directory keeps what it held (a lock file of an earlier run included)
    save = tmp_path / "save"
    save.mkdir()
    (save / "metrics.jsonl").write_text("{}\n")
    lock = SaveDirLock(str(save))
    assert lock.acquire() is None
    lock.discard()
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl"]
    (save / LOCK_FILE).write_text('{"released": true}\n')
    lock = SaveDirLock(str(save))
    assert lock.acquire() is None
    lock.discard()
    assert sorted(p.name for p in save.iterdir()) == [LOCK_FILE, "metrics.jsonl"]


def test_a_failed_analysis_leaves_no_output_directory(tmp_path, capsys):
    from megatron_lol.analysis.cli import output_dir
    from megatron_lol.cli import main

    out = tmp_path / "plots" / "run1"
    code = main(
        ["analyze", "utilisation", "--load", str(tmp_path / "nockpt"), "--data-path", "x", "--output", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")  # an --output that cannot be made: said before the checkpoint is read
    code = main(["analyze", "utilisation", "--load", "x", "--data-path", "x", "--output", str(tmp_path / "file" / "o")])
    assert code == 2 and capsys.readouterr().err.strip().endswith(
        f"cannot be created: {tmp_path / 'file'} is not a directory"
    )
    (tmp_path / "file").unlink()
    with pytest.raises(RuntimeError):  # an analysis that fails after it started writing
        with output_dir(str(out)):
            (out / "utilisation.png").write_bytes(b"partial")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_real_process_prints_one_line(tmp_path):
    """What a shell (or sbatch) sees: a Hub tokenizer on an offline node, one line and status 2."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG % {"prefix": tmp_path / "x", "tok": "EleutherAI/gpt-neox-20b"})
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", str(cfg), "--dry-run=config"],
        capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "HuggingFace tokenizer EleutherAI/gpt-neox-20b: not a local file" in lines[0], lines
    assert "hf download EleutherAI/gpt-neox-20b tokenizer.json" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]
