"""What a run checks of its files before the first step, shared by ``train --dry-run`` and the run.

A dry run that passes what the run then refuses is worse than none: the job
waits in the queue and fails there. So the checks a run makes of its inputs are
functions here that both call, each failure one :class:`ConfigError` line that
names the key (and, through the CLI, its flag), exit status 2:

* :func:`config_tokenizer` -- the tokenizer built as the trainer builds it
  (a Hub name read from the Hub cache, offline under ``HF_HUB_OFFLINE=1``),
  after the tokenizer type is checked against the files given (a SentencePiece
  ``.model`` under ``GPT2BPETokenizer`` is named as such, not a missing vocab);
* :func:`check_datasets` -- every ``.idx`` against itself and its ``.bin``
  (:func:`~megatron_lol.data.indexed.validate_dataset`: the header, lengths,
  pointers and document indices, vectorised over memory-mapped chunks), and a
  ``data.cache_dir`` the run can create;
* :func:`check_checkpoints` -- the checkpoint the run will load (the resume
  rules of :func:`~megatron_lol.training.checkpointing.resolve.load_plan`) and a
  save directory this user can write.

None of these imports torch or creates a file.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_lol.errors import CliError, ConfigError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _file_kind(path: str) -> Optional[tuple]:
    """``(what the file is, the tokenizer type that reads it)`` when its name says so unambiguously."""
    name = os.path.basename(path.rstrip("/")).lower()
    if name.endswith(".model"):
        return "a SentencePiece model", "SentencePieceTokenizer"
    if name.endswith(".tiktoken"):
        return "a tiktoken vocabulary", "TikTokenizer"
    if name == "tokenizer.json" or (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return "a HuggingFace tokenizer.json", "HuggingFaceTokenizer"
    return None


def check_tokenizer_type(data) -> None:
    """The tokenizer type against the files given, before any is read: each type reads its own
    files (``--tokenizer-model``, or ``--vocab-file`` + ``--merge-file`` for GPT-2 BPE)."""
    kind, model = data.tokenizer_type, data.tokenizer_model
    found = _file_kind(model) if model else None
    if kind == "GPT2BPETokenizer":
        if data.vocab_file and data.merge_file:
            return
        given = f"; --tokenizer-model {model} is {found[0]}: --tokenizer-type {found[1]}" if found else ""
        raise ConfigError(
            f"data.tokenizer_type: GPT2BPETokenizer reads --vocab-file and --merge-file "
            f"({'neither' if not (data.vocab_file or data.merge_file) else 'only one'} given){given}"
        )
    if not model:
        extra = " (--vocab-file / --merge-file are GPT2BPETokenizer's)" if data.vocab_file else ""
        raise ConfigError(f"data.tokenizer_model: --tokenizer-type {kind} needs --tokenizer-model{extra}")
    if (
        found is not None
        and found[1] != kind
        and not (found[1] == "SentencePieceTokenizer" and kind in SENTENCEPIECE_TYPES)
    ):
        raise ConfigError(f"data.tokenizer_type: {kind} cannot read {model} ({found[0]}): --tokenizer-type {found[1]}")


def config_tokenizer(data):
    """The tokenizer of ``data`` (a :class:`~megatron_lol.config.schema.DataConfig`), built as the
    trainer builds it; a file that is missing, unreadable or of another type is one ConfigError."""
    from megatron_lol.data.tokenizers import TokenizerError, build_tokenizer

    check_tokenizer_type(data)
    try:
        return build_tokenizer(
            data.tokenizer_type,
            tokenizer_model=data.tokenizer_model,
            vocab_file=data.vocab_file,
            merge_file=data.merge_file,
        )
    except TokenizerError as err:
        key = "data.vocab_file" if data.tokenizer_type == "GPT2BPETokenizer" else "data.tokenizer_model"
        raise ConfigError(f"{key}: {err}") from None


def check_datasets(data) -> list:
    """Every dataset of ``data.paths`` checked against its ``.bin``, and a ``data.cache_dir`` the run can
    create or write (its sample indices go there); the datasets' headers."""
    from megatron_lol.data.datasets import parse_blend
    from megatron_lol.data.indexed import validate_dataset
    from megatron_lol.training.checkpointing.resolve import check_save_dir

    problem = check_save_dir(data.cache_dir)
    if problem is not None:
        raise ConfigError(f"data.cache_dir: {problem}")

    try:
        prefixes, _ = parse_blend(data.paths)
        return [validate_dataset(p) for p in prefixes]
    except CliError as err:
        raise ConfigError(f"data.paths: {err}") from None


def check_checkpoints(training, check_load: bool = True):
    """The checkpoint the run loads (None: it starts fresh) and a writable save directory, as the run
    decides them; ``check_load`` False: the save directory only (a pipeline's later stage loads a
    checkpoint that does not exist yet)."""
    from megatron_lol.training.checkpointing.files import CheckpointError
    from megatron_lol.training.checkpointing.resolve import check_save_dir, load_plan

    problem = check_save_dir(training.save)
    if problem is not None:
        raise ConfigError(f"training.save: {problem}")
    if not check_load:
        return None
    try:
        return load_plan(training.save, training.load, training.resume, training.load_iteration)
    except CheckpointError as err:
        key = "training.load" if training.load and str(err).startswith(str(training.load)) else "training.save"
        raise ConfigError(f"{key}: {err}") from None
