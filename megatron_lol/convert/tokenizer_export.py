"""Tokenizer files for an exported HuggingFace directory (``AutoTokenizer`` loads them).

* SentencePiece models (the training default) become a ``tokenizer.json`` for the
  ``tokenizers`` library, built here from the ``.model`` file: the file is a
  protobuf ``ModelProto`` read with a few lines of wire-format parsing (no
  ``protobuf`` dependency). Unigram models keep their scores; BPE models get
  merges ordered by the score of the merged piece, which is how SentencePiece's
  BPE applies them. The normaliser (precompiled character map, whitespace
  clean-up), the dummy-prefix ``▁`` and byte fallback follow the model's own
  settings. No BOS is added: ids equal the ones ``megatron-lol preprocess``
  wrote (``encode_as_ids``). The result is checked against SentencePiece on
  sample text at export time. ``tokenizer.model`` is copied too.
* ``HuggingFaceTokenizer`` runs copy their ``tokenizer.json``.
* ``GPT2BPETokenizer`` (vocab.json + merges.txt) becomes a byte-level BPE ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from typing import Optional

from megatron_lol.errors import CliError

SAMPLE_TEXTS = [
    "Hello world! This is a test of the tokenizer.",
    "  Leading spaces, trailing spaces   and  double  spaces.  ",
    "Numbers 1234567890, punctuation: ;:!?()[]{}<>, and symbols @#$%^&*.",
    "Ünïcödé, accents: café, naïve, Straße; CJK: 日本語のテキスト; emoji: 🙂.",
    "Line one\nLine two\ttabbed\n\nEnd.",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
]


# ------------------------------------------------------------ protobuf wire format
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(buf: bytes):
    """Yield ``(field_number, wire_type, value)`` of one protobuf message."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = buf[i : i + length], i + length
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def read_sentencepiece_model(path: str) -> dict:
    """Pieces ``(piece, score, type)``, trainer and normaliser settings of a SentencePiece ``.model``."""
    with open(path, "rb") as f:
        data = f.read()
    model = {
        "pieces": [],
        "model_type": 1,
        "byte_fallback": False,
        "split_by_whitespace": True,
        "treat_whitespace_as_suffix": False,
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": -1,
        "precompiled_charsmap": b"",
        "add_dummy_prefix": True,
        "remove_extra_whitespaces": True,
        "escape_whitespaces": True,
    }
    for number, _, value in _fields(data):
        if number == 1:  # SentencePiece
            piece, score, kind = "", 0.0, 1
            for n, _, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            model["pieces"].append((piece, score, kind))
        elif number == 2:  # TrainerSpec
            names = {
                3: "model_type",
                35: "byte_fallback",
                22: "split_by_whitespace",
                24: "treat_whitespace_as_suffix",
                40: "unk_id",
                41: "bos_id",
                42: "eos_id",
                43: "pad_id",
            }
            for n, w, v in _fields(value):
                if n in names and w == 0:
                    if n >= 40:  # int32 ids: -1 is encoded as a 64-bit two's complement varint
                        v = v - (1 << 64) if v >= (1 << 63) else v
                    model[names[n]] = v if n in (3,) or n >= 40 else bool(v)
        elif number == 3:  # NormalizerSpec
            for n, w, v in _fields(value):
                if n == 2:
                    model["precompiled_charsmap"] = bytes(v)
                elif n in (3, 4, 5) and w == 0:
                    model[{3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}[n]] = bool(v)
    return model


NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_to_tokenizers(path: str):
    """A ``tokenizers.Tokenizer`` that encodes like SentencePiece's ``encode_as_ids``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram

    spm = read_sentencepiece_model(path)
    pieces = spm["pieces"]
    if not pieces:
        raise CliError(f"{path}: no pieces in the SentencePiece model (not a .model file?)")
    if spm["treat_whitespace_as_suffix"]:
        raise CliError(f"{path}: treat_whitespace_as_suffix SentencePiece models are not supported")
    unk_id = spm["unk_id"]
    if spm["model_type"] == 1:  # UNIGRAM
        model = Unigram([(p, s) for p, s, _ in pieces], unk_id=unk_id, byte_fallback=spm["byte_fallback"])
    elif spm["model_type"] == 2:  # BPE
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        mergeable = {p for p, _, t in pieces if t == NORMAL}
        ranked = []
        for i, (p, score, kind) in enumerate(pieces):
            if kind != NORMAL or len(p) < 2:
                continue
            for cut in range(1, len(p)):
                left, right = p[:cut], p[cut:]
                if left in mergeable and right in mergeable:
                    ranked.append((-score, i, vocab[left], vocab[right], left, right))
        ranked.sort()
        merges = [(left, right) for *_, left, right in ranked]
        model = BPE(
            vocab=vocab, merges=merges, unk_token=pieces[unk_id][0], fuse_unk=True, byte_fallback=spm["byte_fallback"]
        )
    else:
        raise CliError(f"{path}: SentencePiece model type {spm['model_type']} (word/char) is not supported")
    tok = Tokenizer(model)
    norm = []
    if spm["precompiled_charsmap"]:
        norm.append(normalizers.Precompiled(spm["precompiled_charsmap"]))
    if spm["remove_extra_whitespaces"]:
        norm += [
            normalizers.Replace(Regex(r"\A +"), ""),
            normalizers.Replace(Regex(r" +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if norm:
        tok.normalizer = normalizers.Sequence(norm)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁",
        prepend_scheme="always" if spm["add_dummy_prefix"] else "never",
        split=spm["split_by_whitespace"],
    )
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if spm["add_dummy_prefix"]:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    special = [AddedToken(p, special=True, normalized=False) for p, _, t in pieces if t in (CONTROL, UNKNOWN)]
    user = [AddedToken(p, special=False, normalized=False) for p, _, t in pieces if t == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def piece(i):
        return pieces[i][0] if 0 <= i < len(pieces) else None

    specials = {
        "bos_token": piece(spm["bos_id"]),
        "eos_token": piece(spm["eos_id"]),
        "unk_token": piece(unk_id),
        "pad_token": piece(spm["pad_id"]),
    }
    return tok, specials


def _check_against_sentencepiece(tok, model_file: str, texts) -> Optional[str]:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    for text in texts:
        want = sp.encode_as_ids(text)
        got = tok.encode(text, add_special_tokens=False).ids
        if want != got:
            return f"{text[:40]!r}: SentencePiece {want[:12]} vs tokenizer.json {got[:12]}"
    return None


def _write_tokenizer_config(out_dir: str, specials: dict, max_length: Optional[int]) -> None:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    cfg.update({k: v for k, v in specials.items() if v is not None})
    if max_length:
        cfg["model_max_length"] = max_length
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({k: v for k, v in specials.items() if v is not None}, f, indent=2, ensure_ascii=False)
        f.write("\n")


def export_tokenizer(
    tokenizer_type: str,
    model_file: Optional[str],
    out_dir: str,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    max_length: Optional[int] = None,
    check_texts=None,
) -> dict:
    """Write tokenizer files into ``out_dir``; returns ``{"eod_id", "bos_id", "pad_id", "files"}``."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        if not model_file or not os.path.isfile(model_file):
            raise CliError(f"SentencePiece model {model_file} not found (pass --tokenizer PATH)")
        tok, specials = sentencepiece_to_tokenizers(model_file)
        problem = _check_against_sentencepiece(tok, model_file, list(check_texts or []) + SAMPLE_TEXTS)
        if problem:
            warnings.warn(
                f"exported tokenizer.json does not reproduce SentencePiece exactly on {problem}; "
                "tokenizer.model is included for SentencePiece-based loading",
                stacklevel=2,
            )
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
        _write_tokenizer_config(out_dir, specials, max_length)
        files = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"]
    elif tokenizer_type == "HuggingFaceTokenizer":
        src = model_file
        if src and os.path.isdir(src):
            src = os.path.join(src, "tokenizer.json")
        if not src or not os.path.isfile(src):
            raise CliError(f"HuggingFace tokenizer.json {model_file} not found (pass --tokenizer PATH)")
        from megatron_lol.data.tokenizers import build_tokenizer

        base = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model_file)
        shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(src)
        eos = t.id_to_token(base.eod)
        _write_tokenizer_config(out_dir, {"eos_token": eos}, max_length)
        files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        specials = {"eos_token": eos}
        tok = t
    elif tokenizer_type == "GPT2BPETokenizer":
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        if not (vocab_file and merge_file and os.path.isfile(vocab_file) and os.path.isfile(merge_file)):
            raise CliError("GPT2BPETokenizer export needs data.vocab_file and data.merge_file")
        tok = Tokenizer(BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        specials = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        _write_tokenizer_config(out_dir, specials, max_length)
        files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    else:
        raise CliError(
            f"tokenizer type {tokenizer_type} cannot be exported yet; pass --no-tokenizer "
            "and add tokenizer files yourself"
        )

    def tid(name):
        value = specials.get(name)
        return tok.token_to_id(value) if value is not None else None

    return {"eod_id": tid("eos_token"), "bos_id": tid("bos_token"), "pad_id": tid("pad_token"), "files": files}
