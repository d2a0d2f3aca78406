"""YAML -> :class:`ExperimentConfig`, with dotted overrides and Megatron-LM flags.

Unknown keys and values of the wrong type are errors naming the file and the
dotted key: a typo in a config must never silently fall back to a default.

A checkpoint's ``run_config.yaml`` is a valid config: its top-level
``checkpoint:`` section (what the saving run recorded: iteration, tokenizer,
layout, padded vocabulary) describes the checkpoint, not the next run, and is
set aside after a check that it is a mapping.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_lol.config.schema import ConfigError, ExperimentConfig, ModelConfig, warn_flat_plan_keys

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
    "--fp8-format": (
        "model.fp8",
        "precision",
        "FORMAT",
        "FP8 for the blocks' GEMMs under Transformer Engine: e4m3 or hybrid",
    ),
    "--fp8-recipe": (
        "model.fp8_recipe",
        "precision",
        "RECIPE",
        "delayed, tensorwise, mxfp8 or blockwise scaling (default: tensorwise for plans that run "
        "a layer more than once per forward, else delayed)",
    ),
    "--fp8-margin": ("model.fp8_margin", "precision", "N", "margin of the FP8 scaling factor (delayed scaling)"),
    "--fp8-amax-history-len": ("model.fp8_amax_history_len", "precision", "N", "amax history length (delayed scaling)"),
    "--fp8-amax-compute-algo": (
        "model.fp8_amax_compute_algo",
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
    "--bf16": ("model.params_dtype", "bf16", "precision", "BF16 weights with FP32 main gradients"),
    "--fp16": ("model.params_dtype", "fp16", "precision", "FP16 (refused by validation, with the reason)"),
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
        "model.use_transformer_engine",
        {"transformer_engine": True, "local": False},
        "precision",
        "layer implementation: transformer_engine (TE spec) or local",
    ),
}

# which groups each verb shows (``--config`` and ``--set`` always)
PARAMS_GROUPS = ("model", "tokenizer", "parallelism")
PROFILE_GROUPS = ("model", "data", "tokenizer", "batch", "parallelism", "precision")
MEMORY_GROUPS = ("model", "tokenizer", "batch", "parallelism", "precision")


def add_config_arguments(parser: argparse.ArgumentParser, groups=None) -> None:
    """``--config``, ``--set`` and the Megatron-LM flags of ``groups`` (default: all), each
    group under its own heading in ``--help``: a verb lists only the settings it uses."""
    wanted = list(GROUPS) if groups is None else [g for g in GROUPS if g in groups]
    unknown = set(groups or ()) - set(GROUPS)
    if unknown:
        raise ValueError(f"add_config_arguments: unknown groups {sorted(unknown)}")
    cfg = parser.add_argument_group("configuration")
    # train may take its whole config from a checkpoint (--use-checkpoint-args):
    # megatron_lol/training/checkpoint_args.py
    cfg.add_argument("--config", required="checkpointing" not in wanted, metavar="YAML", help="YAML experiment config")
    cfg.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value by dotted key, e.g. --set model.plan.num_blocks=8 (repeatable)",
    )
    heads = {g: parser.add_argument_group(GROUPS[g]) for g in wanted}
    if "data" in heads:
        heads["data"].add_argument(
            "--data-path",
            nargs="+",
            default=None,
            metavar="PATH",
            help="Megatron blend: PREFIX or W1 PREFIX1 W2 PREFIX2 ... (data.paths)",
        )
    if "profiling" in heads:
        heads["profiling"].add_argument(
            "--profile-ranks",
            nargs="+",
            type=int,
            default=None,
            metavar="RANK",
            help="global ranks to profile (default 0) (training.profile_ranks)",
        )
    if "checkpointing" in heads:
        heads["checkpointing"].add_argument(
            "--use-checkpoint-args",
            action="store_true",
            help="take the model shape and tokenizer from the checkpoint's run_config.yaml (--save's when it has "
            "one, else --load's); --config may then be left out, and flags still win",
        )
    for flag, (key, group, metavar, text) in MEGATRON_FLAGS.items():
        if group in heads:
            heads[group].add_argument(flag, dest=_dest(flag), default=None, metavar=metavar, help=f"{text} ({key})")
    for flag, (key, value, group, text) in BOOL_FLAGS.items():
        if group in heads:
            heads[group].add_argument(
                flag, dest=_dest(flag), action="store_true", help=f"{text} ({key}={str(value).lower()})"
            )
    for flag, (key, values, group, text) in CHOICE_FLAGS.items():
        if group in heads:
            heads[group].add_argument(
                flag, dest=_dest(flag), default=None, choices=sorted(values), help=f"{text} ({key})"
            )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch intra-op threads per process (default: this process's share of the
    Slurm allocation or of the usable CPUs, see :mod:`megatron_lol.training.runtime`)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads per process (default: SLURM_CPUS_PER_TASK or the usable CPUs, "
        "divided among the processes sharing them; OMP_NUM_THREADS wins if set)",
    )


def config_from_args(args: argparse.Namespace, check_data: bool = True) -> ExperimentConfig:
    """The validated config of ``--config`` with ``--set`` and the flags a verb declared applied."""
    if not args.config:
        raise ConfigError("--config: required (or --use-checkpoint-args with a checkpoint in --save or --load)")
    return load_config(args.config, overrides_from_args(args), check_data=check_data)


def overrides_from_args(args: argparse.Namespace) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, the flag that set it)`` for ``--set`` and every flag a verb declared, in order."""
    overrides: list[tuple[str, Any, str]] = []
    for item in getattr(args, "overrides", None) or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        overrides.append((key.strip(), yaml.safe_load(raw), f"--set {item}"))
    if getattr(args, "data_path", None):
        overrides.append(("data.paths", list(args.data_path), "--data-path"))
    if getattr(args, "profile_ranks", None):
        overrides.append(("training.profile_ranks", list(args.profile_ranks), "--profile-ranks"))
    for flag, (key, *_) in MEGATRON_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides.append((key, yaml.safe_load(value), flag))
    for flag, (key, value, *_) in BOOL_FLAGS.items():
        if getattr(args, _dest(flag), False):
            overrides.append((key, value, flag))
    for flag, (key, values, *_) in CHOICE_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides.append((key, values[value], flag))
    return overrides


