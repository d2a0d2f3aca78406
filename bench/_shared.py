"""What the benchmarks share: layer-size and thread flags, the single-process megatron setup."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def add_layer_size_args(p) -> None:
    """``--hidden``, ``--heads``, ``--ffn`` with the benchmarks' CPU defaults."""
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)


def add_threads_arg(p) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared 2-core machine two OpenMP threads per "
        "process thrash; 0 keeps torch's default)",
    )


def setup_megatron(threads: int, seed: int = 1234) -> None:
    """Thread count, then the CPU platform and a world-size-1 megatron-core state."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from megatron_lol.analysis.loading import ensure_single_process

    ensure_single_process(seed)
