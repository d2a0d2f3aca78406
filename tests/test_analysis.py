"""Routing analyses: plain functions on an in-memory model, then
``megatron-lol analyze`` end to end on a tiny checkpoint written by ``megatron-lol train``
(the real trainer and its CheckpointHook, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ in-memory model
@pytest.fixture
def routed_model(make_model):
    # random router weights so that windows route to different blocks
    return make_model(router_std=1.0, num_blocks=3, routed_depth=4, window_size=8, window_shift=4)


def _examples(n_tokens=(5, 20, 33, 7, 40, 12), seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in n_tokens]


def test_packed_routes_equal_routes_alone(routed_model):
    from megatron_lol.analysis.routing import collect_routes, prepare_examples

    toks = _examples()
    routes = collect_routes(routed_model, toks, 32, 0, rows_per_batch=2)
    assert [r.length for r in routes] == [6, 21, 32, 8, 32, 13]  # EOD added, truncated at seq_length
    for tk, route in zip(toks, routes):
        ex = prepare_examples([tk], 32, 0)[0]
        _, routed_model_core = routed_model(torch.tensor([ex]), record=True, return_core=True)
        assert len(route.records) == 4
        for rec, mine in zip(routed_model_core.records, route.records):
            assert rec.choice.tolist() == mine.choice.tolist()
            assert mine.window_ordinal.tolist() == list(range(len(mine.choice)))
            torch.testing.assert_close(rec.probs.float(), mine.probs, atol=1e-5, rtol=1e-5)


def test_utilisation_paths_and_pca(routed_model):
    from megatron_lol.analysis.routing import (
        collect_routes,
        nearest_centroid_accuracy,
        path_vectors,
        pca,
        utilisation_counts,
    )

    toks = _examples()
    routes = collect_routes(routed_model, toks, 32, 0)
    counts = utilisation_counts(routes, 4, 3)
    windows = [sum(len(r.records[d].choice) for r in routes) for d in range(4)]
    assert counts.sum(1).tolist() == windows
    vec = path_vectors(routes, 4, 3)
    k_max = max(len(rec.choice) for r in routes for rec in r.records)
    assert vec.shape == (6, 4 * k_max * 3)
    # one-hot: every (depth, ordinal) an example reaches has exactly one block
    per_slot = vec.view(6, 4, k_max, 3).sum(-1)
    for n, r in enumerate(routes):
        for d, rec in enumerate(r.records):
            assert per_slot[n, d, : len(rec.choice)].tolist() == [1.0] * len(rec.choice)
            assert per_slot[n, d, len(rec.choice) :].sum() == 0
    coords, ratio = pca(vec, 2)
    assert coords.shape == (6, 2) and 0 <= float(ratio.sum()) <= 1 + 1e-6
    assert abs(float(coords[:, 0].mean())) < 1e-5  # centred
    # labels that the path determines are recovered
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0], [0.0, 0.1], [5.0, 5.1]])
    assert nearest_centroid_accuracy(x, ["a", "a", "b", "b", "a", "b"]) == 1.0
    assert nearest_centroid_accuracy(x, ["a"] * 6) is None


def test_token_paths_and_distinct_blocks():
    from megatron_lol.analysis.routing import (
        ExampleRoute,
        WindowRecord,
        distinct_per_path,
        distinct_summary,
        token_paths,
    )

    # one example of 8 tokens, W=4, S=2, D=2: depth 1 windows [0,3] [4,7]; depth 2 [0,1] [2,5] [6,7]
    def rec(depth, choice):
        k = len(choice)
        return WindowRecord(depth, torch.tensor(choice), torch.ones(k), torch.full((k, 3), 1 / 3), torch.arange(k))

    route = ExampleRoute(length=8, records=[rec(1, [0, 1]), rec(2, [2, 0, 1])])
    paths = token_paths([route], 2, 4, 2)
    assert paths.tolist() == [[0, 2], [0, 2], [0, 0], [0, 0], [1, 0], [1, 0], [1, 1], [1, 1]]
    assert distinct_per_path(paths, 3).tolist() == [2, 2, 1, 1, 2, 2, 1, 1]
    s = distinct_summary([route], 2, 3, 4, 2)
    assert s["histogram"] == {"0": 0, "1": 4, "2": 4} and s["mean_distinct"] == 1.5
    assert s["expected_distinct_uniform"] == pytest.approx(3 * (1 - (2 / 3) ** 2))
    assert s["unique_paths"] == 4


def test_mode_path_forcing_loss_and_generation(routed_model):
    from megatron_lol.analysis.routing import collect_routes, forced_path, greedy_generate, lm_loss, mode_path

    toks = _examples()
    routes = collect_routes(routed_model, toks, 32, 0)
    ids, gates = mode_path(routes)
    assert ids.shape[0] == 4 and (ids < 3).all()
    forced = forced_path(ids, gates)
    # under the forced path every window reached follows it (ids >= 0 everywhere reached)
    frouted = collect_routes(routed_model, toks, 32, 0, forced=forced)
    for r in frouted:
        for d, rec in enumerate(r.records):
            want = ids[d, rec.window_ordinal]
            assert rec.choice.tolist() == want.tolist()
            torch.testing.assert_close(rec.gate, gates[d, rec.window_ordinal])
    routed = lm_loss(routed_model, toks, 32, 0)
    fl = lm_loss(routed_model, toks, 32, 0, forced=forced)
    assert torch.isfinite(torch.tensor([routed, fl])).all() and routed != fl
    # the packed loss equals the loss of each example alone, token-weighted
    alone = [lm_loss(routed_model, [t], 32, 0) for t in toks]
    n = [min(len(t), 31) for t in toks]  # targets per example: tokens (EOD included) - 1
    assert routed == pytest.approx(sum(a * k for a, k in zip(alone, n)) / sum(n), rel=1e-5)
    # generation: greedy, deterministic, and steered by the path
    g1 = greedy_generate(routed_model, toks[1], 6, eod_id=None, forced=forced)
    assert g1 == greedy_generate(routed_model, toks[1], 6, eod_id=None, forced=forced) and len(g1) == 6


# ------------------------------------------------------------------ CLI on a trained checkpoint
TINY = """\
model:
  plan:
    kind: lol
    routing:
      bias_update_speed: 0.01
    windows:
      size: 16
      shift: 8
  hidden_size: 32
  num_attention_heads: 4
  ffn_hidden_size: 64
  n_prelude: 1
  n_coda: 1
  num_blocks: 4
  routed_depth: 3
  make_vocab_size_divisible_by: 64
