#!/usr/bin/env python
"""Preprocess throughput vs. the tokenizer-alone ceiling, and peak RSS.

    python bench/preprocess.py --input corpus.jsonl --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model data/quickstart/tokenizer.model --workers 2 --repeats 3

* ours: the whole ``megatron-lol preprocess --workers N --append-eod`` command
  (interpreter start, reading, JSON parsing, tokenizing, writing .bin/.idx),
  wall-clock time of the process;
* ceiling: the same documents, already decoded and in memory, split into N
  contiguous parts, each encoded by its own process with the same tokenizer
  call the workers use (``encode_batch`` on ~1 MB batches), on the same N
  cores; wall-clock time of the encode phase only.

Runs alternate (ceiling, ours, ceiling, ours, ...) so that background load hits
both alike; the table reports the best and the median of each. ``--make-corpus
SRC.jsonl --min-mb 50`` first writes ``--input`` by repeating SRC's lines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)


def make_corpus(src: str, dst: str, min_mb: float) -> None:
    with open(src, "rb") as f:
        data = f.read()
    if not data.endswith(b"\n"):
        data += b"\n"
    reps = max(1, int(-(-min_mb * 2**20 // len(data))))
    with open(dst, "wb") as f:
        for _ in range(reps):
            f.write(data)


def tok_kwargs(a) -> dict:
    return dict(
        tokenizer_type=a.tokenizer_type,
        tokenizer_model=a.tokenizer_model,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
    )


def tok_argv(a) -> list:
    argv = ["--tokenizer-type", a.tokenizer_type]
    for flag, v in (
        ("--tokenizer-model", a.tokenizer_model),
        ("--vocab-file", a.vocab_file),
        ("--merge-file", a.merge_file),
    ):
        if v:
            argv += [flag, v]
    return argv


# -- ceiling -------------------------------------------------------------------------

_DOCS: list = []


def _encode_part(args) -> tuple:
    lo, hi, kw = args
    from megatron_lol.data.tokenizers import build_tokenizer

    tok = build_tokenizer(**kw)
    t0 = time.perf_counter()
    c0 = time.process_time()
    tokens = 0
    batch, size = [], 0
    for d in _DOCS[lo:hi]:
        batch.append(d)
        size += len(d)
        if size >= 1 << 20:
            tokens += sum(len(x) for x in tok.encode_batch(batch))
            batch, size = [], 0
    if batch:
        tokens += sum(len(x) for x in tok.encode_batch(batch))
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def ceiling(path: str, keys: list, kw: dict, workers: int) -> dict:
    global _DOCS
    with open(path, "rb") as f:
        _DOCS = [json.loads(line)[keys[0]] for line in f if line.strip()]
    nbytes = sum(len(d.encode()) for d in _DOCS)
    n = len(_DOCS)
    # equal shares of text per process (contiguous)
    cuts, acc, target, parts = [0], 0, nbytes / workers, []
    for i, d in enumerate(_DOCS):
        acc += len(d)
        if acc >= target * len(cuts) and len(cuts) < workers:
            cuts.append(i + 1)
    cuts.append(n)
    parts = [(cuts[i], cuts[i + 1], kw) for i in range(workers)]
    ctx = mp.get_context("fork")
    # tokenizer loading is not timed: start the processes, let each build its tokenizer, then time
    with ctx.Pool(workers) as pool:
        t0 = time.perf_counter()
        res = pool.map(_encode_part, parts, chunksize=1)
        wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "seconds": wall,
        "encode_seconds": max(r[1] for r in res),
        "tokens": sum(r[0] for r in res),
        "cpu_seconds": sum(r[2] for r in res),
        "mb": nbytes / 2**20,
        "documents": n,
        "peak_rss_mb": rss,
        "main_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# -- ours ----------------------------------------------------------------------------


def ours(a, out_dir: str) -> dict:
    summ = os.path.join(out_dir, "summary.json")
    cmd = [
        sys.executable,
        "-m",
        "megatron_lol",
        "preprocess",
        "--input",
        a.input,
        "--output-prefix",
        os.path.join(out_dir, "bench"),
        "--append-eod",
        "--workers",
        str(a.workers),
        "--overwrite",
        "--no-progress",
        "--summary-json",
        summ,
        "--json-keys",
        *a.json_keys,
        *tok_argv(a),
    ]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if proc.returncode:
        raise SystemExit(f"preprocess failed: {proc.stderr.strip()}")
    with open(summ) as f:
        s = json.load(f)
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens": s["tokens"],
        "documents": s["documents"],
        "peak_rss_mb": max(s["peak_rss_mb_main"], s["peak_rss_mb_worker"]),
        "main_rss_mb": s["peak_rss_mb_main"],
        "worker_rss_mb": s["peak_rss_mb_worker"],
    }


def _ceiling_subprocess(a) -> dict:
    """Run the ceiling in a fresh interpreter so its RSS is measured on its own."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--ceiling-only",
        "--input",
        a.input,
        "--workers",
        str(a.workers),
        "--json-keys",
        *a.json_keys,
        *tok_argv(a),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"ceiling failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", required=True)
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--make-corpus", default=None, help="write --input by repeating this JSONL")
    p.add_argument("--min-mb", type=float, default=50)
    p.add_argument("--ceiling-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--markdown", default=None, help="append the result table to this file")
    a = p.parse_args()

    if a.ceiling_only:
        print(json.dumps(ceiling(a.input, a.json_keys, tok_kwargs(a), a.workers)))
        return 0
    if a.make_corpus:
        make_corpus(a.make_corpus, a.input, a.min_mb)
    mb = os.path.getsize(a.input) / 2**20
    print(
        f"corpus {a.input}: {mb:.1f} MB; tokenizer {a.tokenizer_type}; {a.workers} workers; "
        f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs = {"ceiling": [], "ours": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(a.repeats):
            c = _ceiling_subprocess(a)
            runs["ceiling"].append(c)
            o = ours(a, out_dir)
            runs["ours"].append(o)
            print(
                f"  run {r + 1}: ceiling {c['seconds']:.2f} s ({c['mb'] / c['seconds']:.2f} MB/s), "
                f"ours {o['seconds']:.2f} s ({c['mb'] / o['seconds']:.2f} MB/s) -> "
                f"{c['seconds'] / o['seconds']:.1%}; CPU s: ceiling {c['cpu_seconds']:.1f}, "
                f"ours {o['cpu_seconds']:.1f} -> {c['cpu_seconds'] / o['cpu_seconds']:.1%}; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    c0 = runs["ceiling"][0]
    eods = runs["ours"][0]["documents"]  # upper bound: one EOD per non-empty document
    if not 0 <= runs["ours"][0]["tokens"] - c0["tokens"] <= eods:
        print(f"  WARNING: token counts differ (ceiling {c0['tokens']}, ours {runs['ours'][0]['tokens']} incl. EOD)")
    text_mb = c0["mb"]
    best_c = min(r["seconds"] for r in runs["ceiling"])
    best_o = min(r["seconds"] for r in runs["ours"])
    med_c = statistics.median(r["seconds"] for r in runs["ceiling"])
    med_o = statistics.median(r["seconds"] for r in runs["ours"])
    ratios = [c["seconds"] / o["seconds"] for c, o in zip(runs["ceiling"], runs["ours"])]
    cpu_c = min(r["cpu_seconds"] for r in runs["ceiling"])
    cpu_o = min(r["cpu_seconds"] for r in runs["ours"])
    rows = [
        "| | wall s (best / median) | MB/s (best) | tokens/s (best) | docs/s (best) | peak RSS MB (max process) |",
        "|---|---|---|---|---|---|",
        f"| ceiling: tokenizer alone, docs in memory, {a.workers} procs | {best_c:.2f} / {med_c:.2f} | "
        f"{text_mb / best_c:.2f} | {c0['tokens'] / best_c:,.0f} | {c0['documents'] / best_c:,.0f} | "
        f"{max(r['peak_rss_mb'] for r in runs['ceiling']):.0f} (main holding the corpus: "
        f"{max(r['main_rss_mb'] for r in runs['ceiling']):.0f}) |",
        f"| megatron-lol preprocess --workers {a.workers} (whole command) | {best_o:.2f} / {med_o:.2f} | "
        f"{text_mb / best_o:.2f} | {runs['ours'][0]['tokens'] / best_o:,.0f} | "
        f"{runs['ours'][0]['documents'] / best_o:,.0f} | "
        f"{max(r['main_rss_mb'] for r in runs['ours']):.0f} main, "
        f"{max(r['worker_rss_mb'] for r in runs['ours']):.0f} worker |",
        "",
        f"ours / ceiling throughput: best-vs-best {best_c / best_o:.1%}, median of paired runs "
        f"{statistics.median(ratios):.1%} (pairs: {', '.join(f'{x:.1%}' for x in ratios)}).",
        f"CPU seconds (all processes, best): ceiling {cpu_c:.1f} (encode only), ours {cpu_o:.1f} "
        f"(whole command) -> ceiling/ours {cpu_c / cpu_o:.1%}.",
        f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}.",
    ]
    table = "\n".join(rows)
    print(table)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
