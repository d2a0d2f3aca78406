"""Training-side datasets: blends, splits and document boundaries.

``build_train_valid_test_datasets`` builds megatron-core ``GPTDataset`` splits
(weighted ``BlendedDataset`` when several prefixes are given) through
``BlendedMegatronDatasetBuilder``, with the sample indices cached under
``cache_dir``. Samples are megatron's: ``tokens``, ``labels``, ``loss_mask``,
``position_ids``. Position ids and attention masks are NOT reset at document
boundaries here: the model derives the boundaries from the EOD token
(``megatron_lol.model.windows.DocumentLayout``).

Convention: the EOD token is the LAST token of the document it ends; the token
after it starts a new document.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile

import numpy as np

from megatron_lol.data.indexed import DatasetError, validate_dataset


def parse_blend(paths) -> tuple:
    """Megatron's blend list -> (prefixes, weights or None); :class:`DatasetError` names the entry."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise DatasetError("data.paths is empty")
    if len(paths) == 1:
        prefixes, weights = [paths[0]], None
    else:
        if len(paths) % 2:
            raise DatasetError(
                f"data.paths must be [weight, prefix, weight, prefix, ...] or [prefix]; "
                f"got an odd-length list of {len(paths)}: {paths}"
            )
        prefixes, weights = [], []
        for w, p in zip(paths[0::2], paths[1::2]):
            try:
                wf = float(w)
            except ValueError:
                raise DatasetError(f"data.paths: weight {w!r} for {p} is not a number") from None
            if not math.isfinite(wf) or wf < 0:
                raise DatasetError(f"data.paths: weight {w!r} for {p} must be a finite number >= 0")
            weights.append(wf)
            prefixes.append(p)
        if sum(weights) <= 0:
            raise DatasetError(f"data.paths: weights sum to zero: {paths}")
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                hint = " (give the prefix, without .bin/.idx)" if p.endswith((".bin", ".idx")) else ""
                raise DatasetError(f"dataset {p}: missing {p + ext}{hint}")
    return prefixes, weights


def build_train_valid_test_datasets(
    paths: list,
    split: str,
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    num_samples: tuple,
    tokenizer,
    vocab_size: int | None = None,
):
    """(train, valid, test) megatron-core datasets; a split with 0 samples/weight is None.

    Before megatron-core reads anything, every dataset is validated
    (:func:`~megatron_lol.data.indexed.validate_dataset`), every split that must
    provide samples is checked to hold tokens, and, with ``vocab_size``, every
    token id is checked to be below it. Each failure is one
    :class:`DatasetError` line naming the file; all ranks reach the same verdict
    from the same files, so none is left waiting in a collective.
    """
    prefixes, weights = parse_blend(paths)
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise DatasetError(f"split {split!r}: expected numbers like '98,1,1'") from None
    if len(parts) > 3 or any(not math.isfinite(x) or x < 0 for x in parts) or sum(parts) <= 0:
        raise DatasetError(f"split {split!r}: expected up to 3 non-negative weights like '98,1,1'")
    if seq_length < 1:
        raise DatasetError(f"seq_length must be >= 1, got {seq_length}")
    sizes = [int(n) if n is not None else None for n in num_samples]
    if len(sizes) != 3:
        raise DatasetError(f"num_samples must have 3 entries (train, valid, test), got {num_samples}")
    headers = {p: validate_dataset(p) for p in prefixes}
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_lol.data.index_cache import SafeCacheBuilder, SafeGPTDataset

    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=",".join(str(x) for x in parts),
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    check_split_tokens(headers, weights, config.split_matrix, sizes, split)
    if vocab_size is not None:
        check_token_ids(headers, vocab_size, cache_dir)
    builder = SafeCacheBuilder(SafeGPTDataset, sizes, lambda: True, config)
    with _process_group_for_build():
        train, valid, test = builder.build()
    return train, valid, test


SPLIT_NAMES = ("train", "valid", "test")


