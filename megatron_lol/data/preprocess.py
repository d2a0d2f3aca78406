"""``megatron-lol preprocess``: corpora to Megatron indexed datasets.

A drop-in for Megatron-LM's ``tools/preprocess_data.py`` flags, streaming (the
index is written incrementally: memory does not grow with the corpus), with
parquet/zstd/txt input, ``--shard I/N`` for Slurm arrays and errors that name
``file:line``. For the same tokenizer type and file the ``.bin`` is
byte-identical to Megatron-LM's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from collections import deque

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from megatron_lol.data import readers, workers  # noqa: E402
from megatron_lol.data.indexed import StreamingIndexWriter, optimal_dtype, remove_stale_tmp, tmp_name  # noqa: E402
from megatron_lol.data.preprocess_worker import _meta, _worker_init, encode_task  # noqa: E402

LEVEL = "document"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("input data")
    g.add_argument(
        "--input", required=True, nargs="+", help="file(s), directory or glob: .jsonl/.json[.gz|.zst], .parquet, .txt"
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys / parquet columns to tokenize (one dataset per key)"
    )
    g.add_argument("--split-sentences", action="store_true", help="not supported (Megatron-LM NLTK mode)")
    g.add_argument("--keep-newlines", action="store_true", help="accepted, no effect")
    g.add_argument("--lang", default="english", help="accepted, no effect")
    t = parser.add_argument_group("tokenizer")
    t.add_argument(
        "--tokenizer-type",
        required=True,
        help="SentencePieceTokenizer, HuggingFaceTokenizer, TikTokenizer, GPT2BPETokenizer",
    )
    t.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece model, tokenizer.json (or dir), tiktoken file"
    )
    t.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    t.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    t.add_argument("--vocab-size", type=int, default=None, help="TikTokenizer vocabulary size (incl. special tokens)")
    t.add_argument(
        "--tiktoken-pattern",
        default=None,
        choices=["v1", "v2"],
        help="TikTokenizer: Megatron-LM's pre-tokenisation pattern (v1 or v2; default v2)",
    )
    t.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        metavar="N",
        help="TikTokenizer: ids reserved for special tokens below the vocabulary (default 1000)",
    )
    t.add_argument(
        "--tiktoken-special-tokens",
        nargs="+",
        default=None,
        metavar="TOKEN",
        help="TikTokenizer: the first special tokens, in id order "
        "(default: Megatron-LM's <unk> <s> </s> <mask> <pad> <cls> <sep>)",
    )
    t.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="HuggingFaceTokenizer: do not add the post-processor's special tokens",
    )
    t.add_argument("--eod-token", default=None, help="HuggingFaceTokenizer: the end-of-document token")
    t.add_argument("--tokenizer-sentencepiece-legacy", action="store_true", help="accepted, no effect")
    t.add_argument("--vocab-extra-ids", type=int, default=0, help="must be 0")
    t.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="accepted, no effect")
    p = parser.add_argument_group("tokenization process")
    p.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    o = parser.add_argument_group("output data")
    o.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    o.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    o.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="accepted (mmap only)")
    r = parser.add_argument_group("runtime")
    r.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    r.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted for compatibility; documents always keep input order (use --workers)",
    )
    r.add_argument("--keep-sequential-samples", action="store_true", help="accepted (always on)")
    r.add_argument("--log-interval", type=int, default=1000, help="documents between log lines (non-tty)")
    r.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="process the I-th (0-based) of N deterministic shards; merge with merge-datasets",
    )
    r.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed JSON, missing keys and invalid UTF-8 (counted) instead of stopping",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar / log lines")
    r.add_argument("--max-inflight", type=int, default=0, help="tasks in flight (default 4 per worker)")
    r.add_argument("--summary-json", default=None, help="also write the final summary as JSON here")
    r.add_argument(
        "--dry-run",
        action="store_true",
        help="check the inputs (parquet columns), the outputs and the tokenizer as a run would, write nothing",
    )


def tokenizer_kwargs(args) -> dict:
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
        vocab_size=args.vocab_size,
        eod_token=args.eod_token,
        include_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
    )


def parse_shard(spec) -> tuple:
    if spec is None:
        return 0, 1
    try:
        i, n = (int(x) for x in str(spec).split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N, got {spec!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {spec}: need 0 <= I < N")
    return i, n


def shard_suffix(shard: int, num_shards: int) -> str:
    return "" if num_shards == 1 else f".shard-{shard:05d}-of-{num_shards:05d}"


def output_prefixes(output_prefix: str, keys: list, shard: int = 0, num_shards: int = 1) -> dict:
    suf = shard_suffix(shard, num_shards)
    return {k: f"{output_prefix}_{k}_{LEVEL}{suf}" for k in keys}


# -- main side ------------------------------------------------------------------


class Progress:
    def __init__(self, total_bytes: int, enabled: bool, log_interval: int):
        self.start = time.time()
        self.docs = self.tokens = self.text_bytes = 0
        self.log_interval = max(1, log_interval)
        self.next_log = self.log_interval
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="preprocess",
                file=sys.stderr,
                smoothing=0.1,
                mininterval=0.5,
            )

    def input_bytes(self, n: int) -> None:
        if self.bar is not None and n > 0:
            self.bar.update(n)

    def rates(self) -> tuple:
        el = max(1e-9, time.time() - self.start)
        return self.docs / el, self.text_bytes / el / 2**20, self.tokens / el

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.text_bytes += nbytes
        if not self.enabled:
            return
        dps, mbs, tps = self.rates()
        if self.bar is not None:
            self.bar.set_postfix_str(f"{dps:,.0f} docs/s, {mbs:.2f} MB/s, {tps:,.0f} tok/s", refresh=False)
        elif self.docs >= self.next_log:
            self.next_log = (self.docs // self.log_interval + 1) * self.log_interval
            print(
                f"Processed {self.docs} documents ({dps:,.1f} docs/s, {mbs:.2f} MB/s, {tps:,.0f} tokens/s).",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _peak_rss_mb() -> tuple:
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return self_kb / 1024, child_kb / 1024


def preprocess(args) -> dict:
    """Run preprocessing; raises CliError-compatible ValueError subclasses on user errors."""
    from megatron_lol.data.tokenizers import build_tokenizer

    if args.split_sentences:
        raise ValueError("--split-sentences is not supported (documents are tokenized whole)")
    if args.vocab_extra_ids:
        raise ValueError("--vocab-extra-ids is not supported")
    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    shard, num_shards = parse_shard(args.shard)
    keys = list(args.json_keys)
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate --json-keys: {keys}")
    paths = readers.expand_inputs(args.input)
    if any(readers.file_kind(p) == "txt" for p in paths) and len(keys) > 1:
        raise ValueError(".txt inputs hold one text per file: give a single --json-keys")
    readers.check_parquet_columns(paths, keys)
    prefixes = output_prefixes(args.output_prefix, keys, shard, num_shards)
    if not args.overwrite:
        for pre in prefixes.values():
            for ext in (".bin", ".idx"):
                if os.path.exists(pre + ext):
                    raise ValueError(f"{pre + ext} exists (pass --overwrite to replace it)")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if args.dry_run:
        return _dry_run(args, paths, keys, prefixes, out_dir, shard, num_shards)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--output-prefix: cannot create the output directory {out_dir} ({err.strerror})") from None
    if args.partitions > 1 and not args.no_progress:
        print(
            "note: --partitions is accepted for compatibility; documents keep input order, "
            "parallelism comes from --workers",
            file=sys.stderr,
        )

    for pre in prefixes.values():  # leftovers of runs killed before they could clean up
        for path in (pre + ".bin", pre + ".idx", pre + ".lengths"):
            for name in remove_stale_tmp(path):
                print(f"preprocess: removed {name} (left by a killed run)", file=sys.stderr)

    tok_kwargs = tokenizer_kwargs(args)
    tok = build_tokenizer(**tok_kwargs)
    dtype = optimal_dtype(tok.vocab_size)
    pieces = readers.shard_pieces(paths, shard, num_shards)
    total_bytes = sum(p.size for p in pieces)

    previous_sigterm = workers.raise_on_sigterm()  # before any temporary file exists
    writers: dict = {}
    progress = Progress(total_bytes, not args.no_progress, args.log_interval)
    counts = {"bad_lines": 0, "bad_examples": []}
    empty = {k: 0 for k in keys}
    init = (tok_kwargs, keys, args.append_eod, args.skip_bad_lines, np.dtype(dtype).name)
    pool = None
    procs: dict = {}  # pid -> worker Process: the executor's own table once the pool exists
    t0 = time.time()

    def handle(res: dict) -> None:
        if "error" in res:
            idx, reason = res["error"]
            where = _where(res["task"], paths, idx)
            raise BadInputError(
                f"{where}: {reason}" + ("" if args.skip_bad_lines else " (use --skip-bad-lines to skip such lines)")
            )
        if res["bad"]:
            counts["bad_lines"] += len(res["bad"])
        tokens = 0
        for k, (data, lengths, n_empty, n_tok) in res["keys"].items():
            if lengths.size:
                writers[k].add_documents(data, lengths)
            empty[k] += n_empty
            tokens += n_tok
        progress.update(res["docs"], tokens, res["bytes"])

    try:
        for k in keys:
            writers[k] = StreamingIndexWriter(prefixes[k], dtype)
        tasks = readers.iter_tasks(pieces, keys, progress.input_bytes)
        if args.workers == 1:
            _worker_init(*init)
            for task in tasks:
                res = encode_task(task)
                _note_bad(res, task, paths, counts)
                handle(res)
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            # concurrent.futures, not multiprocessing.Pool: a worker killed by the OOM killer
            # fails its future (BrokenProcessPool) instead of leaving the main process waiting
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
            pool = ProcessPoolExecutor(
                args.workers, mp_context=ctx, initializer=_worker_init, initargs=init + (os.getpid(),)
            )
            procs = workers.process_table(pool)
            inflight = args.max_inflight or 4 * args.workers
            pending: deque = deque()
            for task in tasks:
                pending.append((task[:4], workers.submit(pool, procs, encode_task, task, paths)))
                while len(pending) >= inflight:
                    meta, fut = pending.popleft()
                    res = workers.result(procs, fut, meta, paths)
                    _note_bad(res, meta, paths, counts)
                    handle(res)
            while pending:
                meta, fut = pending.popleft()
                res = workers.result(procs, fut, meta, paths)
                _note_bad(res, meta, paths, counts)
                handle(res)
            pool.shutdown(wait=True)
            pool = None
        if num_shards == 1:
            # an empty dataset would pass every later check and fail only after a training run's start-up
            for k, w in writers.items():
                if w.documents == 0:
                    raise EmptyInputError(
                        f"--input {' '.join(args.input)}: no document with text under "
                        f"--json-keys {k} ({progress.docs} read, {empty[k]} empty); "
                        f"nothing written"
                    )
        for w in writers.values():
            w.finalize()
    except BaseException:
        if pool is not None:
            workers.stop_workers(pool, procs)
        for w in writers.values():
            w.abort()
        for pre in prefixes.values():  # also a writer a signal interrupted while it was being made
            for path in (pre + ".bin", pre + ".idx", pre + ".lengths"):
                try:
                    os.unlink(tmp_name(path))
                except FileNotFoundError:
                    pass
        progress.close()
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    progress.close()
    elapsed = time.time() - t0
    rss_self, rss_child = _peak_rss_mb()
    summary = {
        "inputs": len(paths),
        "shard": f"{shard}/{num_shards}",
        "documents": progress.docs,
        "tokens": progress.tokens,
        "input_mb": progress.text_bytes / 2**20,
        "seconds": elapsed,
        "docs_per_s": progress.docs / max(elapsed, 1e-9),
        "mb_per_s": progress.text_bytes / 2**20 / max(elapsed, 1e-9),
        "tokens_per_s": progress.tokens / max(elapsed, 1e-9),
        "empty_documents": empty,
        "bad_lines_skipped": counts["bad_lines"],
        "bad_line_examples": counts["bad_examples"],
        "peak_rss_mb_main": rss_self,
        "peak_rss_mb_worker": rss_child,
        "dtype": np.dtype(dtype).name,
        "vocab_size": tok.vocab_size,
        "eod": tok.eod,
        "outputs": {
            k: {"prefix": prefixes[k], "documents": writers[k].documents, "tokens": writers[k].tokens} for k in keys
        },
    }
    return summary


def _dry_run(args, paths: list, keys: list, prefixes: dict, out_dir: str, shard: int, num_shards: int) -> dict:
    """What ``preprocess`` checks before it writes (inputs, parquet columns, outputs, the tokenizer as
    the workers build it), with nothing written: a submitting host runs it before queueing an array."""
    from megatron_lol.data.tokenizers import build_tokenizer

    existing = out_dir
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-prefix: {out_dir} cannot be created ({existing} is not writable)")
    tok = build_tokenizer(**tokenizer_kwargs(args))
    pieces = readers.shard_pieces(paths, shard, num_shards)
    return {
        "dry_run": True,
        "inputs": len(paths),
        "input_mb": sum(os.path.getsize(p) for p in paths) / 2**20,
        "shard": f"{shard}/{num_shards}",
        "pieces": len(pieces),
        "tokenizer": f"{args.tokenizer_type} ({', '.join(tok.files)})",
        "vocab_size": tok.vocab_size,
        "eod": tok.eod,
        "dtype": np.dtype(optimal_dtype(tok.vocab_size)).name,
        "outputs": {k: {"prefix": prefixes[k]} for k in keys},
    }


class BadInputError(ValueError):
    pass


class EmptyInputError(ValueError):
    """The input holds no document with text: no dataset is written."""


def _note_bad(res: dict, task_meta: tuple, paths: list, counts: dict) -> None:
    """Remember the first few skipped lines (file:line) for the summary."""
    if "error" in res or not res.get("bad") or len(counts["bad_examples"]) >= 5:
        return
    for idx, reason in res["bad"][: 5 - len(counts["bad_examples"])]:
        counts["bad_examples"].append(f"{_where(_meta(task_meta), paths, idx)}: {reason}")


def _where(meta: tuple, paths: list, idx: int) -> str:
    path = paths[meta[1]]
    if meta[0] == "lines":
        return f"{path}:{readers.line_number(path, meta[2], meta[3], idx)}"
    return f"{path}:{meta[2] + idx} (parquet row)"


def format_summary(s: dict) -> str:
    if s.get("dry_run"):
        return (
            f"preprocess: dry run OK: {s['inputs']} file(s), {s['input_mb']:.1f} MB (shard {s['shard']}: "
            f"{s['pieces']} piece(s)); tokenizer {s['tokenizer']}: vocab {s['vocab_size']}, EOD {s['eod']}, "
            f"{s['dtype']} tokens; would write " + ", ".join(f"{o['prefix']}.bin/.idx" for o in s["outputs"].values())
        )
    lines = [
        f"preprocess: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['input_mb']:.1f} MB "
        f"from {s['inputs']} file(s) (shard {s['shard']}) in {s['seconds']:.1f} s",
        f"  throughput: {s['docs_per_s']:,.0f} docs/s, {s['mb_per_s']:.2f} MB/s, {s['tokens_per_s']:,.0f} tokens/s",
        f"  peak RSS: main {s['peak_rss_mb_main']:.0f} MB, largest worker {s['peak_rss_mb_worker']:.0f} MB",
        f"  tokens: {s['dtype']} (vocab {s['vocab_size']}, EOD {s['eod']})",
    ]
    for k, o in s["outputs"].items():
        lines.append(
            f"  {k}: {o['documents']:,} documents, {o['tokens']:,} tokens -> {o['prefix']}.bin/.idx"
            f" (empty documents skipped: {s['empty_documents'][k]})"
        )
    if s["bad_lines_skipped"]:
        lines.append(f"  bad lines skipped: {s['bad_lines_skipped']}")
        lines.extend(f"    {e}" for e in s["bad_line_examples"])
    return "\n".join(lines)


def run(args) -> int:
    from megatron_lol.data.tokenizers import TokenizerError
    from megatron_lol.errors import CliError

    try:
        summary = preprocess(args)
    except (ValueError, TokenizerError, readers.InputError, OSError, workers.WorkerDiedError) as err:
        raise CliError(
            f"{err} (partial outputs removed)" if isinstance(err, workers.WorkerDiedError) else str(err)
        ) from None
    except workers.Terminated as err:
        raise CliError(f"{err}; partial outputs removed") from None
    print(format_summary(summary))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0
