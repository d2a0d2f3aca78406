"""``megatron-lol evaluate``: loss, perplexity and bits per byte of a checkpoint on held-out text.

Documents come from a Megatron indexed dataset (``--data-path PREFIX``, read with
megatron-core's ``IndexedDataset``; a trailing EOD token is dropped; ``--part`` picks
the train / valid / test documents of the run's ``data.split`` as training splits the
prefix, by default ``valid`` of a prefix the run trained on and all of any other) or a JSONL file
(``--jsonl FILE``, the ``--json-key`` string of each line, tokenized with the run's
tokenizer). Each document is scored as lm-evaluation-harness scores a rolling
log-likelihood: an EOD token stands before it (the end of a previous document, as in
packed training data) and every one of its tokens is predicted; a document longer than
``--seq-length`` is cut into consecutive pieces of that many predicted tokens, each
conditioned on the ``--seq-length`` tokens before its last prediction (and nothing
earlier): lm-evaluation-harness's rolling windows, so that its ``bits_per_byte`` of a
``loglikelihood_rolling`` task on the same texts is the one reported here.

The pieces run through the training forward: packed into rows of ``--seq-length``
tokens, each piece its own document of the row, on megatron-core's ``LoLGPTModel``
with the checkpoint's weights, in any TP x PP layout under torchrun (the rest of the
world data parallel): :mod:`.packed_eval`. :func:`score_rows` scores the same pieces one
row each with the plain-PyTorch model of the HuggingFace export (the reference the
tests compare with).

Reported overall and per document-length bucket (``--length-buckets``, in tokens):
documents, tokens, mean loss (nats per token), perplexity ``exp(loss)`` and bits per
byte ``sum(nll) / (ln 2 * UTF-8 bytes)`` (bytes of the document's text; for
``--data-path`` the text is the detokenized document), and the forward's tokens/s.
Progress goes to stderr: a bar on a terminal, a timed line in logs, and a closing
line with the throughput (``--no-progress``: none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from megatron_lol.data.datasets import split_range
from megatron_lol.errors import CliError
from megatron_lol.inference.loading import add_model_arguments, jsonl_texts, load_run, load_tokenizer
from megatron_lol.log import log_rank0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    # evaluate runs the training model: by default in the run's dtype, on the device policy's device
    parser.set_defaults(dtype=None, device=None)
    for action in parser._actions:
        if action.dest == "dtype":
            action.help = "weight dtype of the evaluated model (default: the run's model.precision.params_dtype)"
        elif action.dest == "device":
            action.help = "cpu or cuda: must be the device policy's (CUDA when present, else the CPU)"
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-path", help="Megatron indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    src.add_argument("--jsonl", help="JSONL file, one document per line")
    parser.add_argument("--json-key", default="text", help="--jsonl: the key holding the text (default text)")
    parser.add_argument(
        "--part",
        default=None,
        choices=("train", "valid", "test", "all"),
        help="documents of --data-path: this part of the run's data.split, as training splits the prefix "
        "(default: valid when --data-path is a prefix the run trained on, else all)",
    )
    parser.add_argument(
        "--seq-length", type=int, default=None, help="predicted tokens per row (default: the run's training.seq_length)"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="packed rows per forward (default: the run's training.micro_batch_size)",
    )
    parser.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks of the evaluation (torchrun; default 1)",
    )
    parser.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="pipeline stages of the evaluation (torchrun; default 1); the rest of the world is data parallel",
    )
    parser.add_argument("--max-documents", type=int, default=None, help="score only the first N documents")
    parser.add_argument(
        "--length-buckets",
        default="128,512,2048",
        help="comma-separated document-length edges in tokens (default 128,512,2048)",
    )
    from megatron_lol.config.loader import add_threads_argument

    add_threads_argument(parser)  # the trainer's thread policy: evaluate runs the same forward
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, timed lines in logs) and no closing line",
    )


@dataclass
class Totals:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    nll: float = 0.0

    def add(self, tokens: int, nbytes: int, nll: float) -> None:
        self.documents += 1
        self.tokens += tokens
        self.bytes += nbytes
        self.nll += nll

    def as_dict(self) -> dict:
        loss = self.nll / self.tokens if self.tokens else float("nan")
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "loss": loss,
            "perplexity": math.exp(loss) if self.tokens else float("nan"),
            "bits_per_byte": self.nll / (math.log(2) * self.bytes) if self.bytes else float("nan"),
        }


@dataclass
class Buckets:
    edges: list
    totals: list = field(default_factory=list)

    def __post_init__(self):
        self.totals = [Totals() for _ in range(len(self.edges) + 1)]

    def label(self, i: int) -> str:
        lo = self.edges[i - 1] if i else 0
        return f"< {self.edges[0]}" if i == 0 else (f">= {lo}" if i == len(self.edges) else f"{lo}-{self.edges[i] - 1}")

    def add(self, tokens: int, nbytes: int, nll: float) -> None:
        i = sum(tokens >= e for e in self.edges)
        self.totals[i].add(tokens, nbytes, nll)


def parse_buckets(text: str) -> list:
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--length-buckets: {text!r} is not a comma-separated list of integers") from None
    if not edges or edges != sorted(set(edges)) or edges[0] < 1:
        raise CliError(f"--length-buckets: edges must be increasing positive integers (got {text!r})")
    return edges


# ------------------------------------------------------------------ documents
def jsonl_documents(path: str, key: str, tokenizer, limit):
    """``(tokens, utf-8 bytes)`` of each line's ``key`` text."""
    count = 0
    for _, text in jsonl_texts("--jsonl", path, (key,), key_flag="--json-key"):
        if limit is not None and count >= limit:
            return
        tokens = tokenizer.tokenize(text)
        if tokens:
            count += 1
            yield tokens, len(text.encode("utf-8"))


