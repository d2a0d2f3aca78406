"""Console output of multi-process runs: one helper, so every module prints alike."""

from __future__ import annotations


def is_rank0() -> bool:
    """True outside ``torch.distributed`` or on global rank 0."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def log_rank0(msg: str) -> None:
    """Print ``msg`` (flushed) on global rank 0 only."""
    if is_rank0():
        print(msg, flush=True)
