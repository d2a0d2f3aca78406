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

from megatron_lol.config.flags import BOOL_FLAGS, CHOICE_FLAGS, GROUPS, MEGATRON_FLAGS  # noqa: F401 - re-exported
from megatron_lol.config.migration import (
    FLAT_KEYS,
    MOVED_KEYS,
    OPTION_KEYS,
    ROUTING_KEYS,
    RUNTIME_KEYS,
    migrate_model,
    migrate_runtime,
    moved_key,
    refuse_runtime_key,
    runtime_key,
    set_flat_key,
)
from megatron_lol.config.schema import ConfigError, ExperimentConfig, ModelConfig

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


_LEADING_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)(?=[:= ])")  # model.precision.params_dtype too


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


def load_config(
    path: str | Path, overrides: Optional[list] = None, check_data: bool = True, validate: bool = True
) -> ExperimentConfig:
    """Read ``path``, apply ``overrides`` [(dotted key, value, source)], validate. ``validate=False``: the
    sections as written with the schema's defaults filled in, unchecked -- a quick read of a few keys
    (submit_pipeline.sh's tokenizer) without validation's import of torch (2 CPU seconds)."""
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
    raw = without_checkpoint_record(raw, str(path))
    if not validate:
        cfg = build_dataclass(ExperimentConfig, raw, source=str(path), prefix="")
        for key, value, where in overrides or []:
            set_dotted(cfg, key, value, where)
        return cfg
    return config_from_raw(raw, str(path), overrides, check_data)


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
    if cls is ExperimentConfig:
        raw = migrate_runtime(raw, source)  # model.routed_core -> parallel.routed_core
    if cls is ModelConfig:
        for key in RUNTIME_KEYS.keys() & raw.keys():  # the model section read alone: it cannot move them
            refuse_runtime_key(key, source)
        raw = migrate_model(raw, source)
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
    if parts[0] == "model" and len(parts) == 2 and parts[1] in RUNTIME_KEYS:
        key = runtime_key(parts[1], source)  # --set model.routed_core=...: parallel.routed_core
        parts = key.split(".")
    if parts[0] == "model" and len(parts) == 2 and parts[1] in MOVED_KEYS:
        key = moved_key(parts[1], source)  # --set model.moe.num_experts=...: model.moe.num_experts
        parts = key.split(".")
    if parts[:2] == ["model", "plan"]:
        set_plan(cfg.model, parts[2:], value, source, key)
        return
    if (
        parts[0] == "model"
        and len(parts) == 2
        and (parts[1] in FLAT_KEYS or parts[1] in ROUTING_KEYS or parts[1] in OPTION_KEYS)
    ):
        set_flat_key(cfg.model, parts[1], value, source)
        return
    obj = cfg
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if part not in names:
            rest = "".join("." + p for p in parts[i + 1 :])
            hint = _did_you_mean(".".join(parts[:i]) + "." if i else "", part, names, rest) if names else ""
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
        if i == len(parts) - 1:
            hint = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(hint, value, source, key))
        else:
            obj = getattr(obj, part)


def set_plan(model: ModelConfig, rest: list, value: Any, source: str, key: str) -> None:
    """``model.plan=KIND`` (the kind with its defaults), ``model.plan={kind: ..., ...}``
    (a whole section) or ``model.plan.OPTION=VALUE`` (one option of the current kind)."""
    if len(rest) > 2:
        raise ConfigError(f"{source}: unknown key '{key}' (a plan option is model.plan.OPTION[.KEY])")
    if len(rest) == 2:
        model.set_plan_option(rest[1], value, source, sub=rest[0])
    elif rest:
        model.set_plan_option(rest[0], value, source)
    elif isinstance(value, dict):
        model.read_plan_section(value, source)
    elif isinstance(value, str):
        model.read_plan_section({"kind": value}, source)
    else:
        raise ConfigError(f"{source}: {key} must be a plan kind or a section {{kind: ..., ...}} (got {value!r})")


def _coerce(hint, value, source: str, key: str):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):  # a section already read (a ModelConfig's fields passed on)
            return value
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
