"""Read megatron-lol training checkpoints on CPU, without process groups.

A checkpoint directory (``--save`` of ``megatron-lol train``) holds
``latest_checkpointed_iteration.txt`` (written only after a complete save) and
one ``iter_%07d/`` directory per save: a megatron-core ``torch_dist``
distributed checkpoint whose tensors have their *global* (unsharded) shapes,
whatever the parallel layout (TP, PP, EP, DP, distributed optimizer) that
wrote it, plus ``run_config.yaml`` (the ``ExperimentConfig``).

:class:`DistCheckpointReader` reads one tensor at a time through
``torch.distributed.checkpoint`` with ``no_dist=True``: the chunks written by
every rank are assembled into the global tensor and nothing else is held in
memory. Tensor payloads are read with ``torch.load(weights_only=True)`` (torch's
own reader) and the ``.metadata`` index with the restricted unpickler of
:mod:`megatron_lol.training.checkpointing.safe_load`, which only admits the
checkpoint-metadata classes of ``torch.distributed.checkpoint``: reading a
checkpoint never runs arbitrary pickled code. Each ``.distcp`` file is checked
against the checkpoint's ``checksums.json`` before its first tensor is read.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Optional

import torch

from megatron_lol.errors import CliError
from megatron_lol.training.checkpointing.files import RUN_CONFIG, TRACKER, read_manifest, verify_files
from megatron_lol.training.checkpointing.safe_load import read_metadata_file, restricted_unpickling


def check_output_apart(save: str, load: str) -> None:
    """Refuse an output directory that is, contains or lies inside the checkpoint directory,
    or that holds a training checkpoint: replacing it (``--force``) would delete the run."""
    out, src = os.path.realpath(save), os.path.realpath(load)
    if out == src or src.startswith(out + os.sep) or out.startswith(src + os.sep):
        raise CliError(
            f"--save {save} overlaps --load {load}: write the HuggingFace model to a directory outside the checkpoint"
        )
    if os.path.isdir(out) and (
        os.path.exists(os.path.join(out, TRACKER))
        or os.path.exists(os.path.join(out, ".metadata"))
        or any(re.fullmatch(r"iter_\d{7,}", d) for d in os.listdir(out))
    ):
        raise CliError(f"--save {save} holds a training checkpoint; not replacing it (choose another directory)")


def iteration_dir(load: str, iteration: Optional[int] = None) -> tuple[str, int]:
    """The ``iter_%07d`` directory to read: ``iteration`` if given, else the tracker's."""
    if not os.path.isdir(load):
        raise CliError(f"checkpoint directory {load} does not exist")
    if os.path.isfile(os.path.join(load, ".metadata")):
        return load, -1  # a bare iter_XXXXXXX directory was given
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            found = sorted(d for d in os.listdir(load) if re.fullmatch(r"iter_\d{7}", d))
            hint = f" (found {', '.join(found[-3:])}: pass --iteration N to choose one)" if found else ""
            raise CliError(f"{load} has no {TRACKER}: not a complete megatron-lol checkpoint{hint}")
        text = open(tracker).read().strip()
        if not re.fullmatch(r"\d+", text):
            raise CliError(f"{tracker} does not hold an iteration number (got {text[:40]!r})")
        iteration = int(text)
    path = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise CliError(f"{load}: iteration {iteration} has no directory {os.path.basename(path)}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CliError(f"{path} is not a torch_dist checkpoint (no .metadata): incomplete save?")
    return path, iteration


def read_run_config(path: str, load: str):
    """``(ExperimentConfig, checkpoint_info, yaml_path)`` saved with the checkpoint.

    ``run_config.yaml`` (in ``path``, else in ``load``) is the run's config plus a
    top-level ``checkpoint:`` section (iteration, tokenizer with ``eod_id`` and
    copied files, layout) that is not a config key.
    """
    import yaml

    from megatron_lol.config import config_from_dict

    for directory in (path, load, os.path.dirname(os.path.abspath(path))):
        candidate = os.path.join(directory, RUN_CONFIG)
        if os.path.isfile(candidate):
            with open(candidate) as f:
                raw = yaml.safe_load(f) or {}
            if not isinstance(raw, dict):
                raise CliError(f"{candidate} is not a YAML mapping")
            info = raw.pop("checkpoint", None) or {}
            try:
                cfg = config_from_dict(raw)
                cfg.model.validate()
            except CliError as err:
                raise CliError(f"{candidate}: {err}") from None
            return cfg, info, candidate
    raise CliError(f"{path} has no {RUN_CONFIG}; pass --config with the training YAML")


class DistCheckpointReader:
    """Global tensors of a ``torch_dist`` checkpoint directory, one key at a time."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        meta_json = os.path.join(path, "metadata.json")
        if os.path.isfile(meta_json):
            try:
                backend = json.load(open(meta_json)).get("sharded_backend")
            except (OSError, ValueError) as err:
                raise CliError(f"{meta_json} is unreadable: {err}") from None
            if backend not in (None, "torch_dist"):
                raise CliError(f"{path}: sharded backend {backend!r} is not supported (only torch_dist)")
        self.metadata = read_metadata_file(path)  # the restricted unpickler: no code runs
        reader = FileSystemReader(path)
        metadata = self.metadata
        reader.read_metadata = lambda *a, **k: metadata  # parsed once, above
        self.reader = reader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._verified: set = set()

    def _verify_file_of(self, key: str) -> None:
        """Check the files holding ``key`` against ``checksums.json`` (once each) before reading."""
        files = read_manifest(self.path)
        if files is None:
            return
        storage = getattr(self.metadata, "storage_data", None) or {}
        rels = {info.relative_path for index, info in storage.items() if getattr(index, "fqn", None) == key}
        todo = sorted(r for r in rels if r in files and r not in self._verified)
        problem = verify_files(self.path, files, todo)
        if problem is not None:
            raise CliError(problem)
        self._verified.update(todo)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple:
        return tuple(self.tensors[key].size)

    def read(self, key: str) -> torch.Tensor:
        """The global tensor ``key`` assembled from every rank's chunks."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        md = self.tensors[key]
        self._verify_file_of(key)
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
        if covered < out.numel():
            raise CliError(
                f"{self.path}: tensor {key} is incomplete in the checkpoint ({covered} of {out.numel()} elements saved)"
            )
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                with restricted_unpickling():
                    load(
                        {key: out},
                        storage_reader=self.reader,
                        planner=DefaultLoadPlanner(allow_partial_load=True),
                        no_dist=True,
                    )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            msg = str(err).strip().splitlines()
            detail = next((line for line in reversed(msg) if line.strip()), type(err).__name__)
            raise CliError(
                f"{self.path}: cannot read tensor {key} (corrupted or truncated .distcp file?): {detail[:200]}"
            ) from None
        return out
