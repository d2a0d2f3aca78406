"""``train --use-checkpoint-args``: the model shape and tokenizer of a run come from its checkpoint.

Megatron-LM's flag of that name reads the architecture arguments saved with a
checkpoint, so that a resume or a continued stage cannot be started with a model
that does not fit the weights. Here a checkpoint's ``run_config.yaml`` holds the
whole configuration of the run that saved it; with the flag:

* the ``model`` section and the tokenizer keys of ``data`` (``tokenizer_type``,
  ``tokenizer_model``, ``vocab_file``, ``merge_file``; the copy saved in the
  checkpoint when there is one) are the checkpoint's, whatever ``--config`` says;
* everything else is ``--config``'s, or, without ``--config``, the checkpoint's;
* flags and ``--set`` are applied last and win, as explicit command-line
  arguments win over checkpoint arguments in Megatron-LM.

Which checkpoint: the one ``--save`` resumes from (its tracker), else ``--load``'s
(at ``training.load_iteration`` when set). Nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_lol.config.loader import config_from_raw, without_checkpoint_record
from megatron_lol.config.migration import RUNTIME_KEYS
from megatron_lol.config.schema import ConfigError, ExperimentConfig
from megatron_lol.training.checkpointing.files import checkpoint_dir, latest_checkpoint

TOKENIZER_KEYS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def _setting(overrides: list, raw: dict, key: str) -> Any:
    """The value ``key`` will have: the last override of it, else the YAML's."""
    for k, value, _ in reversed(overrides):
        if k == key:
            return value
    section, name = key.split(".")
    return (raw.get(section) or {}).get(name)


def checkpoint_iteration_dir(overrides: list, raw: dict) -> tuple[str, str]:
    """``(iter_ directory, the flag it came from)`` of the checkpoint this run starts from."""
    save, load = _setting(overrides, raw, "training.save"), _setting(overrides, raw, "training.load")
    resume = _setting(overrides, raw, "training.resume")
    if save and resume is not False:
        iteration = latest_checkpoint(str(save))
        if iteration is not None:
            return checkpoint_dir(str(save), iteration), "--save"
    if load:
        iteration = _setting(overrides, raw, "training.load_iteration")
        iteration = latest_checkpoint(str(load)) if iteration is None else int(iteration)
        if iteration is not None:
            return checkpoint_dir(str(load), iteration), "--load"
    named = ", ".join(f"{flag} {value}" for flag, value in (("--save", save), ("--load", load)) if value)
    raise ConfigError(
        f"--use-checkpoint-args: no checkpoint to take the arguments from "
        f"({named or 'neither --save nor --load is given'})"
    )


def read_checkpoint_config(directory: str) -> tuple[dict, dict]:
    """``(config mapping, checkpoint record)`` of ``directory/run_config.yaml``."""
    path = os.path.join(directory, "run_config.yaml")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"--use-checkpoint-args: cannot read {path} ({err.strerror})") from None
    except yaml.YAMLError:
        raise ConfigError(f"--use-checkpoint-args: {path} is not valid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--use-checkpoint-args: {path} is not a YAML mapping")
    record = raw.get("checkpoint") or {}
    return without_checkpoint_record(raw, path), record


def config_with_checkpoint_args(config: Optional[str], overrides: list, check_data: bool = True) -> ExperimentConfig:
    """The validated config of a run started with ``--use-checkpoint-args`` (see the module docstring)."""
    raw: dict = {}
    if config:
        path = Path(config)
        if not path.exists():
            raise ConfigError(f"--config: {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            raise ConfigError(f"{path}: invalid YAML") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw = without_checkpoint_record(raw, str(path))
    directory, _ = checkpoint_iteration_dir(overrides, raw)
    saved, record = read_checkpoint_config(directory)
    if not config:
        merged = saved
    else:
        merged = {k: v for k, v in raw.items()}
        # the shape from the checkpoint; how it runs (a runtime key an earlier version kept in model) from the config
        merged["model"] = {k: v for k, v in (saved.get("model") or {}).items() if k not in RUNTIME_KEYS}
        data = dict(merged.get("data") or {})
        for key in TOKENIZER_KEYS:
            data[key] = (saved.get("data") or {}).get(key)
        merged["data"] = data
    copied = ((record.get("tokenizer") or {}).get("copied_files")) or {}
    for key, rel in copied.items():
        if key in TOKENIZER_KEYS and os.path.isfile(os.path.join(directory, rel)):
            merged.setdefault("data", {})[key] = os.path.join(directory, rel)
    source = f"{os.path.join(directory, 'run_config.yaml')} (--use-checkpoint-args)"
    return config_from_raw(merged, source, overrides, check_data)
