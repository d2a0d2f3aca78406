"""``megatron-lol train``: pretrain from a YAML config (and Megatron-LM-style flags).

Launch with ``torchrun --nproc-per-node N -m megatron_lol train --config ...``
(or the console script); the backend (gloo on CPU, NCCL on GPU) follows the device.
"""

from __future__ import annotations

import argparse
import sys

from megatron_lol.config import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import os

    cfg = config_from_args(args)  # validates everything before any process group work
    cfg.parallel.data_parallel_size(int(os.environ.get("WORLD_SIZE", "1")))  # layout vs world size
    from megatron_lol.training.console import announce_startup

    announce_startup(cfg, args.config)  # before the heavy imports (megatron-core: 5-25 s)
    from megatron_lol.log import log_rank0
    from megatron_lol.training.trainer import Trainer

    trainer = Trainer(cfg).setup()
    try:
        outcome = trainer.train()
    except FloatingPointError as err:
        log_rank0(f"megatron-lol train: error: {err}")
        return 3
    return outcome.exit_code


if __name__ == "__main__":  # pragma: no cover
    from megatron_lol.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
