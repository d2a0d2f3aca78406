"""The padded vocabulary of a run: one size for every parallel layout, kept across resumes.

Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by
x TP``, so the same config builds a different model at TP=1 and TP=2 (8064 vs
8192 rows for an 8000-piece tokenizer): the losses differ by the log of the
ratio and a checkpoint cannot move between the layouts. Here the padding is a
multiple of ``make_vocab_size_divisible_by`` alone
(:func:`~megatron_lol.model.lol_model.padded_vocab_size`), which every tensor
parallel size that divides it can shard; and a run that loads a checkpoint
takes the size that checkpoint records (``run_config.yaml``:
``checkpoint.padded_vocab_size``), whatever rule or layout produced it.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_lol.errors import ConfigError


def checkpoint_to_load(cfg) -> Optional[str]:
    """The ``iter_*`` directory this run will load, by the resume rules of
    :meth:`megatron_lol.training.checkpointing.Checkpointer.resolve_and_load`, or None."""
    from megatron_lol.training.checkpointing import checkpoint_dir, latest_checkpoint

    tr = cfg.training
    if tr.resume and tr.save:
        it = latest_checkpoint(tr.save)
        if it is not None:
            return checkpoint_dir(tr.save, it)
    if not tr.load:
        return None
    if tr.save and os.path.abspath(tr.load) == os.path.abspath(tr.save) and not tr.resume:
        return None
    it = tr.load_iteration if tr.load_iteration is not None else latest_checkpoint(tr.load)
    return None if it is None else checkpoint_dir(tr.load, it)


def recorded_vocab_size(path: str) -> Optional[int]:
    """The padded vocabulary a checkpoint directory records, or None (no run_config.yaml)."""
    import yaml

    from megatron_lol.training.checkpointing import RUN_CONFIG

    try:
        with open(os.path.join(path, RUN_CONFIG)) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        return None
    value = (raw.get("checkpoint") or {}).get("padded_vocab_size") or (raw.get("model") or {}).get("vocab_size")
    return int(value) if value else None


def resolve_vocab_size(cfg, tokenizer_vocab: int) -> int:
    """The vocabulary rows of the model: ``model.vocab_size`` if set, else the size recorded by the
    checkpoint to be loaded, else the tokenizer's size padded to ``make_vocab_size_divisible_by``."""
    from megatron_lol.model.lol_model import padded_vocab_size

    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    path = checkpoint_to_load(cfg)
    recorded = recorded_vocab_size(path) if path else None
    if m.vocab_size:
        vocab, source = m.vocab_size, "model.vocab_size"
        if recorded is not None and recorded != vocab:
            raise ConfigError(
                f"model.vocab_size: {vocab} but the checkpoint to load ({path}) has {recorded} "
                f"vocabulary rows; leave model.vocab_size unset to keep the checkpoint's"
            )
    elif recorded is not None:
        vocab, source = recorded, f"the checkpoint {path}"
    else:
        vocab = padded_vocab_size(tokenizer_vocab, m.make_vocab_size_divisible_by)
        source = f"the tokenizer's {tokenizer_vocab} padded to a multiple of model.make_vocab_size_divisible_by"
    if vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size: {vocab} (from {source}) is smaller than the tokenizer's {tokenizer_vocab}"
        )
    if vocab % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size: {tp} does not divide the vocabulary of {vocab} rows "
            f"(from {source}); choose a model.make_vocab_size_divisible_by that it divides"
        )
    return vocab