data:
  paths: [{prefix}]
  split: "80,20,0"
  tokenizer_type: SentencePieceTokenizer
  tokenizer_model: {tokenizer}
  cache_dir: {cache}
optimizer:
  lr: 3.0e-3
  min_lr: 3.0e-4
  lr_warmup_iters: 2
training:
  train_iters: 8
  micro_batch_size: 2
  global_batch_size: 4
  seq_length: 64
  log_interval: 4
  eval_interval: 100
  eval_iters: 0
  save: {save}
"""


def _env() -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny LoL checkpoint from ``python -m megatron_lol train`` (8 steps) plus its data."""
    from corpus_fixtures import indexed_corpus, stdlib_documents

    root = tmp_path_factory.mktemp("analysis")
    prefix, tok = indexed_corpus(str(root), max_bytes=150_000, max_doc=4000, vocab_size=384)
    docs = stdlib_documents(max_bytes=150_000, max_doc=4000)
    # a labelled jsonl: prose-like vs code-like lines
    with open(root / "labelled.jsonl", "w") as f:
        for i, d in enumerate(docs[:24]):
            lines = [ln for ln in d.splitlines() if ln.strip()][:12]
            label = "code" if i % 2 else "comment"
            text = "\n".join(ln for ln in lines if ln.lstrip().startswith("#") == (label == "comment")) or d[:200]
            f.write(json.dumps({"text": text[:600], "kind": label}) + "\n")
    save = root / "ckpt"
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY.format(prefix=prefix, tokenizer=tok, cache=root / "cache", save=save))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lol", "train", "--config", str(cfg)],
        cwd=str(REPO),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    return {"save": save, "prefix": prefix, "jsonl": root / "labelled.jsonl", "root": root}


