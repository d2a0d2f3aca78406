"""megatron-core's dataset index cache, read without pickle and written atomically.

``GPTDataset`` and ``BlendedDataset`` cache their sample indices as ``.npy``
files and read them back with ``numpy.load(allow_pickle=True)``: a file
planted in the cache directory would be unpickled, and a file cut short by a
``kill -9`` during the write breaks every later run. The subclasses here keep
megatron-core's index construction and file names, but

* read a cache with ``numpy.load(allow_pickle=False, mmap_mode="r")`` and
  rebuild it (with a log line) when a file is unreadable, truncated, holds
  pickled data or does not match its description;
* let megatron-core write a new cache into a private directory next to the
  cache and rename each file into place, the description last, so a reader
  never sees a partial cache;
* refuse (:class:`DatasetError`) instead of looping forever when a split that
  must provide samples has no tokens (megatron-core's ``_get_num_epochs`` would
  spin).

:class:`SafeCacheBuilder` is megatron-core's ``BlendedMegatronDatasetBuilder``
building these classes.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
from typing import Callable, Optional

import numpy as np
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset

from megatron_lol.data.indexed import DatasetError
from megatron_lol.log import log_rank0
from megatron_lol.process_guard import pid_alive


class _NoPickleCache:
    """The cache logic shared by both dataset classes (``self`` is a megatron dataset)."""

    def _cached_or_built(self, directory: Optional[str], split_name: str, names: tuple, build: Callable):
        if (
            not directory
            or getattr(self.config, "defer_npy_index_mmap", False)
            or getattr(self.config, "fast_cache_load", False)
        ):
            return build()
        base = f"{self.unique_description_hash}-{type(self).__name__}-{split_name}"
        paths = [os.path.join(directory, f"{base}-{name}") for name in names]
        description = os.path.join(directory, f"{base}-description.txt")
        arrays = self._read(description, paths)
        if arrays is not None:
            return arrays
        import torch

        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            # megatron-core builds on rank 0 first; the others read what it wrote
            raise DatasetError(
                f"{description}: not readable after rank 0 built the index cache: "
                f"data.cache_dir must be a directory every rank shares"
            )
        os.makedirs(directory, exist_ok=True)
        _remove_dead_builds(directory)
        private = os.path.join(directory, f".build-{os.getpid()}-{socket.gethostname()}")
        os.makedirs(private, exist_ok=True)
        saved = self.config
        self.config = copy.copy(saved)
        self.config.path_to_cache = private
        try:
            arrays = build()
            for path in paths + [description]:
                os.replace(os.path.join(private, os.path.basename(path)), path)
        finally:
            self.config = saved
            shutil.rmtree(private, ignore_errors=True)
        return arrays

    def _read(self, description: str, paths: list) -> Optional[tuple]:
        if not all(os.path.isfile(p) for p in [description, *paths]):
            return None
        try:
            with open(description) as f:
                if f.read() != self.unique_description:
                    raise ValueError("its description differs from this dataset's")
            return tuple(np.load(p, allow_pickle=False, mmap_mode="r") for p in paths)
        except (OSError, ValueError, EOFError) as err:
            log_rank0(f" data: index cache {paths[0]} (and siblings) unusable ({str(err)[:120]}); rebuilding it")
            return None


def _remove_dead_builds(directory: str) -> None:
    host = socket.gethostname()
    for name in os.listdir(directory):
        if not name.startswith(".build-"):
            continue
        pid, _, owner = name[len(".build-") :].partition("-")
        if pid.isdigit() and owner == host and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class SafeGPTDataset(_NoPickleCache, GPTDataset):
    """megatron-core's ``GPTDataset`` with the cache of this module and an empty-split check."""

    def _build_document_sample_shuffle_indices(self):
        directory = self.config.path_to_cache
        if directory is None and not self.config.mock:  # megatron-core's default place
            directory = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        return self._cached_or_built(
            directory,
            self.index_split.name,
            ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
            super()._build_document_sample_shuffle_indices,
        )

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        if num_tokens_per_epoch <= 0:
            if not self.num_samples:
                return 1  # nothing is asked of this split
            raise DatasetError(
                f"{self.dataset_path}.idx: the {self.index_split.name} split holds no tokens, "
                f"but {self.num_samples} samples are needed from it"
            )
        return super()._get_num_epochs(num_tokens_per_epoch)


class SafeBlendedDataset(_NoPickleCache, BlendedDataset):
    """megatron-core's ``BlendedDataset`` with the cache of this module."""

    def _build_indices(self):
        return self._cached_or_built(
            self.config.path_to_cache,
            self.split.name,
            ("dataset_index.npy", "dataset_sample_index.npy"),
            super()._build_indices,
        )


class SafeCacheBuilder(BlendedMegatronDatasetBuilder):
    """Builds :class:`SafeBlendedDataset` where megatron-core builds ``BlendedDataset``."""

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        if cls is BlendedDataset:
            cls = SafeBlendedDataset
        return BlendedMegatronDatasetBuilder.build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args)
