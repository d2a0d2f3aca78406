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

LEVEL = "document"


class BadInput(Exception):
    """Raised inside a worker for a bad line when --skip-bad-lines is off."""


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


# -- worker side ----------------------------------------------------------------

_W: dict = {}


def _worker_init(
    tok_kwargs: dict, keys: list, append_eod: bool, skip_bad: bool, dtype_name: str, parent_pid: int | None = None
) -> None:
    from megatron_lol.data.tokenizers import build_tokenizer

    if parent_pid is not None:  # a worker process: exit with the main process, even after kill -9
        from megatron_lol.process_guard import die_with_parent

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's unwinding handler
        die_with_parent(parent_pid)

    _W["tok"] = build_tokenizer(**tok_kwargs)
    _W["keys"] = keys
    _W["eod"] = _W["tok"].eod if append_eod else None
    _W["skip"] = skip_bad
    _W["dtype"] = np.dtype(dtype_name)


def _encode_texts(texts: list) -> list:
    tok = _W["tok"]
    try:
        return tok.encode_batch(texts)
    except Exception:  # noqa: BLE001 - find the document that fails
        out = []
        for t in texts:
            try:
                out.append(tok.tokenize(t))
            except Exception as err:  # noqa: BLE001
                out.append(err)
        return out


def _surrogate_reason(key: str, text: str):
    """A ``\\ud800``-style escape decodes to a lone surrogate, which is not Unicode text: no
    tokenizer can encode it (their bindings fail with messages about C++ casts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (
            f"key {key!r} holds a lone surrogate U+{ord(text[err.start]):04X} at character {err.start} "
            f"(an unpaired \\u escape: not valid Unicode)"
        )
    return None


def _pack(encoded: list) -> tuple:
    """Flatten documents (+EOD) into dtype bytes; returns (bytes, lengths, empties, tokens)."""
    eod = _W["eod"]
    extra = 0 if eod is None else 1
    lens = [len(ids) for ids in encoded]
    lengths = np.array([n + extra for n in lens if n], dtype=np.int32)
    total = int(lengths.sum(dtype=np.int64))
    arr = np.empty(total, dtype=_W["dtype"])
    pos = 0
    for ids, n in zip(encoded, lens):
        if n:
            arr[pos : pos + n] = ids
            pos += n
            if extra:
                arr[pos] = eod
                pos += 1
    return arr.tobytes(), lengths, len(lens) - lengths.size, total


def _meta(task: tuple) -> tuple:
    """What the main process needs to name a place: ("lines", file, offset, line_base) etc."""
    if task[0] == "txt":
        return ("lines", task[1], 0, 1)
    return task[:4] if task[0] == "lines" else task[:3]


def encode_task(task: tuple) -> dict:
    """Tokenize one task; returns per-key packed tokens and counters, or the first error."""
    keys = _W["keys"]
    kind = task[0]
    bad: list = []  # (index within task, reason)
    texts = {k: [] for k in keys}
    source: list = []  # index within the task of each kept document
    nbytes = 0
    if kind == "lines":
        _, _fi, _off, _lb, data = task
        nbytes = len(data)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            reason = None
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                reason = f"invalid UTF-8 (byte {err.start} of the line)"
            except ValueError as err:
                reason = f"malformed JSON: {getattr(err, 'msg', err)} (column {getattr(err, 'colno', '?')})"
            else:
                if not isinstance(obj, dict):
                    reason = f"expected a JSON object, got {type(obj).__name__}"
                else:
                    for k in keys:
                        if k not in obj:
                            reason = f"missing key {k!r}"
                            break
                        if not isinstance(obj[k], str):
                            reason = f"key {k!r} is {type(obj[k]).__name__}, expected a string"
                            break
                        if b"\\u" in raw:
                            reason = _surrogate_reason(k, obj[k])
                            if reason is not None:
                                break
            if reason is not None:
                bad.append((i, reason))
                if not _W["skip"]:
                    return {"error": bad[0], "task": _meta(task)}
                continue
            source.append(i)
            for k in keys:
                texts[k].append(obj[k])
    elif kind == "rows":
        _, _fi, _rb, cols = task
        n = len(cols[keys[0]])
        for i in range(n):
            reason = None
            for k in keys:
                if cols[k][i] is None:
                    reason = f"null value in column {k!r}"
                    break
            if reason is not None:
                bad.append((i, reason))
                if not _W["skip"]:
                    return {"error": bad[0], "task": _meta(task)}
                continue
            source.append(i)
            for k in keys:
                s = cols[k][i]
                texts[k].append(s)
                nbytes += len(s)
    elif kind == "txt":
        _, _fi, data = task
        nbytes = len(data)
        try:
            texts[keys[0]].append(data.decode("utf-8"))
            source.append(0)
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            bad.append((line - 1, f"invalid UTF-8 (byte {err.start} of the file)"))
            if not _W["skip"]:
                return {"error": bad[0], "task": _meta(task)}
    else:  # pragma: no cover
        raise ValueError(kind)

    out = {"bad": bad, "bytes": nbytes, "keys": {}}
    docs = 0
    for k in keys:
        enc = _encode_texts(texts[k]) if texts[k] else []
        failed = 0
        for i, ids in enumerate(enc):
            if isinstance(ids, Exception):
                # cannot be encoded (e.g. lone surrogates from a \ud800 escape)
                item = (source[i], f"key {k!r} cannot be tokenized: {ids}")
                if not _W["skip"]:
                    return {"error": item, "task": _meta(task)}
                bad.append(item)
                enc[i] = []
                failed += 1
        data, lengths, empty, tokens = _pack(enc)
        empty -= failed
        out["keys"][k] = (data, lengths, empty, tokens)
        docs = max(docs, len(enc))
    out["docs"] = docs
    return out


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
    prefixes = output_prefixes(args.output_prefix, keys, shard, num_shards)
    if not args.overwrite:
        for pre in prefixes.values():
            for ext in (".bin", ".idx"):
                if os.path.exists(pre + ext):
                    raise ValueError(f"{pre + ext} exists (pass --overwrite to replace it)")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
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
