"""Checkpoint, tokenizer and data loading for ``megatron-lol analyze`` (one process, TP=PP=1).

A checkpoint is a ``--save`` directory of ``megatron-lol train`` (or one of its
``iter_XXXXXXX`` directories). The model is rebuilt from the ``run_config.yaml``
saved with it and its weights are read with megatron-core's ``dist_checkpointing``
(the same call the trainer's :class:`~megatron_lol.training.checkpointing.Checkpointer`
makes), whatever parallel layout wrote it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from megatron_lol.data.datasets import split_range  # noqa: F401 - also used by evaluate (data layer)
from megatron_lol.errors import CliError

KEY_PREFIX = "model."
RUN_CONFIG = "run_config.yaml"
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class LoadedCheckpoint:
    model: object
    cfg: object  # ExperimentConfig
    info: dict  # the run_config's checkpoint section
    path: str  # iter_XXXXXXX directory read
    iteration: int
    tokenizer: object
    eod_id: Optional[int]


def ensure_single_process(seed: int = 1234) -> None:
    from megatron_lol.platform import init_distributed, setup_platform

    setup_platform()
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def resolve_iteration_dir(load: str, iteration: Optional[int] = None) -> tuple:
    if not os.path.isdir(load):
        raise CliError(f"checkpoint directory {load} does not exist")
    if os.path.isfile(os.path.join(load, ".metadata")):
        base = os.path.basename(os.path.normpath(load))
        return load, int(base[5:]) if base.startswith("iter_") and base[5:].isdigit() else -1
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            raise CliError(
                f"{load} has no {TRACKER}: not a complete megatron-lol checkpoint "
                f"(pass an iter_XXXXXXX directory or --iteration)"
            )
        text = open(tracker).read().strip()
        if not text.isdigit():
            raise CliError(f"{tracker} does not hold an iteration number")
        iteration = int(text)
    path = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CliError(f"{path} is not a complete torch_dist checkpoint")
    return path, iteration


def read_run_config(path: str, load: str) -> tuple:
    import yaml

    from megatron_lol.config import config_from_dict

    for directory in (path, load):
        candidate = os.path.join(directory, RUN_CONFIG)
        if os.path.isfile(candidate):
            with open(candidate) as f:
                raw = yaml.safe_load(f) or {}
            info = raw.pop("checkpoint", None) or {}
            cfg = config_from_dict(raw, check_data=False)
            return cfg, info, directory
    raise CliError(f"{path} has no {RUN_CONFIG}")


def build_tokenizer_from_info(info: dict, cfg, config_dir: str):
    """The run's tokenizer: files copied next to the checkpoint first, else the original paths."""
    from megatron_lol.data.tokenizers import build_tokenizer

    tok = info.get("tokenizer") or {}
    copied = tok.get("copied_files") or {}
    files = {}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        path = None
        if key in copied and os.path.isfile(os.path.join(config_dir, copied[key])):
            path = os.path.join(config_dir, copied[key])
        elif tok.get(key) and os.path.exists(tok[key]):
            path = tok[key]
        elif getattr(cfg.data, key, None) and os.path.exists(getattr(cfg.data, key)):
            path = getattr(cfg.data, key)
        files[key] = path
    kind = tok.get("type") or cfg.data.tokenizer_type
    try:
        return build_tokenizer(kind, **files)
    except Exception as err:  # noqa: BLE001 - surface as a user error
        raise CliError(f"cannot build the checkpoint's tokenizer ({kind}, {files}): {err}") from None


def _sharded_state_dict(model) -> dict:
    """The trainer's own key layout (``checkpointing.model_sharded_state_dict`` when it
    exists: it walks ModuleDicts that megatron's default would treat as replicated)."""
    try:
        from megatron_lol.training.checkpointing import model_sharded_state_dict
    except ImportError:
        return model.sharded_state_dict(prefix=KEY_PREFIX)
    return model_sharded_state_dict(model, KEY_PREFIX)


def load_checkpoint(load: str, iteration: Optional[int] = None, with_tokenizer: bool = True) -> LoadedCheckpoint:
    """Rebuild the model of a megatron-lol checkpoint in this process (eval mode)."""
    path, it = resolve_iteration_dir(load, iteration)
    cfg, info, config_dir = read_run_config(path, load)
    ensure_single_process(cfg.training.seed)
    from megatron_lol.model.lol_model import LoLGPTModel, padded_vocab_size
    from megatron_lol.platform import device

    tokenizer = build_tokenizer_from_info(info, cfg, config_dir) if with_tokenizer else None
    eod = (info.get("tokenizer") or {}).get("eod_id")
    if eod is None and tokenizer is not None:
        eod = getattr(tokenizer, "eod", None)
    vocab = cfg.model.vocab_size or info.get("padded_vocab_size")
    if not vocab:
        if tokenizer is None:
            raise CliError(f"{path}: vocab size unknown")
        vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.expert_model_parallel_size = 1
    cfg.parallel.virtual_pipeline_model_parallel_size = None
    model = LoLGPTModel(
        cfg.model, int(vocab), eod, max_sequence_length=cfg.training.seq_length, init_seed=cfg.training.seed
    )
    from megatron_lol.training.checkpointing.files import verify_checkpoint
    from megatron_lol.training.checkpointing.safe_load import load_sharded

    model.to(device())  # the weights load straight onto the platform's device (a no-op on CPU)
    verify_checkpoint(path)
    state = load_sharded(_sharded_state_dict(model), path)  # .metadata through the restricted unpickler
    model.load_state_dict({k[len(KEY_PREFIX) :]: v for k, v in state.items() if k.startswith(KEY_PREFIX)}, strict=True)
    return LoadedCheckpoint(
        model=model.eval(), cfg=cfg, info=info, path=path, iteration=it, tokenizer=tokenizer, eod_id=eod
    )


# ------------------------------------------------------------------ data
def read_indexed(prefix: str, part: str = "valid", split: str = "98,2,0", max_examples: int = 256) -> list:
    """Documents (token lists) of a Megatron indexed dataset ``prefix``: the ``part`` of
    the run's document split (``all`` = every document), at most ``max_examples``."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise CliError(f"dataset {prefix}: missing {prefix + ext} (give the prefix, without .bin/.idx)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    n = len(ds)
    lo, hi = (0, n) if part == "all" else split_range(split, part, n)
    if hi <= lo:
        raise CliError(f"{prefix}: the {part} part of split {split!r} holds no document of {n}; use --part all")
    return [ds[i].tolist() for i in range(lo, min(hi, lo + max_examples))]


def read_jsonl(
    path: str, tokenizer, text_field: str = "text", label_field: Optional[str] = None, max_examples: int = 256
) -> tuple:
    """``(token_lists, labels)`` from a JSON-lines file (labels None without ``label_field``)."""
    if not os.path.isfile(path):
        raise CliError(f"{path} does not exist")
    toks, labels = [], []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise CliError(f"{path}:{lineno}: not JSON: {err}") from None
            if text_field not in row:
                raise CliError(f"{path}:{lineno}: no field {text_field!r} (use --text-field)")
            if label_field is not None and label_field not in row:
                raise CliError(f"{path}:{lineno}: no label field {label_field!r}")
            ids = tokenizer.tokenize(str(row[text_field]))
            if not ids:
                continue
            toks.append(ids)
            labels.append(str(row[label_field]) if label_field is not None else None)
            if len(toks) >= max_examples:
                break
    if not toks:
        raise CliError(f"{path}: no non-empty example")
    return toks, (labels if label_field is not None else None)
