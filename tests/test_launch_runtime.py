"""What a launched ``megatron-lol train`` takes from where it runs: threads, stop requests,
exit records, a dry run, a checkpoint's run_config.yaml as the config; per-node profile rows.

The Slurm side of the same behaviours is in tests/test_slurm.py; these run without a cluster.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TINY = """\
model: {plan: lol, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64, n_prelude: 1, n_coda: 1,
        num_blocks: 4, routed_depth: 3, window_size: 16, window_shift: 8, make_vocab_size_divisible_by: 64}
data: {paths: [%(prefix)s], split: "90,10,0", tokenizer_type: SentencePieceTokenizer, tokenizer_model: %(tok)s}
optimizer: {lr: 3.0e-3, lr_warmup_iters: 1}
training: {train_iters: 3, micro_batch_size: 2, global_batch_size: 2, seq_length: 64, log_interval: 1,
           eval_interval: 100, eval_iters: 0}
"""


def _yaml(tmp_path: Path, prefix: str = "/nonexistent/data", tok: str = "/nonexistent/tok.model") -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY % {"prefix": prefix, "tok": tok})
    return str(path)


# ------------------------------------------------------------------ threads
def test_threads_follow_the_allocation_unless_set():
    from megatron_lol.errors import CliError
    from megatron_lol.training.runtime import resolve_threads

    # torchrun: 4 workers share one Slurm task of 16 CPUs
    slurm = {
        "SLURM_CPUS_PER_TASK": "16",
        "SLURM_CPUS_ON_NODE": "64",
        "LOCAL_WORLD_SIZE": "4",
        "TORCHELASTIC_RUN_ID": "none",
    }
    assert resolve_threads(None, slurm) == (4, "SLURM_CPUS_PER_TASK=16 / 4 process(es) per task")
    # srun: one task per process
    srun = {"SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "8"}
    assert resolve_threads(None, srun)[0] == 8
    # no --cpus-per-task: the job's CPUs on the node over the node's processes
    assert resolve_threads(None, {"SLURM_CPUS_ON_NODE": "6", "LOCAL_WORLD_SIZE": "4"})[0] == 1
    assert resolve_threads(None, {"SLURM_CPUS_ON_NODE": "64", "LOCAL_WORLD_SIZE": "8"})[0] == 8
    # an explicit choice wins: OMP_NUM_THREADS, then --threads
    assert resolve_threads(None, dict(slurm, OMP_NUM_THREADS="2")) == (2, "OMP_NUM_THREADS")
    assert resolve_threads(3, dict(slurm, OMP_NUM_THREADS="2")) == (3, "--threads")
    assert resolve_threads(None, {"LOCAL_WORLD_SIZE": "1"})[0] >= 1
    with pytest.raises(CliError, match="--threads: must be >= 1"):
        resolve_threads(0, {})


def test_train_and_profile_take_a_threads_flag():
    import argparse

    from megatron_lol.training import cli, profile

    for module in (cli, profile):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args(["--config", "x.yaml", "--threads", "2"]).threads == 2


# ------------------------------------------------------------------ exit records, dry run, early handlers
def test_config_error_is_recorded_for_the_batch_script(tmp_path, monkeypatch, capsys):
    from megatron_lol.cli import main
    from megatron_lol.training import signals

    status = tmp_path / "status"
    monkeypatch.setenv("MEGATRON_LOL_STATUS_DIR", str(status))
    monkeypatch.setenv("RANK", "1")
    old = signal.getsignal(signal.SIGUSR1)
    try:
        rc = main(["train", "--config", _yaml(tmp_path), "--set", "training.bogus_key=1"])
        # the preemption handler was installed before the config was even read
        assert signal.getsignal(signal.SIGUSR1) is signals._handler
    finally:
        signals.restore_handlers()
        signal.signal(signal.SIGUSR1, old)
    assert rc == 2
    # a configuration error is printed by rank 0 only; every rank records it for the batch script
    assert capsys.readouterr().err.strip() == ""
    assert (
        status / "rank-1.status"
    ).read_text() == "2 megatron-lol train: error: --set training.bogus_key=1: unknown key 'training.bogus_key'\n"


def test_dry_run_validates_layout_batch_and_files(tmp_path, monkeypatch, capsys):
    from corpus_fixtures import write_tiny_tokenizer

    from megatron_lol.cli import main

    tok = write_tiny_tokenizer(tmp_path / "tok")  # the dry run loads it, as the run does
    cfg = _yaml(tmp_path, tok=str(tok))
    Path(cfg).write_text(Path(cfg).read_text().replace("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--config", cfg, "--dry-run=config", "--global-batch-size", "4"]) == 0
    assert "config OK: lol model, world size 2 = TP 1 x PP 1 x DP 2" in capsys.readouterr().out
    assert main(["train", "--config", cfg, "--dry-run=config"]) == 2  # 2 samples over 2 DP ranks x 2
    assert "training.global_batch_size (--global-batch-size): 2 is not a multiple of" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", "--config", cfg, "--dry-run"]) == 2  # the data files are missing
    assert "data.paths (--data-path): /nonexistent/data.bin does not exist" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["train", "--config", cfg, "--dry-run=config", "--set", "training.global_batch_size=4"]) == 2
    assert (
        "training.global_batch_size (--global-batch-size): 4 is not a multiple of micro_batch_size x "
        "data_parallel_size = 6" in capsys.readouterr().err
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--config", cfg, "--dry-run=config", "--tensor-model-parallel-size", "4"]) == 2


def test_stop_file_request():
    from megatron_lol.training import signals

    assert signals.stop_file_request("/nonexistent/stop") is None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus_fixtures import indexed_corpus

    root = tmp_path_factory.mktemp("runtime_corpus")
    prefix, tok = indexed_corpus(str(root), max_bytes=150_000, max_doc=6000, vocab_size=512)
    return prefix, tok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_request_from_the_launcher_saves_after_the_first_step(tmp_path, corpus):
    """A stop request written before the trainer listened (what the Slurm scripts do with a
    SIGUSR1 that reached the batch shell or a starting task): save after step 1, exit 85, record it.
    The run's saved run_config.yaml is then a valid --config."""
    import subprocess
    import sys

    from megatron_lol.config import load_config
    from megatron_lol.training.signals import EXIT_REQUEUE, REQUEUE_MARKER

    prefix, tok = corpus
    cfg, save, status = _yaml(tmp_path, prefix, tok), tmp_path / "save", tmp_path / "status"
    stop = tmp_path / "stop"
    stop.write_text("SIGUSR1\n")
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MEGATRON_LOL_STOP_FILE=str(stop),
        MEGATRON_LOL_STATUS_DIR=str(status),
        PYTHONPATH=str(REPO) + ":" + env.get("PYTHONPATH", ""),
    )
    res = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", cfg, "--save", str(save)],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = res.stdout + res.stderr
    assert res.returncode == EXIT_REQUEUE, out[-3000:]
    assert "preemption: received SIGUSR1 at iteration 1:" in out
    assert "threads: 1 per process (OMP_NUM_THREADS)" in out
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (save / REQUEUE_MARKER).read_text().startswith("1 received SIGUSR1")
    assert (status / "rank-0.status").read_text().startswith("85 megatron-lol train: saved iteration 1")

    # the checkpoint's run_config.yaml (with its `checkpoint:` section) loads as a config
    run_config = save / "iter_0000001" / "run_config.yaml"
    assert "checkpoint:" in run_config.read_text()
    loaded = load_config(str(run_config), check_data=False)
    assert loaded.model.vocab_size == 512 and loaded.training.train_iters == 3
    env.pop("MEGATRON_LOL_STOP_FILE")
    res = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", str(run_config), "--load", str(save), "--dry-run"],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "config OK" in res.stdout, res.stdout + res.stderr


