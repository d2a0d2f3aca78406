"""Training-side datasets: blends, splits and document boundaries.

``build_train_valid_test_datasets`` builds megatron-core ``GPTDataset`` splits
(weighted ``BlendedDataset`` when several prefixes are given) through
``BlendedMegatronDatasetBuilder``, with the sample indices cached under
``cache_dir``. Samples are megatron's: ``tokens``, ``labels``, ``loss_mask``,
``position_ids``. Position ids and attention masks are NOT reset at document
boundaries here: the model derives the boundaries from the EOD token with
``document_ids`` / ``document_positions`` below.

Convention: the EOD token is the LAST token of the document it ends; the token
after it starts a new document.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import torch


def parse_blend(paths) -> tuple:
    """Megatron's blend list -> (prefixes, weights or None); ValueError names the entry."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise ValueError("data.paths is empty")
    if len(paths) == 1:
        prefixes, weights = [paths[0]], None
    else:
        if len(paths) % 2:
            raise ValueError(
                f"data.paths must be [weight, prefix, weight, prefix, ...] or [prefix]; "
                f"got an odd-length list of {len(paths)}: {paths}"
            )
        prefixes, weights = [], []
        for w, p in zip(paths[0::2], paths[1::2]):
            try:
                wf = float(w)
            except ValueError:
                raise ValueError(f"data.paths: weight {w!r} for {p} is not a number") from None
            if not math.isfinite(wf) or wf < 0:
                raise ValueError(f"data.paths: weight {w!r} for {p} must be a finite number >= 0")
            weights.append(wf)
            prefixes.append(p)
        if sum(weights) <= 0:
            raise ValueError(f"data.paths: weights sum to zero: {paths}")
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                hint = " (give the prefix, without .bin/.idx)" if p.endswith((".bin", ".idx")) else ""
                raise ValueError(f"dataset {p}: missing {p + ext}{hint}")
    return prefixes, weights


def build_train_valid_test_datasets(
    paths: list,
    split: str,
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    num_samples: tuple,
    tokenizer,
):
    """(train, valid, test) megatron-core datasets; a split with 0 samples/weight is None."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_blend(paths)
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"split {split!r}: expected numbers like '98,1,1'") from None
    if len(parts) > 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
        raise ValueError(f"split {split!r}: expected up to 3 non-negative weights like '98,1,1'")
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    sizes = [int(n) if n is not None else None for n in num_samples]
    if len(sizes) != 3:
        raise ValueError(f"num_samples must have 3 entries (train, valid, test), got {num_samples}")
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
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    with _process_group_for_build():
        train, valid, test = builder.build()
    return train, valid, test


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


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Index of the document each token belongs to, counted from 0 in each row.

    The EOD token belongs to the document it ends (the model's own rule:
    :class:`megatron_lol.model.windows.DocumentLayout`).
    """
    from megatron_lol.model.windows import DocumentLayout

    doc = DocumentLayout.from_tokens(tokens, eod_id).doc_index
    return doc - doc[:, :1]


def document_positions(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Position of each token counted from the start of its document (0-based)."""
    from megatron_lol.model.windows import DocumentLayout

    return DocumentLayout.from_tokens(tokens, eod_id).positions
