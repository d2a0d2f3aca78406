"""``megatron-lol convert-hf``: the command line of :mod:`megatron_lol.convert.to_hf`.

Kept apart from the converter so that a mistake the command line alone shows (an
existing ``--save`` without ``--force``, a missing ``--load``) is refused at once,
before torch and the converter are imported (seconds, more on a busy node).
"""

from __future__ import annotations

import argparse
import os

from megatron_lol.errors import CliError


def refuse_early(args: argparse.Namespace) -> None:
    """The checks of :func:`~megatron_lol.convert.to_hf.convert_checkpoint` that need no import."""
    if not os.path.isdir(args.load):
        raise CliError(f"checkpoint directory {args.load} does not exist")
    save = args.save
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)) and not args.force:
        raise CliError(f"--save {save} exists and is not empty (pass --force to replace it)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the tracker's)")
    parser.add_argument("--save", required=True, help="output HuggingFace model directory")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="weight dtype (default: the run's model.precision.params_dtype)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer model file / directory (default: the run's data.tokenizer_model)"
    )
    parser.add_argument("--tokenizer-type", default=None, help="default: the run's data.tokenizer_type")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    parser.add_argument(
        "--eod-id", type=int, default=None, help="end-of-document token id (default: the tokenizer's eos)"
    )
    parser.add_argument("--config", default=None, help="training YAML, when the checkpoint has no run_config.yaml")
    parser.add_argument(
        "--format",
        choices=("auto", "lol", "llama"),
        default="auto",
        help="auto: stock Llama for plain dense stacks, else LoL remote code",
    )
    parser.add_argument(
        "--loop-budget",
        type=int,
        default=None,
        help="plan accordion: the default loop budget k of the exported model (one of the run's "
        "model.plan.budgets; default: the run's model.plan.budget, else the largest)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 2GB, 500MB)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --save directory")


def run(args: argparse.Namespace) -> int:
    refuse_early(args)
    from megatron_lol.convert.to_hf import convert_checkpoint

    summary = convert_checkpoint(
        args.load,
        args.save,
        iteration=args.iteration,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        tokenizer_type=args.tokenizer_type,
        export_tokenizer=not args.no_tokenizer,
        eod_id=args.eod_id,
        config=args.config,
        fmt=args.format,
        max_shard_size=args.max_shard_size,
        force=args.force,
        loop_budget=args.loop_budget,
    )
    print(
        f"wrote {summary['format']} model ({summary['num_tensors']} tensors, {summary['num_shards']} shard(s), "
        f"{summary['dtype']}) from {summary['source']} to {args.save}"
    )
    return 0
