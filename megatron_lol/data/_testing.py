"""Real text and real tokenizer files built locally, for tests and benchmarks.

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
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
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
    tok.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(out_dir)
    tok.save(paths["tokenizer_json"] + ".tmp")
    os.replace(paths["tokenizer_json"] + ".tmp", paths["tokenizer_json"])
    return paths


def _bytelevel_decoder() -> dict:
    # GPT-2's reversible byte <-> printable-unicode map
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
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
        json.dump([{"rank": r, "token_bytes": base64.b64encode(t).decode(),
                    "token_str": t.decode("utf-8", errors="replace")} for r, t in enumerate(tokens)], f)
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