def flag_for_key(key: str, message: str = "") -> Optional[str]:
    """The Megatron-LM flag that sets dotted config ``key`` (None when only ``--set`` does); of several
    (``--bf16``, ``--fp16``), the one whose value ``message`` names first."""
    flags = [flag for table in (MEGATRON_FLAGS, BOOL_FLAGS) for flag, (k, *_) in table.items() if k == key]
    hits = [(message.find(str(BOOL_FLAGS[f][1])), f) for f in flags if f in BOOL_FLAGS]
    other = {"data.paths": "--data-path", "training.profile_ranks": "--profile-ranks"}.get(key)
    return min((h for h in hits if h[0] >= 0), default=(0, flags[0] if flags else other))[1]


_LEADING_KEY = re.compile(r"^([a-z_]+\.[a-z_0-9]+)(?=[:= ])")


def name_flag(message: str, known_options=None) -> str:
    """``message`` with the flag of the key it starts with named after the key:
    ``optimizer.lr: ...`` -> ``optimizer.lr (--lr): ...`` (only flags in ``known_options``, when given)."""
    match = _LEADING_KEY.match(message)
    if not match:
        return message
    flag = flag_for_key(match.group(1), message[match.end() :])
    if flag is None or (known_options is not None and flag not in known_options):
        return message
    return f"{match.group(1)} ({flag}){message[match.end() :]}"


