"""Real text and real tokenizer files built locally, for the tests.

No network: the text is what every machine running this project has -- the
Python standard library's source files (English docstrings and comments, code)
and its LICENSE -- and the tokenizers are trained on it here:

* a SentencePiece BPE model (``sentencepiece`` trainer, eos_id 2);
* a byte-level BPE ``tokenizer.json`` (HF ``tokenizers`` trainer), whose
  ``vocab.json`` + ``merges.txt`` also serve as GPT-2 BPE files;
* a tiktoken vocabulary derived from that BPE's merges, written both as a
  ``.tiktoken`` file (base64 token, rank) and as Megatron's JSON list.

Everything is cached under a directory, keyed by the build parameters.
"""

from __future__ import annotations

import base64
import glob
import json
import os
from pathlib import Path


def stdlib_documents(max_bytes: int = 3_000_000, max_doc: int = 60_000) -> list:
    """Real text: stdlib .py files (one document each, truncated) plus LICENSE.txt."""
    libdir = os.path.dirname(os.__file__)
    files = [os.path.join(libdir, "LICENSE.txt")] + sorted(glob.glob(os.path.join(libdir, "*.py")))
    files += sorted(glob.glob(os.path.join(libdir, "*", "*.py")))
    docs, total = [], 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read(max_doc)
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def train_sentencepiece(docs: list, model_prefix: str, vocab_size: int = 2000) -> str:
    import sentencepiece as spm

    model = model_prefix + ".model"
    if os.path.exists(model):
        return model
    tmp = model_prefix + ".tmp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(d for doc in docs for d in doc.splitlines() if d.strip()),
        model_prefix=tmp,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
        max_sentence_length=1 << 16,
    )
    os.replace(tmp + ".model", model)
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
    return model