def _analyze(*argv) -> int:
    from megatron_lol.cli import main

    return main(["analyze", *map(str, argv)])


def test_cli_utilisation_paths_distinct(trained, tmp_path, capsys, monkeypatch):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    common = ["--load", trained["save"], "--data-path", trained["prefix"], "--max-examples", 16, "--output", out]
    monkeypatch.setenv("MEGATRON_LOL_PROGRESS_INTERVAL", "0")  # not a terminal: a progress line per batch
    assert _analyze("utilisation", "--rows-per-batch", 2, *common) == 0
    assert "analyze: routing: batch 1 of " in capsys.readouterr().err
    monkeypatch.delenv("MEGATRON_LOL_PROGRESS_INTERVAL")
    util = json.loads((out / "utilisation.json").read_text())
    assert len(util["counts"]) == 3 and len(util["counts"][0]) == 4 and util["iteration"] == 8
    assert (out / "utilisation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _analyze("distinct", *common) == 0
    dist = json.loads((out / "distinct.json").read_text())
    assert dist["expected_distinct_uniform"] == pytest.approx(4 * (1 - 0.75**3))
    assert 1 <= dist["mean_distinct"] <= 3 and sum(dist["histogram"].values()) == dist["tokens"]
    assert (out / "distinct.png").stat().st_size > 1000
    assert (
        _analyze(
            "paths", "--load", trained["save"], "--jsonl", trained["jsonl"], "--label-field", "kind", "--output", out
        )
        == 0
    )
    paths = json.loads((out / "paths.json").read_text())
    assert paths["labels"] == ["code", "comment"] and len(paths["examples"]) == 24
    assert 1 <= paths["distinct_paths"] == len({json.dumps(e["path"]) for e in paths["examples"]}) <= 24
    assert all(len(e["pc"]) == 2 and len(e["path"]) == 3 for e in paths["examples"])
    assert (out / "paths_pca.png").stat().st_size > 1000


def test_cli_mode_path_evaluate_generate(trained, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "mp"
    assert (
        _analyze(
            "mode-path",
            "--load",
            trained["save"],
            "--jsonl",
            trained["jsonl"],
            "--label-field",
            "kind",
            "--evaluate",
            "--generate",
            "def main(",
            "--max-new-tokens",
            8,
            "--output",
            out,
        )
        == 0
    )
    mp = json.loads((out / "mode_path.json").read_text())
    assert len(mp["ids"]) == 3 and set(mp["per_label"]) == {"code", "comment"}
    ev = mp["evaluation"]
    assert ev["routed_loss"] > 0 and ev["forced_loss"] > 0
    assert set(ev["per_label"]["code"]) == {"routed_loss", "forced_global_loss", "forced_own_label_loss"}
    gen = mp["generation"]
    assert 1 <= len(gen["routed_ids"]) <= 8 and 1 <= len(gen["forced_ids"]) <= 8
    # a hand-written path file is forced as given
    path_file = tmp_path / "path.json"
    path_file.write_text(json.dumps({"ids": [[0] * 4] * 3, "gates": [[1.0] * 4] * 3}))
    assert (
        _analyze(
            "mode-path",
            "--load",
            trained["save"],
            "--path-file",
            path_file,
            "--data-path",
            trained["prefix"],
            "--max-examples",
            4,
            "--evaluate",
            "--output",
            out,
        )
        == 0
    )
    assert json.loads((out / "mode_path.json").read_text())["ids"] == [[0] * 4] * 3


def test_cli_user_errors(trained, tmp_path, capsys):
    assert (
        _analyze("utilisation", "--load", tmp_path / "nope", "--data-path", trained["prefix"], "--output", tmp_path)
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert (
        _analyze(
            "paths",
            "--load",
            trained["save"],
            "--data-path",
            trained["prefix"],
            "--label-field",
            "x",
            "--output",
            tmp_path,
        )
        == 2
    )
    assert "--label-field needs --jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ids": [[9]], "gates": [[1.0]]}))
    assert _analyze("mode-path", "--load", trained["save"], "--path-file", bad, "--output", tmp_path) == 2
    assert "expected [3, K]" in capsys.readouterr().err
