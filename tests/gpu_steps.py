"""A few training steps on synthetic tokens, for the GPU tests (tests/test_gpu.py) and bench/gpu/run_all.

    python tests/gpu_steps.py RUNS_JSON        # RUNS_JSON: {"name": {"model": {...}, "steps": N, ...}, ...}

Runs every named run in turn in this process (the trainer re-initialises megatron's parallel state) on
the device the platform picks (hide CUDA with ``CUDA_VISIBLE_DEVICES=`` for the CPU reference) and prints
one line ``GPU_STEPS {"name": {"losses": [...], "grad_norms": [...], "device": ...}}`` on rank 0. Under
torchrun every rank takes part. FP32 runs disable TF32, so the GPU computes what the CPU does up to the
order of its sums.
"""

from __future__ import annotations

import json
import os
import sys

BASE_MODEL = dict(
    hidden_size=128,
    num_attention_heads=4,
    ffn_hidden_size=256,
    n_prelude=1,
    n_coda=1,
    window_size=16,
    window_shift=8,
    vocab_size=256,
)
EOD = 0


class SyntheticTokens:
    """Deterministic random rows of EOD-separated documents (lengths seq/4 .. seq), the same on every device."""

    def __init__(self, seq: int, vocab: int, seed: int = 3, size: int = 1 << 16):
        self.seq, self.vocab, self.seed, self.size = seq, vocab, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        tokens = torch.randint(1, self.vocab, (self.seq + 1,), generator=g)
        pos = 0
        while True:
            pos += int(torch.randint(max(2, self.seq // 4), max(3, self.seq), (1,), generator=g))
            if pos >= self.seq:
                break
            tokens[pos] = EOD
        return {
            "tokens": tokens[:-1].clone(),
            "labels": tokens[1:].clone(),
            "loss_mask": torch.ones(self.seq, dtype=torch.float32),
        }


class Tokenizer:
    def __init__(self, vocab: int):
        self.vocab_size, self.eod = vocab, EOD


def run_one(spec: dict) -> dict:
    import torch

    from megatron_lol.config import config_from_dict
    from megatron_lol.parallel.routing_agreement import RoutingAgreement
    from megatron_lol.training.trainer import Trainer

    if spec.get("kind") == "library_grads":
        return library_grads()
    model = dict(BASE_MODEL, **spec.get("model", {}))
    seq, mbs = spec.get("seq_length", 128), spec.get("micro_batch_size", 4)
    steps = spec.get("steps", 3)
    training = {
        "train_iters": max(steps, 2),
        "micro_batch_size": mbs,
        "global_batch_size": spec.get("global_batch_size", 2 * mbs),
        "seq_length": seq,
        "log_interval": 10**6,
        "eval_interval": 10**6,
        "eval_iters": 0,
        "seed": spec.get("seed", 7),
    }
    cfg = config_from_dict(
        {
            "model": model,
            "parallel": spec.get("parallel", {}),
            "curriculum": spec.get("curriculum", {}),
            "training": dict(training, **spec.get("training", {})),
            "optimizer": {"lr": spec.get("lr", 1e-3), "min_lr": 1e-4, "lr_warmup_iters": 0, "clip_grad": 1.0},
        }
    )
    data = SyntheticTokens(seq, model["vocab_size"])
    trainer = Trainer(cfg, tokenizer=Tokenizer(model["vocab_size"]), datasets=(data, None, None)).setup()
    # FP32 compares against the CPU: the trainer enables TF32 for FP32 on CUDA, these runs take it back
    fp32 = cfg.model.precision.params_dtype == "fp32"
    tf32 = trainer.tf32
    if fp32:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    checks = []
    saved = RoutingAgreement.__call__

    def counting(self, depth, decision):
        checks.append((self.step, depth))
        return saved(self, depth, decision)

    RoutingAgreement.__call__ = counting
    try:
        it = trainer.data_iterator(trainer.train_ds, 0)
        results = [trainer.train_step(it) for _ in range(steps)]
    finally:
        RoutingAgreement.__call__ = saved
    batch = next(trainer._batches(trainer.train_ds, 0))
    return {
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "device": str(trainer.device),
        "use_te": bool(trainer.model.use_te),
        "grouped_core": bool(trainer.grouped_core),
        "params_dtype": cfg.model.precision.params_dtype,
        "fp8_recipe": cfg.model.precision.fp8_recipe if cfg.model.precision.fp8 else None,
        "tf32_enabled": tf32,
        "routing_checks": len(checks),
        "pinned_batches": bool(batch["tokens"].is_pinned()),
    }


def library_grads() -> dict:
    """tests/grad_accumulation_check.py on this process's device (the local spec: fused accumulation through
    megatron-core's linears and megatron_lol.platform.no_te.TorchWgradAccumulation)."""

    from grad_accumulation_check import errors
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lol.platform import device, init_distributed, setup_platform

    setup_platform()
    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    e = errors(device())
    return {
        "device": str(device()),
        "calls": e["calls"],
        "fused": e["fused"],
        "fp32_sum": e["fp32_sum"],
        "bf16_sum": e["bf16_sum"],
        "norm_diff": float((e["fused_norm"] - e["unfused_norm"]).abs().max()),
    }


def main(argv: list) -> int:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "4")))
    runs = json.loads(argv[0])
    out = {}
    for name, spec in runs.items():
        try:
            out[name] = run_one(spec)
        except Exception as err:  # reported per run; the caller asserts
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print("GPU_STEPS " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
