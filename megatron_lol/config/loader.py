"""YAML -> :class:`ExperimentConfig`, with dotted overrides and Megatron-LM flags.

Unknown keys and values of the wrong type are errors naming the file and the
dotted key: a typo in a config must never silently fall back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_lol.config.schema import ConfigError, ExperimentConfig

# Megatron-LM flag -> dotted config key. Only settings people change most.
MEGATRON_FLAGS: dict[str, str] = {
    "--train-iters": "training.train_iters",
    "--save": "training.save",
    "--load": "training.load",
    "--save-interval": "training.save_interval",
    "--log-interval": "training.log_interval",
    "--eval-interval": "training.eval_interval",
    "--eval-iters": "training.eval_iters",
    "--seed": "training.seed",
    "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size",
    "--seq-length": "training.seq_length",
    "--exit-duration-in-mins": "training.exit_duration_in_mins",
    "--lr": "optimizer.lr",
    "--min-lr": "optimizer.min_lr",
    "--clip-grad": "optimizer.clip_grad",
    "--weight-decay": "optimizer.weight_decay",
    "--lr-warmup-iters": "optimizer.lr_warmup_iters",
    "--lr-decay-style": "optimizer.lr_decay_style",
    "--tensor-model-parallel-size": "parallel.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel.pipeline_model_parallel_size",
    "--virtual-pipeline-model-parallel-size": "parallel.virtual_pipeline_model_parallel_size",
    "--expert-model-parallel-size": "parallel.expert_model_parallel_size",
    "--tokenizer-model": "data.tokenizer_model",
    "--tokenizer-type": "data.tokenizer_type",
    "--split": "data.split",
    "--fp8-format": "model.fp8",
    "--fp8-recipe": "model.fp8_recipe",
    "--fp8-margin": "model.fp8_margin",
    "--fp8-amax-history-len": "model.fp8_amax_history_len",
    "--fp8-amax-compute-algo": "model.fp8_amax_compute_algo",
}
BOOL_FLAGS: dict[str, tuple[str, bool]] = {
    "--sequence-parallel": ("parallel.sequence_parallel", True),
    "--use-distributed-optimizer": ("parallel.use_distributed_optimizer", True),
    "--no-resume": ("training.resume", False),
    "--async-save": ("training.async_save", True),
    "--bf16": ("model.params_dtype", "bf16"),
    "--fp16": ("model.params_dtype", "fp16"),  # refused by validation, with the reason
}
# Megatron-LM flag -> (dotted key, {flag value: config value})
CHOICE_FLAGS: dict[str, tuple[str, dict]] = {
    "--transformer-impl": ("model.use_transformer_engine", {"transformer_engine": True, "local": False}),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML experiment config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value by dotted key, e.g. --set model.num_blocks=8")
    parser.add_argument("--data-path", nargs="+", default=None,
                        help="Megatron blend: PREFIX or W1 PREFIX1 W2 PREFIX2 ... (data.paths)")
    for flag, key in MEGATRON_FLAGS.items():
        parser.add_argument(flag, dest=_dest(flag), default=None, help=f"sets {key}")
    for flag, (key, _) in BOOL_FLAGS.items():
        parser.add_argument(flag, dest=_dest(flag), action="store_true", help=f"sets {key}")
    for flag, (key, values) in CHOICE_FLAGS.items():
        parser.add_argument(flag, dest=_dest(flag), default=None, choices=sorted(values), help=f"sets {key}")


def config_from_args(args: argparse.Namespace, check_data: bool = True) -> ExperimentConfig:
    overrides: list[tuple[str, Any, str]] = []
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        overrides.append((key.strip(), yaml.safe_load(raw), f"--set {item}"))
    if args.data_path:
        overrides.append(("data.paths", list(args.data_path), "--data-path"))
    for flag, key in MEGATRON_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides.append((key, yaml.safe_load(value), flag))
    for flag, (key, value) in BOOL_FLAGS.items():
        if getattr(args, _dest(flag), False):
            overrides.append((key, value, flag))
    for flag, (key, values) in CHOICE_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides.append((key, values[value], flag))
    return load_config(args.config, overrides, check_data=check_data)


def load_config(path: str | Path, overrides: Optional[list] = None, check_data: bool = True
                ) -> ExperimentConfig:
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
    cfg = build_dataclass(ExperimentConfig, raw, source=str(path), prefix="")
    for key, value, source in overrides or []:
        set_dotted(cfg, key, value, source)
    # relative data/tokenizer paths are taken from the current directory, as Megatron-LM does
    return cfg.validate(check_data=check_data)


def config_from_dict(raw: dict, check_data: bool = False) -> ExperimentConfig:
    cfg = build_dataclass(ExperimentConfig, raw, source="<dict>", prefix="")
    return cfg.validate(check_data=check_data)


def build_dataclass(cls, raw: Any, source: str, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'")
        kwargs[key] = _coerce(hints[key], value, source, f"{prefix}{key}")
    return cls(**kwargs)


def set_dotted(cfg: ExperimentConfig, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise ConfigError(f"{source}: unknown key '{key}'")
        if i == len(parts) - 1:
            hint = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(hint, value, source, key))
        else:
            obj = getattr(obj, part)


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


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
