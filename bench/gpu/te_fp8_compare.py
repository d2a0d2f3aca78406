"""BF16 vs FP8 (Transformer Engine) training of a ~350M LoL model on one GPU.

Prepared for a lent GPU machine (see check_te_fp8.sh); needs CUDA, Transformer
Engine and megatron-core. Synthetic tokens (uniform over the vocabulary, with
EOD-separated documents) so that no tokenizer or corpus is needed there: the
loss is only compared between the two precisions, not interpreted.

Prints one table: step time (median of the timed steps), tokens/s, final
loss, and the FP8/BF16 ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


class SyntheticTokens:
    def __init__(self, n: int, seq: int, vocab: int, eod: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab - 1, (n, seq + 1), generator=g)
        self.rows[:, 300::700] = eod
        self.seq = seq

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"tokens": r[:-1], "labels": r[1:], "loss_mask": torch.ones(self.seq)}


class Tok:
    def __init__(self, vocab):
        self.vocab_size, self.eod = vocab, vocab - 1


def run(fp8: str | None, recipe: str, steps: int, warmup: int) -> dict:
    from megatron_lol.config import config_from_dict
    from megatron_lol.training.trainer import Trainer

    model = dict(hidden_size=1024, num_attention_heads=16, ffn_hidden_size=2816, n_prelude=4, n_coda=4,
                 num_blocks=8, routed_depth=16, window_size=128, window_shift=64, vocab_size=32000,
                 params_dtype="bf16", use_transformer_engine=True)
    if fp8:
        model.update(fp8=fp8, fp8_recipe=recipe)
    cfg = config_from_dict({"model": model,
                            "training": {"train_iters": warmup + steps, "micro_batch_size": 8,
                                         "seq_length": 1024, "log_interval": 1000, "eval_interval": 100000,
                                         "eval_iters": 0, "seed": 1},
                            "optimizer": {"lr": 3e-4, "lr_warmup_iters": 5}})
    trainer = Trainer(cfg, tokenizer=Tok(32000), datasets=(SyntheticTokens(4096, 1024, 32000, 31999), None, None))
    trainer.setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        res = trainer.train_step(data)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(res.seconds)
        losses.append(res.loss)
    t = statistics.median(times)
    return {"step_s": t, "tokens_per_s": res.tokens / t, "loss": losses[-1],
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fp8", default="hybrid", choices=["e4m3", "hybrid"])
    ap.add_argument("--recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("te_fp8_compare: needs a CUDA GPU", file=sys.stderr)
        return 2
    bf16 = run(None, args.recipe, args.steps, args.warmup)
    fp8 = run(args.fp8, args.recipe, args.steps, args.warmup)
    print(f"{'run':<22}{'step s':>10}{'tokens/s':>12}{'loss':>10}{'peak GB':>10}")
    for name, r in (("bf16", bf16), (f"fp8 {args.fp8}/{args.recipe}", fp8)):
        print(f"{name:<22}{r['step_s']:>10.4f}{r['tokens_per_s']:>12,.0f}{r['loss']:>10.4f}{r['peak_mem_gb']:>10.1f}")
    print(f"{'fp8 / bf16':<22}{fp8['step_s'] / bf16['step_s']:>10.3f}{fp8['tokens_per_s'] / bf16['tokens_per_s']:>12.3f}"
          f"{fp8['loss'] / bf16['loss']:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
