"""``megatron-lol memory``: the per-rank memory of a config's layout before a run (see :mod:`.memory`).

    megatron-lol memory --config F --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --use-distributed-optimizer --world-size 8 [--device-memory 80] [--json]

Takes the layout flags ``train`` takes; the data-parallel size is the rest of
``--world-size`` (default ``WORLD_SIZE``, else the smallest world the layout
needs). Nothing is built and megatron-core is not imported.
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_lol.errors import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lol.config import add_config_arguments
    from megatron_lol.config.loader import MEMORY_GROUPS

    add_config_arguments(parser, groups=MEMORY_GROUPS)
    group = parser.add_argument_group("estimate")
    group.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks of the run (default: WORLD_SIZE, else the smallest the layout needs)",
    )
    group.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory per device in GiB to compare with (default: the CUDA device's, else RAM)",
    )
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="vocabulary size (default: model.vocab_size, else the config's tokenizer)",
    )
    group.add_argument("--json", action="store_true", help="print the estimate as one JSON object")


def run(args: argparse.Namespace) -> int:
    from megatron_lol.config import config_from_args
    from megatron_lol.perf.memory import Layout, device_memory_bytes, format_estimate, rank_memory
    from megatron_lol.perf.params_cli import resolve_vocab

    cfg = config_from_args(args, check_data=False)
    world = (
        args.world_size
        if args.world_size is not None
        else (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    )
    if world is not None and world < 1:
        raise CliError(f"--world-size: must be >= 1 (got {world})")
    args.no_pad_vocab = False
    _, vocab = resolve_vocab(args, cfg)
    layout = Layout.of(cfg, world)
    ranks = [rank_memory(cfg, vocab, layout, r) for r in range(layout.pp)]
    if args.device_memory is not None:
        if args.device_memory <= 0:
            raise CliError(f"--device-memory: must be > 0 GiB (got {args.device_memory})")
        device, name = args.device_memory * 2**30, "the device"
    else:
        device, name = device_memory_bytes()
    if args.json:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "layout": vars(layout),
                    "world_size": layout.world,
                    "vocab_size": vocab,
                    "device_memory_bytes": device,
                    "ranks": [r.to_dict() for r in ranks],
                }
            )
        )
    else:
        print(format_estimate(cfg, ranks, layout, device, name))
    return 0
