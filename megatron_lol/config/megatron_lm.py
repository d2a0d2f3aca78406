"""Megatron-LM flags that have no flag here, each with what to use instead.

``megatron-lol``'s parser answers an unknown option with the closest known
one; for a Megatron-LM flag that guess is usually wrong (``--num-layers`` is
not ``--min-lr``). A flag listed here is answered with its own line instead:
what sets the same thing in this project, or why nothing needs to. Flags that
do have an equivalent are aliases of their config keys
(:data:`megatron_lol.config.flags.MEGATRON_FLAGS`) and never reach this table.
"""

from __future__ import annotations

from typing import Optional

NO_FLAG_HERE: dict[str, str] = {
    "--num-layers": (
        "a LoL model has no single layer count: set model.n_prelude, model.n_coda and the core's "
        "depth in the plan's section (lol: model.plan.num_blocks, model.plan.routed_depth; dense: "
        "model.plan.layers), e.g. --set model.plan.routed_depth=8"
    ),
    "--encoder-num-layers": "decoder only; see --num-layers",
    "--decoder-num-layers": "see --num-layers",
    "--max-position-embeddings": "RoPE has no position table: the longest sequence is --seq-length",
    "--position-embedding-type": "always rope (model.rotary_base, model.rotary_scaling_factor)",
    "--use-rotary-position-embeddings": "always on (model.rotary_base, model.rotary_scaling_factor)",
    "--rotary-percent": "RoPE always covers the whole head",
    "--swiglu": "always on: every MLP is SwiGLU",
    "--normalization": "always RMSNorm (--norm-epsilon)",
    "--disable-bias-linear": "always on: no linear layer has a bias",
    "--group-query-attention": "not needed: --num-query-groups N alone selects grouped-query attention",
    "--hidden-dropout": "no dropout (0.0)",
    "--attention-dropout": "no dropout (0.0)",
    "--vocab-size": "--set model.vocab_size=N (default: the tokenizer's, padded)",
    "--weight-decay-incr-style": "the weight decay is constant over the run: --weight-decay",
    "--start-weight-decay": "the weight decay is constant over the run: --weight-decay",
    "--end-weight-decay": "the weight decay is constant over the run: --weight-decay",
    "--lr-decay-iters": "the learning rate decays over --train-iters",
    "--lr-decay-samples": "schedules count iterations: --lr-warmup-iters, --train-iters",
    "--lr-warmup-samples": "schedules count iterations: --lr-warmup-iters",
    "--lr-warmup-fraction": "use --lr-warmup-iters",
    "--train-samples": "training counts iterations: --train-iters",
    "--rampup-batch-size": "not offered: the global batch is fixed (--global-batch-size)",
    "--recompute-num-layers": (
        "full recomputation checkpoints every layer execution on its own (--recompute-granularity full)"
    ),
    "--no-load-optim": "--set training.reset_optimizer=true (with --load)",
    "--no-load-rng": "not needed: RNG state is restored when the layout is unchanged, re-seeded otherwise",
    "--finetune": "--load DIR --set training.reset_optimizer=true --set training.reset_schedule=true",
    "--ckpt-format": "checkpoints are always torch_dist",
    "--auto-detect-ckpt-format": "checkpoints are always torch_dist",
    "--context-parallel-size": "context parallelism is not offered",
    "--expert-tensor-parallel-size": "experts follow --tensor-model-parallel-size",
    "--mock-data": "megatron-lol profile --synthetic-data",
    "--distributed-backend": "follows the device: nccl on GPUs, gloo on CPU",
    "--use-flash-attn": "the attention kernel follows --transformer-impl",
    "--attention-backend": "the attention kernel follows --transformer-impl",
    "--num-workers": "batches are read in the training process",
    "--dataloader-type": "batches are read in the training process, in order",
    "--use-mcore-models": "always on: every model is built from megatron-core",
    "--log-throughput": "always logged (tokens/s and TFLOP/s/device in the log line)",
    "--log-timers-to-tensorboard": "megatron-lol profile gives the step-time breakdown",
    "--exit-signal-handler": "always on: SIGTERM / SIGUSR1 save a checkpoint and exit 85 (docs/operations.md)",
    "--overlap-grad-reduce": "not offered: gradients are reduced after the backward",
    "--overlap-param-gather": "not offered: parameters are gathered after the step",
    "--no-gradient-accumulation-fusion": "not needed (no fused gradient accumulation without Apex/TE)",
    "--tokenizer-model-type": "--tokenizer-type",
}


def hint(option: str) -> Optional[str]:
    """What to use instead of the Megatron-LM flag ``option`` (``--flag`` or ``--flag=value``), if listed."""
    return NO_FLAG_HERE.get(option.split("=", 1)[0])