def load_config(path: str | Path, overrides: Optional[list] = None, check_data: bool = True) -> ExperimentConfig:
    """Read ``path``, apply ``overrides`` [(dotted key, value, source)], validate."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config: {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return config_from_raw(without_checkpoint_record(raw, str(path)), str(path), overrides, check_data)


def config_from_raw(
    raw: dict, source: str, overrides: Optional[list] = None, check_data: bool = True
) -> ExperimentConfig:
    """The validated config of the mapping ``raw`` (read from ``source``) with ``overrides`` applied."""
    cfg = build_dataclass(ExperimentConfig, raw, source=source, prefix="")
    for key, value, where in overrides or []:
        set_dotted(cfg, key, value, where)
    # relative data/tokenizer paths are taken from the current directory, as Megatron-LM does
    return cfg.validate(check_data=check_data)


CHECKPOINT_SECTION = "checkpoint"


def without_checkpoint_record(raw: dict, source: str) -> dict:
    """``raw`` minus the ``checkpoint:`` section a checkpoint's run_config.yaml carries."""
    if CHECKPOINT_SECTION not in raw:
        return raw
    if not isinstance(raw[CHECKPOINT_SECTION], dict):
        raise ConfigError(
            f"{source}: {CHECKPOINT_SECTION} must be a mapping (the record a checkpoint's run_config.yaml carries)"
        )
    return {k: v for k, v in raw.items() if k != CHECKPOINT_SECTION}


def config_from_dict(raw: dict, check_data: bool = False) -> ExperimentConfig:
    cfg = build_dataclass(ExperimentConfig, raw, source="<dict>", prefix="")
    return cfg.validate(check_data=check_data)


def build_dataclass(cls, raw: Any, source: str, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping")
    if cls is ModelConfig:
        warn_flat_plan_keys(raw, source)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{_did_you_mean(prefix, str(key), names)}")
        kwargs[key] = _coerce(hints[key], value, source, f"{prefix}{key}")
    return cls(**kwargs)


def set_dotted(cfg: ExperimentConfig, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    if parts[:2] == ["model", "plan"]:
        set_plan(cfg.model, parts[2:], value, source, key)
        return
    obj = cfg
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if part not in names:
            rest = "".join("." + p for p in parts[i + 1 :])
            hint = _did_you_mean(".".join(parts[:i]) + "." if i else "", part, names, rest) if names else ""
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
        if i == len(parts) - 1:
            if obj is cfg.model:
                warn_flat_plan_keys({"plan": cfg.model.plan, part: value}, source)
            hint = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(hint, value, source, key))
        else:
            obj = getattr(obj, part)


def set_plan(model: ModelConfig, rest: list, value: Any, source: str, key: str) -> None:
    """``model.plan=KIND`` (the kind; its options keep their values), ``model.plan={kind: ..., ...}``
    (a whole section) or ``model.plan.OPTION=VALUE`` (one option of the current kind)."""
    if len(rest) > 1:
        raise ConfigError(f"{source}: unknown key '{key}' (a plan option is model.plan.OPTION)")
    if rest:
        model.set_plan_option(rest[0], value, source)
    elif isinstance(value, dict):
        model.read_plan_section(value, source)
    elif isinstance(value, str):
        model.plan = value
    else:
        raise ConfigError(f"{source}: {key} must be a plan kind or a section {{kind: ..., ...}} (got {value!r})")


def _coerce(hint, value, source: str, key: str):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, source, key + ".")
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, source, key)
    if value is None:
        raise ConfigError(f"{source}: {key} may not be null")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif hint is list or origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [value]
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{source}: {key} must be {name} (got {value!r})")


def coerce_value(hint, value: Any, source: str, key: str) -> Any:
    """``value`` as type ``hint`` (a one-line ConfigError naming ``key`` otherwise): also for the
    options of a plan kind's section, typed by its ``Options`` dataclass."""
    return _coerce(hint, value, source, key)


def _did_you_mean(prefix: str, name: str, names, rest: str = "") -> str:
    """`` (did you mean 'section.key'?)`` for a mistyped key: a section's key in the wrong
    place (``training.lr`` -> ``optimizer.lr``), else the closest name of the same section."""
    hints = typing.get_type_hints(ExperimentConfig)
    elsewhere = [
        f"{section}.{name}" for section in hints if name in {f.name for f in dataclasses.fields(hints[section])}
    ]
    if elsewhere and f"{prefix}{name}" not in elsewhere:
        return f" (did you mean {' or '.join(repr(e) for e in elsewhere)}?)"
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}{rest}'?)"
    return ""


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
