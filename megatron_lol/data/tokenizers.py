"""Tokenizers for preprocessing and training, with Megatron-LM's id conventions.

``build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)``
returns an object with ``tokenize(text) -> list[int]``, ``detokenize(ids)``,
``vocab_size``, ``eod`` and ``unique_identifiers`` -- what megatron-core's
``GPTDatasetConfig`` / ``GPTDataset`` read from a tokenizer -- plus
``encode_batch(texts)``, the fast path the preprocessing workers use.

The ids are the ones Megatron-LM's ``tools/preprocess_data.py`` writes for the
same tokenizer type and file (it builds its tokenizer with
``megatron.core.tokenizers.utils.build_tokenizer``):

* ``SentencePieceTokenizer`` (also ``GPTSentencePieceTokenizer``,
  ``Llama2Tokenizer``): ``encode_as_ids(text)``; EOD is the model's ``eos_id``;
  ``vocab_size`` is the piece count.
* ``HuggingFaceTokenizer``: a ``tokenizer.json`` (or a directory holding one),
  or a HuggingFace Hub name (``EleutherAI/gpt-neox-20b``) that is not a local
  path: its ``tokenizer.json`` and ``tokenizer_config.json`` are read from the
  local Hub cache, downloaded into it when missing (``huggingface_hub``;
  ``HF_HUB_OFFLINE=1`` keeps it to the cache);
  ``encode(text)`` with the file's post-processor (as ``AutoTokenizer(text)``
  does); EOD is the ``eos_token`` of ``tokenizer_config.json`` when there is
  one, else the first of ``<|endoftext|>``, ``</s>``, ``<eos>``,
  ``<|end_of_text|>`` present; ``vocab_size`` counts added tokens.
* ``TikTokenizer``: Megatron's convention -- ``num_special_tokens`` (1000)
  reserved ids first (``<unk> <s> </s> <mask> <pad> <cls> <sep>``, then
  ``<SPECIAL_i>`` fillers), BPE ranks shifted by that amount, EOD = ``</s>``
  = 2, pattern ``v2`` by default. The file is either Megatron's JSON list
  (``rank``/``token_bytes``/``token_str``) or a ``.tiktoken`` file (base64
  token and rank per line); both give the same ids for the same vocabulary.
* ``GPT2BPETokenizer``: ``vocab.json`` + ``merges.txt`` byte-level BPE;
  EOD is ``<|endoftext|>``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections import OrderedDict

from megatron_lol.errors import CliError

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "GPT2BPETokenizer",
)

# Megatron's tiktoken conventions (megatron.core.tokenizers ... tiktoken_tokenizer).
TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
TIKTOKEN_FILLER = "<SPECIAL_{}>"
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
TIKTOKEN_DEFAULT_VOCAB = 2**17

HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class TokenizerError(CliError, ValueError):
    """A tokenizer file or option is unusable (message names the file): one line and exit status 2
    from the CLI, wherever it is raised (a trainer built from a config, ``preprocess``, ``evaluate``)."""


# a Hub repository id, ``namespace/name`` (huggingface_hub's own check is stricter; this one only tells
# a Hub name from a local path that does not exist)
HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_name(value: str | None) -> bool:
    """Whether a ``tokenizer_model`` names a HuggingFace Hub repository rather than a local path: it has
    the form ``namespace/name`` and no such file or directory exists here."""
    return bool(value) and HUB_NAME.match(value) is not None and not os.path.exists(value)


def hub_tokenizer_file(name: str) -> str:
    """``tokenizer.json`` of Hub repository ``name`` in the local Hub cache (downloaded when missing), with
    its ``tokenizer_config.json`` beside it when the repository has one (the end-of-document token)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise TokenizerError(
            f"HuggingFace tokenizer {name}: not a local file or directory, and reading a Hub "
            f"name needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        file = hf_hub_download(name, "tokenizer.json")
    except Exception as err:  # noqa: BLE001 - network, cache and repository errors alike
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TokenizerError(
            f"HuggingFace tokenizer {name}: not a local file or directory, and the Hub could not "
            f"provide its tokenizer.json ({first}); download it where the Hub is reachable "
            f"(hf download {name} tokenizer.json tokenizer_config.json) or "
            f"name a local tokenizer.json directory"
        ) from None
    try:
        hf_hub_download(name, "tokenizer_config.json")
    except Exception:  # noqa: BLE001 - optional: the EOD token then comes from HF_EOD_CANDIDATES
        pass
    return file


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


class _BaseTokenizer:
    tokenizer_type = ""
    files: tuple = ()

    # GPTDataset / MegatronDataset read these ---------------------------------
    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["tokenizer_type"] = self.tokenizer_type
        for path in self.files:
            ids[os.path.basename(path)] = _file_digest(path)
        ids["vocab_size"] = self.vocab_size
        ids["eod"] = self.eod
        return ids

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def eos_id(self) -> int:
        return self.eod

    def encode_batch(self, texts: list) -> list:
        return [self.tokenize(t) for t in texts]

    def __getstate__(self):
        # Worker processes rebuild the native tokenizer from the files.
        return {"_spec": self._spec}

    def __setstate__(self, state):
        fresh = build_tokenizer(**state["_spec"])
        self.__dict__.update(fresh.__dict__)


class SentencePieceTokenizer(_BaseTokenizer):
    def __init__(self, model_file: str, tokenizer_type: str = "SentencePieceTokenizer"):
        import sentencepiece

        if not model_file or not os.path.isfile(model_file):
            raise TokenizerError(f"SentencePiece model not found: {model_file}")
        self.tokenizer_type = tokenizer_type
        self.files = (model_file,)
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except Exception as err:  # noqa: BLE001 - sentencepiece raises bare errors
            raise TokenizerError(f"cannot load SentencePiece model {model_file}: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(
                f"SentencePiece model {model_file} has no eos id (trained with eos_id=-1); "
                "Megatron uses eos_id as the end-of-document token"
            )
        pad = self.sp.pad_id()
        self._pad = pad if pad >= 0 else None
        self.bos = self.sp.bos_id()

    @property
    def pad(self) -> int:
        if self._pad is None:
            raise AttributeError("pad")
        return self._pad

    def tokenize(self, text: str) -> list:
        return self.sp.encode_as_ids(text)

    def encode_batch(self, texts: list) -> list:
        return self.sp.encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.sp.decode_ids(list(ids))


class HuggingFaceTokenizer(_BaseTokenizer):
    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str, include_special_tokens: bool = True, eod_token: str | None = None):
        from tokenizers import Tokenizer

        if is_hub_name(path):
            path = hub_tokenizer_file(path)
        if path and os.path.isdir(path):
            directory, file = path, os.path.join(path, "tokenizer.json")
        else:
            directory, file = os.path.dirname(path or ""), path
        if not file or not os.path.isfile(file):
            raise TokenizerError(f"HuggingFace tokenizer.json not found: {path}")
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as err:  # noqa: BLE001
            raise TokenizerError(f"cannot load HuggingFace tokenizer {file}: {err}") from None
        self.files = (file,)
        self.include_special_tokens = include_special_tokens
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        if eod_token is None:
            eod_token = _hf_config_eos(directory)
        candidates = [eod_token] if eod_token else list(HF_EOD_CANDIDATES)
        eod = None
        for cand in candidates:
            eod = self.tok.token_to_id(cand)
            if eod is not None:
                break
        if eod is None:
            raise TokenizerError(
                f"HuggingFace tokenizer {file}: no end-of-document token "
                f"(tried {', '.join(candidates)}); pass --eod-token"
            )
        self.eod = eod

    def tokenize(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=self.include_special_tokens).ids

    def encode_batch(self, texts: list) -> list:
        encs = self.tok.encode_batch(texts, add_special_tokens=self.include_special_tokens)
        return [e.ids for e in encs]

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _hf_config_eos(directory: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        p = os.path.join(directory, name)
        if directory and os.path.isfile(p):
            try:
                with open(p, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (OSError, ValueError):
                continue
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def load_tiktoken_ranks(path: str) -> list:
    """Token byte strings in rank order, from Megatron's JSON or a .tiktoken file."""
    if not path or not os.path.isfile(path):
        raise TokenizerError(f"tiktoken vocabulary not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    tokens: list = []
    try:
        if data.lstrip()[:1] == b"[":
            for i, entry in enumerate(json.loads(data)):
                if entry["rank"] != i:
                    raise TokenizerError(f"{path}: entry {i} has rank {entry['rank']}")
                tokens.append(base64.b64decode(entry["token_bytes"]))
        else:
            ranked = []
            for line in data.splitlines():
                if not line.strip():
                    continue
                tok, rank = line.split()
                ranked.append((int(rank), base64.b64decode(tok)))
            ranked.sort()
            for i, (rank, tok) in enumerate(ranked):
                if rank != i:
                    raise TokenizerError(f"{path}: ranks are not 0..n-1 (missing {i})")
                tokens.append(tok)
    except TokenizerError:
        raise
    except Exception as err:  # noqa: BLE001
        raise TokenizerError(f"cannot read tiktoken vocabulary {path}: {err}") from None
    if len(tokens) < 256 or any(tokens[i] != bytes([i]) for i in range(256)):
        raise TokenizerError(f"{path}: the first 256 ranks must be the single bytes 0..255")
    return tokens


class TikTokenizer(_BaseTokenizer):
    tokenizer_type = "TikTokenizer"

    def __init__(
        self,
        path: str,
        pattern: str = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list | None = None,
    ):
        import tiktoken

        tokens = load_tiktoken_ranks(path)
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
        if missing:
            raise TokenizerError(f"tiktoken special tokens must include {missing}")
        if not len(special) <= num_special_tokens:
            raise TokenizerError("more tiktoken special tokens than --tiktoken-num-special-tokens")
        special += [TIKTOKEN_FILLER.format(i) for i in range(len(special), num_special_tokens)]
        if vocab_size is None:
            vocab_size = min(TIKTOKEN_DEFAULT_VOCAB, len(tokens) + num_special_tokens)
        inner = vocab_size - num_special_tokens
        if inner > len(tokens) or inner < 256:
            raise TokenizerError(f"{path}: vocab size {vocab_size} needs {inner} BPE ranks, file has {len(tokens)}")
        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(f"tiktoken pattern must be v1 or v2, got {pattern!r}")
        self.files = (path,)
        self.vocab_size = vocab_size
        self.num_special_tokens = num_special_tokens
        self.special_tokens = special
        ranks = {tok: i + num_special_tokens for i, tok in enumerate(tokens[:inner])}
        self.enc = tiktoken.Encoding(
            name=f"megatron-lol-{os.path.basename(path)}",
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(special)},
        )
        self.eod = special.index("</s>")
        self.bos = special.index("<s>")
        self.pad = special.index("<pad>")

    def tokenize(self, text: str) -> list:
        return self.enc.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self.enc.decode(list(ids))


class GPT2BPETokenizer(_BaseTokenizer):
    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for label, p in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not p or not os.path.isfile(p):
                raise TokenizerError(f"GPT2BPETokenizer needs {label}: {p} not found")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # noqa: BLE001
            raise TokenizerError(f"cannot load GPT-2 BPE {vocab_file} / {merge_file}: {err}") from None
        if "<|endoftext|>" not in vocab:
            raise TokenizerError(f"{vocab_file}: no <|endoftext|> token (the GPT-2 EOD)")
        self.files = (vocab_file, merge_file)
        self.tok = Tokenizer(bpe)
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self.tok.decoder = decoders.ByteLevel()
        # like GPT2Tokenizer: <|endoftext|> in text is the special token
        self.tok.add_special_tokens(["<|endoftext|>"])
        self.eod = vocab["<|endoftext|>"]
        self.vocab_size = len(vocab)

    def tokenize(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list) -> list:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    *,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: list | None = None,
    vocab_size: int | None = None,
    eod_token: str | None = None,
    include_special_tokens: bool = True,
):
    """Build a tokenizer by Megatron-LM type name; raises TokenizerError (a ValueError)."""
    spec = dict(
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        vocab_file=vocab_file,
        merge_file=merge_file,
        tiktoken_pattern=tiktoken_pattern,
        tiktoken_num_special_tokens=tiktoken_num_special_tokens,
        tiktoken_special_tokens=tiktoken_special_tokens,
        vocab_size=vocab_size,
        eod_token=eod_token,
        include_special_tokens=include_special_tokens,
    )
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    elif tokenizer_type == "HuggingFaceTokenizer":
        tok = HuggingFaceTokenizer(tokenizer_model, include_special_tokens, eod_token)
    elif tokenizer_type == "TikTokenizer":
        tok = TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern or "v2",
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=tiktoken_special_tokens,
        )
    elif tokenizer_type == "GPT2BPETokenizer":
        tok = GPT2BPETokenizer(vocab_file, merge_file)
    else:
        raise TokenizerError(
            f"unsupported --tokenizer-type {tokenizer_type!r} (choose from {', '.join(TOKENIZER_TYPES)})"
        )
    tok._spec = spec
    return tok
