"""Console output of multi-process runs: one helper, so every module prints alike."""

from __future__ import annotations

import argparse

# MEGATRON_LOL_VERBOSE=1 does what --verbose does (megatron_lol/cli.py: the console hygiene it turns off)
VERBOSE_ENV = "MEGATRON_LOL_VERBOSE"


def is_rank0() -> bool:
    """True outside ``torch.distributed`` or on global rank 0."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def log_rank0(msg: str) -> None:
    """Print ``msg`` (flushed) on global rank 0 only."""
    if is_rank0():
        print(msg, flush=True)


def add_general_arguments(parser: argparse.ArgumentParser) -> None:
    """``--verbose``, accepted by every verb (and every ``analyze`` subcommand)."""
    group = parser.add_argument_group("general")
    group.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"show megatron-core's start-up warnings about missing Apex / Transformer "
        f"Engine in full (also {VERBOSE_ENV}=1)",
    )