def check_split_tokens(headers: dict, weights, split_matrix, sizes: list, split: str) -> None:
    """Every split that must provide samples gets documents with tokens from every blended
    dataset (megatron-core's document ranges: the split's bounds times the count, rounded)."""
    from megatron_lol.data.indexed import sequence_lengths

    weights = weights or [1.0] * len(headers)
    for i, bounds in enumerate(split_matrix):
        if bounds is None or not sizes[i]:
            continue
        for (prefix, h), w in zip(headers.items(), weights):
            if w <= 0:
                continue
            n = h.sequence_count
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            tokens = int(np.asarray(sequence_lengths(h)[beg:end]).sum(dtype=np.int64)) if end > beg else 0
            if tokens == 0:
                hint = ", or set training.eval_iters: 0" if i else ""
                raise DatasetError(
                    f"{prefix}.idx: data.split {split!r} gives the {SPLIT_NAMES[i]} split documents "
                    f"[{beg}, {end}) of {n}, which hold no tokens, but it must provide {sizes[i]} samples: "
                    f"use more documents or a larger {SPLIT_NAMES[i]} share{hint}"
                )


def check_token_ids(headers: dict, vocab_size: int, cache_dir: str | None) -> None:
    """Every token id of every dataset is below ``vocab_size`` (the model's embedding rows).

    The ranks share one read of each ``.bin`` (every rank scans its own chunks);
    the result is kept in ``cache_dir`` (keyed by the file's path, size and
    modification time) so later runs skip the scan. Rank 0 decides what to scan,
    so every rank takes the same path through the collectives.
    """
    import torch.distributed as dist

    from megatron_lol.data.indexed import scan_token_ids

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    todo = []
    if rank == 0:
        for prefix in headers:
            cached = _cached_max_id(prefix, cache_dir)
            if cached is None or cached >= vocab_size:
                todo.append(prefix)
    if distributed:
        box = [todo]
        dist.broadcast_object_list(box, src=0)
        todo = box[0]
    found = {prefix: scan_token_ids(prefix, headers[prefix], vocab_size, (rank, world)) for prefix in todo}
    gathered = [found]
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, found)
    for prefix in todo:
        max_id = max(part[prefix][0] for part in gathered)
        if rank == 0:
            _store_max_id(prefix, cache_dir, max_id)
        firsts = [part[prefix][1] for part in gathered if part[prefix][1] is not None]
        if firsts:
            _, doc, pos = min(firsts)
            raise DatasetError(
                f"{prefix}.bin: token ids reach {max_id}, outside the model's vocabulary of {vocab_size} "
                f"(the first at document {doc}, position {pos}): the dataset was made with another "
                f"tokenizer, or data.tokenizer_model / model.vocab_size is wrong"
            )


def _max_id_key(prefix: str) -> str:
    st = os.stat(prefix + ".bin")
    return f"{os.path.realpath(prefix + '.bin')}:{st.st_size}:{st.st_mtime_ns}"


def _max_id_file(cache_dir: str | None):
    return os.path.join(cache_dir, "max_token_ids.json") if cache_dir else None


def _cached_max_id(prefix: str, cache_dir: str | None):
    path = _max_id_file(cache_dir)
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            value = json.load(f).get(_max_id_key(prefix))
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _store_max_id(prefix: str, cache_dir: str | None, max_id: int) -> None:
    path = _max_id_file(cache_dir)
    if not path:
        return
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[_max_id_key(prefix)] = int(max_id)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


@contextlib.contextmanager
def _process_group_for_build():
    """megatron's BlendedDataset cache path calls torch.distributed.get_rank()
    unconditionally; outside a distributed job, hold a one-process gloo group
    for the duration of the build and tear it down afterwards."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def split_range(split: str, part: str, num_docs: int) -> tuple:
    """Document range of ``part`` (train/valid/test) under a ``98,2,0`` split: the
    normalised cumulative bounds times the document count, rounded (megatron's rule)."""
    weights = [float(x) for x in str(split).replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w / total)
    i = {"train": 0, "valid": 1, "test": 2}[part]
    return int(round(bounds[i] * num_docs)), int(round(bounds[i + 1] * num_docs))