def train_bytelevel_bpe(docs: list, out_dir: str, vocab_size: int = 2000) -> dict:
    """Byte-level BPE: tokenizer.json, vocab.json, merges.txt in out_dir."""
    from tokenizers import ByteLevelBPETokenizer

    paths = {
        "tokenizer_json": os.path.join(out_dir, "tokenizer.json"),
        "vocab": os.path.join(out_dir, "vocab.json"),
        "merges": os.path.join(out_dir, "merges.txt"),
    }
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(out_dir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        docs, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save_model(out_dir)
    tok.save(paths["tokenizer_json"] + ".tmp")
    os.replace(paths["tokenizer_json"] + ".tmp", paths["tokenizer_json"])
    return paths


def _bytelevel_decoder() -> dict:
    # GPT-2's reversible byte <-> printable-unicode map
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def write_tiktoken_files(merges_file: str, out_prefix: str) -> dict:
    """tiktoken ranks = 256 single bytes, then each BPE merge in order."""
    paths = {"tiktoken": out_prefix + ".tiktoken", "json": out_prefix + ".json"}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    dec = _bytelevel_decoder()
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    with open(merges_file, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#version") or not line.strip():
                continue
            a, b = line.rstrip("\n").split(" ")
            tok = bytes(dec[c] for c in a) + bytes(dec[c] for c in b)
            if tok not in seen:
                seen.add(tok)
                tokens.append(tok)
    with open(paths["tiktoken"], "w") as f:
        for rank, tok in enumerate(tokens):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    with open(paths["json"], "w") as f:
        json.dump(
            [
                {
                    "rank": r,
                    "token_bytes": base64.b64encode(t).decode(),
                    "token_str": t.decode("utf-8", errors="replace"),
                }
                for r, t in enumerate(tokens)
            ],
            f,
        )
    return paths


def build_all(cache_dir: str, docs: list | None = None) -> dict:
    """Train/derive every test tokenizer under cache_dir; returns their paths."""
    os.makedirs(cache_dir, exist_ok=True)
    if docs is None:
        docs = stdlib_documents(1_500_000)
    out = {"sentencepiece": train_sentencepiece(docs, os.path.join(cache_dir, "sp_bpe_2000"))}
    bpe = train_bytelevel_bpe(docs, os.path.join(cache_dir, "bytelevel_bpe"))
    out.update(bpe)
    out.update(write_tiktoken_files(bpe["merges"], os.path.join(cache_dir, "tiktoken_bpe")))
    return out


# -- helpers for tests and benchmarks -------------------------------------------------

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt")


def special_documents() -> list:
    """Edge cases every format must carry: empty, whitespace-only, non-ASCII, literal specials."""
    return [
        "",
        "   \n  ",
        "naïve café — Grüße, ¿qué? 日本語のテキスト 😀 ∑∫",
        "literal specials: </s> <s> <unk> <|endoftext|> <pad> end",
        "line one\r\nline two\ttabbed\u2028sep",
    ]


def sample_documents(n: int = 40, max_doc: int = 4000) -> list:
    docs = stdlib_documents(max_bytes=n * max_doc, max_doc=max_doc)[:n]
    out = docs[:10] + special_documents() + docs[10:]
    return out


def write_inputs(docs: list, fmt: str, out_dir: str, files: int = 1, key: str = "text", row_group_size: int = 7) -> str:
    """Write docs in ``fmt`` under out_dir; returns the --input value (file or directory)."""
    import json as _json

    os.makedirs(out_dir, exist_ok=True)
    if fmt == "txt":
        for i, d in enumerate(docs):
            with open(os.path.join(out_dir, f"doc{i:05d}.txt"), "w", encoding="utf-8", newline="") as f:
                f.write(d)
        return out_dir
    per = -(-len(docs) // files)
    chunks = [docs[i : i + per] for i in range(0, len(docs), per)]
    paths = []
    for j, chunk in enumerate(chunks):
        path = os.path.join(out_dir, f"part{j:03d}.{fmt}")
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({key: chunk, "id": list(range(len(chunk)))})
            pq.write_table(table, path, row_group_size=row_group_size)
        else:
            payload = "".join(_json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(chunk)).encode()
            if fmt == "jsonl.gz":
                import gzip

                payload = gzip.compress(payload)
            elif fmt == "jsonl.zst":
                import zstandard

                payload = zstandard.ZstdCompressor().compress(payload)
            with open(path, "wb") as f:
                f.write(payload)
        paths.append(path)
    return paths[0] if len(paths) == 1 else out_dir


def preprocess_args(argv: list):
    import argparse

    from megatron_lol.data import preprocess as pp

    parser = argparse.ArgumentParser()
    pp.add_arguments(parser)
    return parser.parse_args(argv)


def run_preprocess(argv: list) -> dict:
    from megatron_lol.data import preprocess as pp

    return pp.preprocess(preprocess_args(list(argv) + ["--no-progress"]))


def tokenizer_argv(kind: str, files: dict) -> list:
    if kind == "sentencepiece":
        return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", files["sentencepiece"]]
    if kind == "huggingface":
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", files["tokenizer_json"]]
    if kind == "tiktoken":
        return ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", files["tiktoken"]]
    if kind == "gpt2bpe":
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"], "--merge-file", files["merges"]]
    raise KeyError(kind)


def tokenizer_kwargs(kind: str, files: dict) -> dict:
    argv = tokenizer_argv(kind, files)
    names = {
        "--tokenizer-type": "tokenizer_type",
        "--tokenizer-model": "tokenizer_model",
        "--vocab-file": "vocab_file",
        "--merge-file": "merge_file",
    }
    return {names[a]: v for a, v in zip(argv[0::2], argv[1::2])}


def indexed_corpus(out_dir: str, max_bytes: int, max_doc: int, vocab_size: int) -> tuple:
    """A real training corpus for CLI tests: stdlib documents, a SentencePiece model trained on
    them, and a Megatron indexed dataset of their tokens (+ EOD). Returns ``(prefix, model)``;
    an existing dataset under ``out_dir`` is reused."""
    import numpy as np
    import sentencepiece as spm

    from megatron_lol.data.indexed import StreamingIndexWriter

    os.makedirs(out_dir, exist_ok=True)
    docs = stdlib_documents(max_bytes=max_bytes, max_doc=max_doc)
    model = train_sentencepiece(docs, os.path.join(out_dir, "sp"), vocab_size=vocab_size)
    prefix = os.path.join(out_dir, "corpus_text_document")
    if not os.path.exists(prefix + ".idx"):
        sp = spm.SentencePieceProcessor(model_file=model)
        writer = StreamingIndexWriter(prefix, np.uint16)
        for d in docs:
            writer.add_document(sp.encode(d) + [sp.eos_id()])
        writer.finalize()
    return prefix, model


WORDS = ["<|endoftext|>", "[UNK]", "the", "cat", "sat", "on", "a", "mat"]


def write_tiny_tokenizer(directory) -> Path:
    """A HuggingFace tokenizer.json of eight words, EOD ``<|endoftext|>`` = 0 (built in memory, no
    training: for checks of a config, not of tokenization)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def write_tiny_dataset(prefix, documents: int = 40) -> str:
    """An indexed dataset of ``documents`` random documents over WORDS' ids, each ending in EOD 0."""
    import numpy as np

    from megatron_lol.data.indexed import StreamingIndexWriter

    writer = StreamingIndexWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        writer.add_document(list(rng.integers(2, len(WORDS), size=int(rng.integers(5, 30)))) + [0])
    writer.finalize()
    return str(prefix)


def hub_cache(root: Path, name: str, tokenizer_json: str, files: dict | None = None) -> Path:
    """A HuggingFace Hub cache under ``root`` (what ``HF_HUB_CACHE`` points at) holding repository ``name``
    at one snapshot with ``tokenizer.json`` copied from ``tokenizer_json`` and the text ``files`` given
    (``{"tokenizer_config.json": "..."}``); returns the snapshot directory. Stands in for the Hub, which
    the test machines cannot reach."""
    commit = "0" * 40
    repo = Path(root) / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    for file, text in (files or {}).items():
        (snapshot / file).write_text(text)
    return snapshot


FINEWEB_COLUMNS = ("text", "id", "dump", "url", "date", "file_path", "language", "language_score", "token_count")


def write_fineweb_parquet(docs: list, root, files: int = 2, row_group_size: int = 16) -> list:
    """``docs`` as FineWeb's ``sample-10BT`` parquet shards under ``root``: ``sample/10BT/000_00000.parquet``,
    ``001_00000.parquet``, ... (documents dealt in order, ``files`` files), FineWeb's columns and types
    (``text`` plus id, dump, url, date, file_path, language, language_score, token_count), several row
    groups per file so that an array's shards split inside a file. Returns the files, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(root) / "sample" / "10BT"
    out_dir.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    paths = []
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        n = len(part)
        dump = "CC-MAIN-2024-10"
        table = pa.table(
            {
                "text": pa.array(part, pa.string()),
                "id": pa.array([f"<urn:uuid:{f:04d}{i:08d}-0000-0000-0000-000000000000>" for i in range(n)]),
                "dump": pa.array([dump] * n),
                "url": pa.array([f"https://example.org/{f}/{i}" for i in range(n)]),
                "date": pa.array(["2024-02-20T12:00:00Z"] * n),
                "file_path": pa.array(
                    [f"s3://commoncrawl/crawl-data/{dump}/segments/{f}/warc/{i}.warc.gz" for i in range(n)]
                ),
                "language": pa.array(["en"] * n),
                "language_score": pa.array([0.9] * n, pa.float64()),
                "token_count": pa.array([len(t.split()) for t in part], pa.int64()),
            }
        )
        path = out_dir / f"{f:03d}_00000.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
    return paths
