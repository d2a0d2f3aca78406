"""Synthetic tokens for ``megatron-lol profile --synthetic-data`` and the benchmarks: a trainer that needs
no corpus and no tokenizer file, only ``model.vocab_size`` (or the config's tokenizer)."""

from __future__ import annotations

from typing import Optional

from megatron_lol.errors import CliError


class SyntheticDataset:
    """Deterministic random tokens: documents of random length separated by EOD."""

    def __init__(self, seq_length: int, vocab_size: int, eod: Optional[int], seed: int = 0, size: int = 1 << 20):
        self.seq, self.vocab, self.eod, self.seed, self.size = seq_length, vocab_size, eod, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        low = 1 if self.eod == 0 else 0
        tokens = torch.randint(low, self.vocab, (self.seq + 1,), generator=g)
        if self.eod is not None:
            pos = 0
            while True:  # documents of mean length ~ seq / 2
                pos += int(torch.randint(max(2, self.seq // 4), max(3, self.seq), (1,), generator=g))
                if pos >= self.seq:
                    break
                tokens[pos] = self.eod
        return {
            "tokens": tokens[:-1].clone(),
            "labels": tokens[1:].clone(),
            "loss_mask": torch.ones(self.seq, dtype=torch.float32),
        }


class StubTokenizer:
    """What the trainer asks of a tokenizer when the tokens are synthetic: the vocabulary and EOD."""

    def __init__(self, vocab_size: int, eod: int = 0):
        self.vocab_size = vocab_size
        self.eod = eod


def build_trainer(cfg, synthetic: bool):
    """``Trainer(cfg).setup()``; with ``synthetic``, on :class:`SyntheticDataset` tokens instead of
    ``data.paths`` (the same model, optimizer and parallel layout)."""
    from megatron_lol.training.trainer import Trainer

    if not synthetic:
        return Trainer(cfg).setup()
    if cfg.model.vocab_size is not None:
        # the config's vocabulary: random tokens need no tokenizer (a Hub name is not looked up)
        tokenizer = StubTokenizer(cfg.model.vocab_size, eod=0)
    elif cfg.data.tokenizer_model or cfg.data.vocab_file:
        from megatron_lol.training.preflight import config_tokenizer

        tokenizer = config_tokenizer(cfg.data)
    else:
        raise CliError("--synthetic-data needs model.vocab_size or data.tokenizer_model")
    eod = tokenizer.eod
    ds = SyntheticDataset(cfg.training.seq_length, tokenizer.vocab_size, eod, seed=cfg.training.seed)
    return Trainer(cfg, tokenizer=tokenizer, datasets=(ds, None, None)).setup()