def data_part(args, cfg) -> str:
    """``--part``, or its default: ``valid`` when ``--data-path`` is one of the prefixes the run trained
    on (its training documents are not held out), ``all`` for any other prefix."""
    if args.part is not None:
        return args.part
    from megatron_lol.data.datasets import parse_blend

    try:
        trained = parse_blend(cfg.data.paths)[0]
    except CliError:
        trained = []
    same = any(os.path.realpath(args.data_path) == os.path.realpath(p) for p in trained)
    return "valid" if same else "all"


def indexed_documents(prefix: str, tokenizer, eod_id, limit, part: str = "all", split: str = "98,2,0"):
    """``(tokens, utf-8 bytes of the detokenized text)`` of each document of an indexed dataset whose
    first sequence lies in ``part`` of ``split``: megatron-core's split of the prefix into train / valid /
    test, the bounds times the sequence count, rounded (``analyze --part`` reads the same ranges)."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise CliError(f"--data-path {prefix}: {prefix}{ext} does not exist")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(prefix, mmap=True)
    except (ValueError, AssertionError, OSError) as err:
        raise CliError(f"--data-path {prefix}: not a readable Megatron indexed dataset ({err})") from None
    docs = ds.document_indices
    lo, hi = (0, len(ds)) if part == "all" else split_range(split, part, len(ds))
    if hi <= lo:
        raise CliError(
            f"--data-path {prefix}: the {part} part of split {split!r} holds none of its {len(ds)} "
            f"sequences; choose another --part"
        )
    count = 0
    for d in range(len(docs) - 1):
        if limit is not None and count >= limit:
            return
        if not lo <= int(docs[d]) < hi:
            continue
        parts = [ds[i] for i in range(int(docs[d]), int(docs[d + 1]))]
        tokens = [int(t) for part in parts for t in part.tolist()]
        if tokens and tokens[-1] == eod_id:
            tokens = tokens[:-1]
        if tokens:
            count += 1
            yield tokens, len(tokenizer.detokenize(tokens).encode("utf-8"))


def pieces(doc_index: int, tokens: list, eod_id: int, seq_length: int):
    """Rows ``(doc, inputs, targets)`` scoring every token of a document after an EOD: the targets
    are the next tokens of the last ``len(targets)`` inputs (lm-evaluation-harness's rolling
    windows: the last, shorter piece reads a full ``seq_length`` of context)."""
    ids = [eod_id] + tokens
    for start in range(0, len(tokens), seq_length):
        end = min(start + seq_length, len(tokens))  # predicts tokens[start:end] = ids[start + 1:end + 1]
        yield doc_index, ids[max(0, end - seq_length) : end], ids[start + 1 : end + 1]


# ------------------------------------------------------------------ scoring
def score_rows(model, rows: list, pad: int) -> list:
    """Summed negative log-likelihood (nats, fp32) of each row's targets."""
    width = max(len(r[1]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (_, inputs, _) in enumerate(rows):
        ids[i, : len(inputs)] = torch.tensor(inputs)
        mask[i, : len(inputs)] = 1
    device = model.device
    with torch.no_grad():
        hidden, _ = model.model(ids.to(device), attention_mask=mask.to(device))
        out = []
        for i, (_, inputs, targets) in enumerate(rows):
            scored = hidden[i, len(inputs) - len(targets) : len(inputs)]
            logits = model.lm_head(scored).float()  # one row at a time: [n, vocab]
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=device), reduction="sum")
            out.append(float(nll))
    return out