def test_checkpoint_section_must_be_a_mapping(tmp_path):
    from megatron_lol.config import ConfigError, load_config

    path = tmp_path / "run_config.yaml"
    path.write_text("model: {hidden_size: 32}\ncheckpoint: 12\n")
    with pytest.raises(ConfigError, match="checkpoint must be a mapping"):
        load_config(str(path), check_data=False)
    path.write_text("model: {hidden_size: 32}\ncheckpoint: {iteration: 3, padded_vocab_size: 512}\n")
    assert load_config(str(path), check_data=False).model.hidden_size == 32


# ------------------------------------------------------------------ profile rows per node
def _rank_report(rank: int, node: int, host: str, step: float) -> dict:
    return {
        "host": host,
        "node": node,
        "rank": rank,
        "devices_per_node": 2,
        "tokens_per_s_per_device": 100.0,
        "step_time_s": {"median": step},
        "tflops_per_device": 1.0,
        "mfu": None,
        "peak_memory": {"bytes": 2**20 * (rank + 1)},
        "gpu": None,
    }


def test_profile_rows_are_per_node_even_when_hostnames_repeat():
    from megatron_lol.training.profile_report import format_nodes, merge_reports, node_identity, node_rows

    # two containers (or slurmd instances) that report the same hostname
    ranks = [
        _rank_report(0, 0, "box", 1.0),
        _rank_report(1, 0, "box", 2.0),
        _rank_report(2, 1, "box", 1.0),
        _rank_report(3, 1, "box", 1.0),
    ]
    rows = node_rows(ranks)
    assert [(r["node"], r["ranks"]) for r in rows] == [(0, [0, 1]), (1, [2, 3])]
    assert rows[0]["step_time_s"] == 2.0 and rows[0]["tokens_per_s_per_node"] == pytest.approx(100.0)
    assert rows[1]["tokens_per_s_per_node"] == pytest.approx(200.0)
    merged = merge_reports([{"nodes": rows}])
    assert merged["summary"]["nodes"] == 2 and merged["summary"]["slowest_node"] == "box#0"
    table = format_nodes(merged)
    assert "box#0" in table and "box#1" in table
    assert node_identity({"SLURM_NODEID": "3", "SLURMD_NODENAME": "gpu017", "RANK": "0"}) == (3, "gpu017")
    assert node_identity({"GROUP_RANK": "2", "RANK": "9", "LOCAL_WORLD_SIZE": "4"})[0] == 2
    assert node_identity({"RANK": "9", "LOCAL_WORLD_SIZE": "4"})[0] == 2


def test_profile_split_keeps_the_report_api():
    from megatron_lol.training import profile, profile_report

    assert profile.merge_reports is profile_report.merge_reports
    assert profile.format_nodes is profile_report.format_nodes
    for path in (REPO / "megatron_lol").rglob("*.py"):
        if path.name.startswith("profile"):
            assert len(path.read_text().splitlines()) <= 600, path


def test_stop_check_reads_the_stop_file(tmp_path, monkeypatch):
    from megatron_lol.training import signals

    stop = tmp_path / "stop"
    monkeypatch.setenv(signals.STOP_FILE_ENV, str(stop))
    check = signals.StopCheck()
    assert check() is None
    stop.write_text("SIGUSR1\n")
    assert check() == "received SIGUSR1"
    stop.write_text("")
    assert check() == "received SIGUSR1"
    stop.write_text("SIGTERM")
    assert check() == "received SIGTERM"
    assert json.dumps(signals.stop_file_request(str(stop))) == str(int(signal.SIGTERM))
