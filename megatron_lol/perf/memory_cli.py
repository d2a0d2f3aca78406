"""``megatron-lol memory``: the per-rank memory of a config's layout before a run (see :mod:`.memory`).

    megatron-lol memory --config F --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --use-distributed-optimizer --world-size 8 [--device-memory 80] [--json]

Takes the layout flags ``train`` takes; the data-parallel size is the rest of
``--world-size`` (default ``WORLD_SIZE``, else the smallest world the layout
needs). Nothing is built and megatron-core is not imported.

The estimate is for the device the run will have, not the machine that asks:
``--target gpu`` (the default) resolves ``model.precision.params_dtype: auto`` to BF16 as
a GPU run does, also on a CPU login node, and compares with ``--device-memory``
(else the local CUDA device's memory, if there is one); ``--target cpu``
estimates a CPU run (FP32, compared with this machine's RAM).
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_lol.config.target import TARGETS, device_target
from megatron_lol.errors import CliError


def name_is_cuda(name: str) -> bool:
    """Whether :func:`~megatron_lol.perf.memory.device_memory_bytes` measured a CUDA device (not RAM)."""
    return name not in ("this machine's RAM", "unknown")


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
        "--target",
        choices=TARGETS,
        default="gpu",
        help="the device the run will have (default gpu: params_dtype auto is bf16, whatever this machine has)",
    )
    group.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory per device in GiB to compare with (default: the local CUDA device's for a gpu target, "
        "RAM for a cpu target)",
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

    with device_target(args.target):
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
        if (args.target == "gpu") != name_is_cuda(name):
            device, name = None, "unknown"  # the local machine is not the target: nothing to compare with
    if args.json:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "layout": vars(layout),
                    "world_size": layout.world,
                    "vocab_size": vocab,
                    "target": args.target,
                    "params_dtype": cfg.model.precision.params_dtype,
                    "device_memory_bytes": device,
                    "ranks": [r.to_dict() for r in ranks],
                }
            )
        )
    else:
        print(format_estimate(cfg, ranks, layout, device, name))
        if device is None and args.target == "gpu":
            print("  (--device-memory GIB compares with the target GPU's memory)")
    return 0