def run(args: argparse.Namespace) -> int:
    edges = parse_buckets(args.length_buckets)
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise CliError(f"--micro-batch-size: must be at least 1 (got {args.micro_batch_size})")
    if args.max_documents is not None and args.max_documents < 1:
        raise CliError(f"--max-documents: must be at least 1 (got {args.max_documents})")
    loaded = load_run(args.load, args.iteration, config=args.config, loop_budget=args.loop_budget)
    tokenizer = load_tokenizer(loaded, args.tokenizer, args.tokenizer_type)
    seq_length = args.seq_length or loaded.seq_length
    if seq_length < 1:
        raise CliError(f"--seq-length: must be at least 1 (got {seq_length})")
    eod = loaded.eod_id
    if args.jsonl is not None:
        docs = list(jsonl_documents(args.jsonl, args.json_key, tokenizer, args.max_documents))
        source = args.jsonl
    else:
        part = data_part(args, loaded.cfg)
        docs = list(indexed_documents(args.data_path, tokenizer, eod, args.max_documents, part, loaded.cfg.data.split))
        source = args.data_path if part == "all" else f"{args.data_path} ({part} part of split {loaded.cfg.data.split})"
    if not docs:
        raise CliError(f"{source}: no document to evaluate")
    pieces_ = [row for i, (tokens, _) in enumerate(docs) for row in pieces(i, tokens, eod, seq_length)]
    nll, seconds = score_with_training_forward(loaded, args, pieces_, len(docs), seq_length)
    if torch.distributed.get_rank() != 0:
        return 0
    overall, buckets = Totals(), Buckets(edges)
    for (tokens, nbytes), value in zip(docs, nll.tolist()):
        overall.add(len(tokens), nbytes, value)
        buckets.add(len(tokens), nbytes, value)
    result = {
        "source": source,
        "checkpoint": loaded.path,
        "iteration": loaded.iteration,
        "plan": loaded.cfg.model.plan.kind,
        "loop_budget": loaded.loop_budget,
        "seq_length": seq_length,
        "overall": overall.as_dict(),
        "buckets": [dict(bucket=buckets.label(i), **t.as_dict()) for i, t in enumerate(buckets.totals) if t.documents],
        "tokens_per_s": overall.tokens / seconds if seconds > 0 else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        log_rank0(format_table(result))
    return 0


def _layout(args) -> tuple[int, int]:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag, n in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        if n < 1:
            raise CliError(f"{flag}: must be at least 1 (got {n})")
    return tp, pp


def score_with_training_forward(loaded, args, pieces_: list, num_docs: int, seq_length: int) -> tuple:
    """``(nll per document, seconds of forward)``: the pieces packed into rows of ``seq_length`` tokens
    through ``LoLGPTModel`` in this process's rank of the ``--tensor/--pipeline-model-parallel-size``
    layout (:mod:`.packed_eval`)."""
    from megatron_lol.inference.packed_eval import PackedScorer, build_model
    from megatron_lol.platform import cuda_available, init_distributed, setup_platform

    tp, pp = _layout(args)
    have = "cuda" if cuda_available() else "cpu"
    if args.device is not None and args.device.split(":")[0] != have:
        raise CliError(
            f"--device {args.device}: evaluate runs on the device policy's device ({have}"
            + (": hide the GPUs with CUDA_VISIBLE_DEVICES= to run on the CPU)" if have == "cuda" else ")")
        )
    cfg = loaded.cfg
    if args.dtype is not None:
        cfg.model.precision.params_dtype = args.dtype
    from megatron_lol.training.runtime import apply_threads

    apply_threads(args.threads)
    setup_platform()
    init_distributed()
    vocab = cfg.model.vocab_size
    chunks = build_model(cfg, vocab, loaded.eod_id, loaded.path, tp, pp)
    mbs = args.micro_batch_size or loaded.cfg.training.micro_batch_size
    scorer = PackedScorer(chunks, mbs, seq_length, loaded.eod_id, budget=loaded.loop_budget)
    total = sum(len(p[2]) for p in pieces_)
    report = None if args.no_progress else TokenProgress(total, "evaluate")
    nll, seconds = scorer.score(pieces_, num_docs, progress=report.update if report else None)
    if report is not None:
        report.close(seconds)
    return nll, seconds


class TokenProgress:
    """Scored tokens on stderr (global rank 0): a tqdm bar on a terminal; elsewhere (logs, pipes) a line
    every ``MEGATRON_LOL_PROGRESS_INTERVAL`` seconds (default 30) and a closing line with the throughput."""

    def __init__(self, total: int, desc: str):
        from megatron_lol.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV, isatty

        self.total, self.desc, self.done = total, desc, 0
        self.rank0 = os.environ.get("RANK", "0") == "0"
        self.bar = None
        self.start = self.last = time.monotonic()
        try:
            self.interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        except ValueError:
            self.interval = DEFAULT_INTERVAL_S
        if self.rank0 and isatty(sys.stderr):
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, tokens: int) -> None:
        self.done += tokens
        if self.bar is not None:
            self.bar.update(tokens)
            return
        now = time.monotonic()
        if self.rank0 and now - self.last >= self.interval and self.done < self.total:
            print(
                f"{self.desc}: {self.done:,} of {self.total:,} tokens ({100 * self.done / self.total:.0f}%), "
                f"{now - self.start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            self.last = now

    def close(self, forward_seconds: float) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.rank0:
            rate = f", {self.done / forward_seconds:,.0f} tokens/s in the forward" if forward_seconds > 0 else ""
            print(
                f"{self.desc}: {self.done:,} tokens scored in {time.monotonic() - self.start:.1f} s{rate}",
                file=sys.stderr,
                flush=True,
            )


def format_table(result: dict) -> str:
    head = (
        f"{result['source']}: checkpoint {result['checkpoint']} (plan {result['plan']}"
        + (f", loop budget {result['loop_budget']}" if result["loop_budget"] is not None else "")
        + f"), {result['seq_length']} tokens per row"
    )
    lines = [head, f"{'documents (tokens)':<20} {'docs':>6} {'tokens':>9} {'loss':>8} {'ppl':>10} {'bpb':>7}"]
    for name, t in [("all", result["overall"])] + [(b["bucket"], b) for b in result["buckets"]]:
        lines.append(
            f"{name:<20} {t['documents']:>6} {t['tokens']:>9} {t['loss']:>8.4f} {t['perplexity']:>10.3f} "
            f"{t['bits_per_byte']:>7.4f}"
        )
    return "\n".join(lines)
