"""The command-line flags that set config keys: Megatron-LM's names, their groups in ``--help``.

Each table maps a flag to the dotted key it sets (:mod:`.loader` builds the
parser from them and applies what was given as overrides, after the YAML);
a key without a flag is set with ``--set key=value``.
"""

from __future__ import annotations

# Flag groups, in the order ``--help`` lists them: title of each.
GROUPS: dict[str, str] = {
    "model": "model shape",
    "data": "data",
    "tokenizer": "tokenizer",
    "batch": "batch and sequence",
    "iterations": "iterations and evaluation",
    "checkpointing": "checkpointing",
    "optimizer": "optimizer and learning-rate schedule",
    "parallelism": "parallelism",
    "precision": "precision, Transformer Engine and FP8",
    "logging": "logging (console, metrics.jsonl, TensorBoard, W&B)",
    "profiling": "profiling (torch.profiler traces, NVTX ranges for nsys)",
}

# Megatron-LM flag -> (dotted config key, group, metavar, help). Only settings people change most;
# any other key goes through --set.
MEGATRON_FLAGS: dict[str, tuple[str, str, str, str]] = {
    "--hidden-size": ("model.hidden_size", "model", "N", "width of the residual stream"),
    "--num-attention-heads": ("model.num_attention_heads", "model", "N", "attention heads per layer"),
    "--num-query-groups": (
        "model.num_query_groups",
        "model",
        "N",
        "key/value heads (grouped-query attention; default: one per head)",
    ),
    "--kv-channels": ("model.kv_channels", "model", "N", "channels per head (default hidden / heads)"),
    "--ffn-hidden-size": ("model.ffn_hidden_size", "model", "N", "SwiGLU hidden size (default 8/3 hidden, to 64)"),
    "--make-vocab-size-divisible-by": (
        "model.make_vocab_size_divisible_by",
        "model",
        "N",
        "pad the vocabulary to a multiple of this (at every TP size)",
    ),
    "--rotary-base": ("model.rotary_base", "model", "BASE", "RoPE base"),
    "--norm-epsilon": ("model.norm_epsilon", "model", "EPS", "RMSNorm epsilon"),
    "--init-method-std": ("model.init_method_std", "model", "STD", "standard deviation of the initial weights"),
    "--data-cache-path": ("data.cache_dir", "data", "DIR", "where megatron-core caches the datasets' sample indices"),
    "--split": ("data.split", "data", "W,W,W", "train,valid,test weights of the documents, e.g. 98,1,1"),
    "--tokenizer-type": (
        "data.tokenizer_type",
        "tokenizer",
        "TYPE",
        "Megatron-LM tokenizer type, e.g. SentencePieceTokenizer",
    ),
    "--tokenizer-model": (
        "data.tokenizer_model",
        "tokenizer",
        "FILE",
        "tokenizer file: SentencePiece model, tokenizer.json or tiktoken file",
    ),
    "--vocab-file": ("data.vocab_file", "tokenizer", "FILE", "GPT-2 BPE vocab.json"),
    "--merge-file": ("data.merge_file", "tokenizer", "FILE", "GPT-2 BPE merges.txt"),
    "--micro-batch-size": (
        "training.micro_batch_size",
        "batch",
        "N",
        "sequences per micro-batch and data-parallel rank",
    ),
    "--global-batch-size": (
        "training.global_batch_size",
        "batch",
        "N",
        "sequences per optimizer step, all ranks together",
    ),
    "--seq-length": ("training.seq_length", "batch", "N", "tokens per sequence"),
    "--seed": ("training.seed", "batch", "N", "random seed (initialisation, data order, router noise)"),
    "--train-iters": ("training.train_iters", "iterations", "N", "optimizer steps to train"),
    "--eval-interval": ("training.eval_interval", "iterations", "N", "iterations between evaluations"),
    "--eval-iters": ("training.eval_iters", "iterations", "N", "validation batches per evaluation"),
    "--exit-duration-in-mins": (
        "training.exit_duration_in_mins",
        "iterations",
        "MIN",
        "save a checkpoint and stop after this many minutes",
    ),
    "--exit-interval": (
        "training.exit_interval",
        "iterations",
        "N",
        "save a checkpoint and stop (status 0) at the first iteration divisible by N",
    ),
    "--save": ("training.save", "checkpointing", "DIR", "checkpoint directory to write (metrics.jsonl goes there too)"),
    "--load": ("training.load", "checkpointing", "DIR", "checkpoint directory to start from when --save has none"),
    "--save-interval": ("training.save_interval", "checkpointing", "N", "iterations between checkpoints"),
    "--lr": ("optimizer.lr", "optimizer", "LR", "peak learning rate"),
    "--min-lr": ("optimizer.min_lr", "optimizer", "LR", "learning rate at the end of the decay"),
    "--clip-grad": ("optimizer.clip_grad", "optimizer", "NORM", "gradient-norm clipping threshold"),
    "--weight-decay": ("optimizer.weight_decay", "optimizer", "WD", "AdamW weight decay"),
    "--lr-warmup-iters": ("optimizer.lr_warmup_iters", "optimizer", "N", "iterations of linear warm-up"),
    "--lr-decay-style": ("optimizer.lr_decay_style", "optimizer", "STYLE", "cosine, WSD, linear or constant"),
    "--optimizer": (
        "optimizer.name",
        "optimizer",
        "NAME",
        "adam (AdamW) or muon (Muon for the attention / MLP matrices, AdamW for the rest)",
    ),
    "--adam-beta1": ("optimizer.adam_beta1", "optimizer", "B1", "AdamW's first-moment decay"),
    "--adam-beta2": ("optimizer.adam_beta2", "optimizer", "B2", "AdamW's second-moment decay"),
    "--adam-eps": ("optimizer.adam_eps", "optimizer", "EPS", "AdamW's epsilon"),
    "--muon-momentum": ("optimizer.muon_momentum", "optimizer", "M", "Muon's momentum"),
    "--muon-scale-mode": (
        "optimizer.muon_scale_mode",
        "optimizer",
        "MODE",
        "Muon's update scaling (megatron-core's muon_scale_mode)",
    ),
    "--muon-fp32-matmul-prec": (
        "optimizer.muon_fp32_matmul_prec",
        "optimizer",
        "PREC",
        "float32 matmul precision of Newton-Schulz: medium, high or highest",
    ),
    "--muon-num-ns-steps": ("optimizer.muon_num_ns_steps", "optimizer", "N", "Newton-Schulz iterations"),
    "--muon-tp-mode": (
        "optimizer.muon_tp_mode",
        "optimizer",
        "MODE",
        "Muon under tensor parallelism: blockwise, duplicated or distributed",
    ),
    "--muon-extra-scale-factor": (
        "optimizer.muon_extra_scale_factor",
        "optimizer",
        "F",
        "extra factor on Muon's update",
    ),
    "--muon-adam-lr": (
        "optimizer.muon_adam_lr",
        "optimizer",
        "LR",
        "peak learning rate of the AdamW part under Muon (default --lr)",
    ),
    "--muon-adam-min-lr": (
        "optimizer.muon_adam_min_lr",
        "optimizer",
        "LR",
        "final learning rate of the AdamW part under Muon (default --min-lr)",
    ),
    "--tensor-model-parallel-size": (
        "parallel.tensor_model_parallel_size",
        "parallelism",
        "N",
        "tensor-parallel ranks",
    ),
    "--pipeline-model-parallel-size": ("parallel.pipeline_model_parallel_size", "parallelism", "N", "pipeline stages"),
    "--virtual-pipeline-model-parallel-size": (
        "parallel.virtual_pipeline_model_parallel_size",
        "parallelism",
        "N",
        "model chunks per pipeline stage, for the interleaved schedule",
    ),
    "--expert-model-parallel-size": (
        "parallel.expert_model_parallel_size",
        "parallelism",
        "N",
        "ranks the block library (plan lol) or the experts are sharded over",
    ),
    "--recompute-granularity": (
        "parallel.recompute_granularity",
        "parallelism",
        "G",
        "recompute activations in the backward: full or selective",
    ),
    "--recompute-method": (
        "parallel.recompute_method",
        "parallelism",
        "METHOD",
        "with full recomputation: uniform (every layer execution on its own)",
    ),
    "--routed-core": (
        "parallel.routed_core",
        "parallelism",
        "MODE",
        "how a LoL core runs its blocks: auto (grouped on CUDA), grouped or reference (one call per block)",
    ),
    "--distributed-timeout-minutes": (
        "training.distributed_timeout_minutes",
        "parallelism",
        "MIN",
        "minutes a collective waits for a rank that stopped answering before the job stops (default 10)",
    ),
    "--heartbeat-interval": (
        "training.heartbeat_interval",
        "parallelism",
        "SEC",
        "seconds between a rank's heartbeats through the rendezvous store (0: none)",
    ),
    "--heartbeat-timeout": (
        "training.heartbeat_timeout",
        "parallelism",
        "SEC",
        "seconds without a rank's heartbeat before every rank stops, naming it "
        "(default: --distributed-timeout-minutes)",
    ),
    "--on-save-failure": (
        "training.on_save_failure",
        "checkpointing",
        "WHAT",
        "a save that failed on any rank: stop (default) or continue to the next save",
    ),
    "--check-routing-agreement": (
        "training.check_routing_agreement",
        "parallelism",
        "N",
        "compare the routing across the tensor-parallel group every N iterations (default: --log-interval; 0: never)",
    ),
    "--num-experts": (
        "model.moe.num_experts",
        "model",
        "N",
        "experts per MoE layer (which layers are MoE: --set model.moe.layers=fixed or all)",
    ),
    "--moe-router-topk": ("model.moe.router_topk", "model", "K", "experts each token is routed to"),
    "--moe-ffn-hidden-size": ("model.moe.ffn_hidden_size", "model", "N", "an expert's hidden width"),
    "--moe-aux-loss-coeff": ("model.moe.aux_loss_coeff", "model", "X", "Switch load-balancing loss coefficient"),
    "--moe-z-loss-coeff": ("model.moe.z_loss_coeff", "model", "X", "router z-loss coefficient"),
    "--moe-router-score-function": (
        "model.moe.router_score_function",
        "model",
        "FN",
        "softmax or sigmoid router scores",
    ),
    "--fp8-format": (
        "model.precision.fp8",
        "precision",
        "FORMAT",
        "FP8 for the blocks' GEMMs under Transformer Engine: e4m3 or hybrid",
    ),
    "--fp8-recipe": (
        "model.precision.fp8_recipe",
        "precision",
        "RECIPE",
        "delayed, tensorwise, mxfp8 or blockwise scaling (default: tensorwise for plans that run "
        "a layer more than once per forward, else delayed)",
    ),
    "--fp8-margin": (
        "model.precision.fp8_margin",
        "precision",
        "N",
        "margin of the FP8 scaling factor (delayed scaling)",
    ),
    "--fp8-amax-history-len": (
        "model.precision.fp8_amax_history_len",
        "precision",
        "N",
        "amax history length (delayed scaling)",
    ),
    "--fp8-amax-compute-algo": (
        "model.precision.fp8_amax_compute_algo",
        "precision",
        "ALGO",
        "max or most_recent amax of the history (delayed scaling)",
    ),
    "--log-interval": (
        "training.log_interval",
        "logging",
        "N",
        "iterations between console lines / metrics.jsonl records",
    ),
    "--tensorboard-dir": (
        "training.tensorboard_dir",
        "logging",
        "DIR",
        "write TensorBoard event files here (pip install 'megatron-lol[console]')",
    ),
    "--tensorboard-log-interval": (
        "training.tensorboard_log_interval",
        "logging",
        "N",
        "iterations between TensorBoard / W&B points (default 1)",
    ),
    "--wandb-project": (
        "training.wandb_project",
        "logging",
        "NAME",
        "log to this Weights & Biases project; WANDB_MODE=offline keeps the run local",
    ),
    "--wandb-exp-name": ("training.wandb_exp_name", "logging", "NAME", "the W&B run name"),
    "--wandb-save-dir": (
        "training.wandb_save_dir",
        "logging",
        "DIR",
        "where W&B writes its files (default <save>/wandb)",
    ),
    "--profile-step-start": (
        "training.profile_step_start",
        "profiling",
        "N",
        "first profiled iteration (0-based, as Megatron-LM counts; default 10)",
    ),
    "--profile-step-end": (
        "training.profile_step_end",
        "profiling",
        "N",
        "profiling stops before this iteration (default 12)",
    ),
    "--profile-dir": (
        "training.profile_dir",
        "profiling",
        "DIR",
        "where torch.profiler traces go (default: --tensorboard-dir, else <save>/profile)",
    ),
}
# switch -> (dotted config key, value it sets, group, help)
BOOL_FLAGS: dict[str, tuple[str, bool, str, str]] = {
    "--sequence-parallel": (
        "parallel.sequence_parallel",
        True,
        "parallelism",
        "sequence parallelism inside the tensor-parallel group",
    ),
    "--use-distributed-optimizer": (
        "parallel.use_distributed_optimizer",
        True,
        "parallelism",
        "shard the optimizer state over the data-parallel ranks",
    ),
    "--overlap-grad-reduce": (
        "parallel.overlap_grad_reduce",
        True,
        "parallelism",
        "overlap the data-parallel gradient reduction with backward",
    ),
    "--no-resume": ("training.resume", False, "checkpointing", "start afresh even if --save holds a checkpoint"),
    "--override-opt_param-scheduler": (
        "training.override_opt_param_scheduler",
        True,
        "checkpointing",
        "on resume, take this run's learning-rate and growth schedules where they differ from the checkpoint's",
    ),
    "--use-checkpoint-opt_param-scheduler": (
        "training.use_checkpoint_opt_param_scheduler",
        True,
        "checkpointing",
        "on resume, keep the checkpoint's learning-rate and growth schedules",
    ),
    "--async-save": ("training.async_save", True, "checkpointing", "write checkpoints in the background"),
    "--bf16": ("model.precision.params_dtype", "bf16", "precision", "BF16 weights with FP32 main gradients"),
    "--fp16": ("model.precision.params_dtype", "fp16", "precision", "FP16 (refused by validation, with the reason)"),
    "--muon-use-nesterov": ("optimizer.muon_use_nesterov", True, "optimizer", "Nesterov momentum in Muon"),
    "--muon-no-split-qkv": (
        "optimizer.muon_split_qkv",
        False,
        "optimizer",
        "orthogonalise the fused QKV matrix as one (default: Q, K, V apart)",
    ),
    "--untie-embeddings-and-output-weights": (
        "model.untie_embeddings_and_output_weights",
        True,
        "model",
        "separate input embedding and output head (the default)",
    ),
    "--profile": (
        "training.profile",
        True,
        "profiling",
        "profile iterations [--profile-step-start, --profile-step-end): NVTX ranges and an nsys "
        "capture range on CUDA; with --use-pytorch-profiler (or without CUDA) a torch.profiler trace",
    ),
    "--use-pytorch-profiler": (
        "training.use_pytorch_profiler",
        True,
        "profiling",
        "--profile writes a torch.profiler Chrome trace per profiled rank",
    ),
}

# Megatron-LM flag -> (dotted key, {flag value: config value}, group, help)
CHOICE_FLAGS: dict[str, tuple[str, dict, str, str]] = {
    "--transformer-impl": (
        "model.precision.transformer_engine",
        {"transformer_engine": True, "local": False},
        "precision",
        "layer implementation: transformer_engine (TE spec) or local",
    ),
}

# which groups each verb shows (``--config`` and ``--set`` always)
