"""``megatron-lol plan-layout``: parallel layouts of a config for an allocation (see :mod:`.planner`).

    megatron-lol plan-layout --config C --nodes 4 --gpus-per-node 8 --device-memory 80 \\
        [--mfu 0.35] [--peak-tflops 989.4] [--batch-tolerance 0.05] [--top 5] [--output derived.yaml] [--json]
    megatron-lol plan-layout --config C --nodes 4 --gpus-per-node 8 --check [train flags...]

Prints the ranked proposals, what the first one changes and the ``train``
flags that apply it; ``--output`` writes it as a config (the given one with
those values replaced, every other line's value kept). ``--check`` is what the
Slurm scripts run before they queue or launch anything: exit 0 when the layout
the config and flags give runs at ``nodes x gpus_per_node`` ranks (and fits
``--device-memory`` when given), else status 2 with the reason and the first
proposal's flags. Takes every flag ``train`` takes, so the check sees the run's
own settings. Estimates are for the target device: a config whose
``params_dtype`` is ``auto`` is estimated in BF16 (what it runs in on a GPU),
whatever the machine that plans has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from megatron_lol.errors import CliError

DEFAULT_DEVICE_GIB = 80.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lol.config import add_config_arguments
    from megatron_lol.config.loader import add_threads_argument

    add_config_arguments(parser)
    add_threads_argument(parser)  # not used here: the Slurm scripts pass the train arguments unchanged
    group = parser.add_argument_group("allocation and estimate")
    group.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes (default: SLURM_JOB_NUM_NODES)")
    group.add_argument(
        "--gpus-per-node", type=int, default=8, metavar="G", help="devices (training processes) per node (default 8)"
    )
    group.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help=f"memory per device in GiB (default {DEFAULT_DEVICE_GIB:g}; --check compares only when given)",
    )
    group.add_argument(
        "--mfu", type=float, default=0.35, metavar="F", help="model FLOP utilisation assumed for step times (0.35)"
    )
    group.add_argument(
        "--peak-tflops",
        type=float,
        default=989.4,
        metavar="T",
        help="peak dense TFLOP/s per device in the training precision (default: H100 SXM BF16, 989.4)",
    )
    group.add_argument(
        "--batch-tolerance",
        type=float,
        default=0.05,
        metavar="F",
        help="global batches within this fraction of the config's rank as keeping it (default 0.05; 0: exact first)",
    )
    group.add_argument("--top", type=int, default=5, metavar="K", help="proposals to list (default 5)")
    group.add_argument("--output", default=None, metavar="FILE", help="write the first proposal as a config here")
    group.add_argument(
        "--check",
        action="store_true",
        help="check the given layout at this allocation; status 2 with the first proposal when it does not run",
    )
    group.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    from megatron_lol.config import config_from_args
    from megatron_lol.config.loader import overrides_from_args
    from megatron_lol.perf.planner import layout_error

    target = _target(args)
    cfg = config_from_args(args, check_data=False)
    overrides = overrides_from_args(args)
    if _requested_dtype(args.config, overrides) == "auto" and target.gpus_per_node > 0:
        cfg.model.precision.params_dtype = "bf16"  # what `auto` runs in on a GPU, whatever this machine has
    error = layout_error(cfg, target.world)  # needs no vocabulary: a pipeline's tokenizer may not exist yet
    if error is None and args.check and args.device_memory is not None:
        error = _memory_error(cfg, _vocab(cfg), target)
    if args.check and error is None:
        par, tr = cfg.parallel, cfg.training
        dp = par.data_parallel_size(target.world)
        print(
            f"megatron-lol plan-layout: layout OK at {target.nodes} x {target.gpus_per_node} = {target.world} ranks: "
            f"TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x DP {dp}, "
            f"micro-batch {tr.micro_batch_size}, global batch {tr.global_batch_size or tr.micro_batch_size * dp}"
        )
        return 0
    from megatron_lol.perf.planner import plan_layouts

    if args.check:  # error is set
        from megatron_lol.perf.plan_report import flags_for

        print(f"megatron-lol plan-layout: error: {error}", file=sys.stderr, flush=True)
        try:
            proposals = plan_layouts(cfg, target, _vocab(cfg), top=1)
        except CliError as err:
            print(f"megatron-lol plan-layout: no proposal: {err}", file=sys.stderr, flush=True)
            return 2
        if not proposals:
            print(
                f"megatron-lol plan-layout: no proposal: no layout the trainer accepts at {target.world} ranks",
                file=sys.stderr,
                flush=True,
            )
        else:
            p = proposals[0]
            print(
                f"megatron-lol plan-layout: first proposal for {target.nodes} x {target.gpus_per_node} ranks "
                f"(megatron-lol plan-layout --config {args.config} --nodes {target.nodes} --gpus-per-node "
                f"{target.gpus_per_node} --output FILE writes it): {' '.join(flags_for(p))}",
                file=sys.stderr,
                flush=True,
            )
        return 2
    proposals = plan_layouts(cfg, target, _vocab(cfg), top=args.top)
    if args.output:
        _write_derived(args, overrides, proposals, target, error)
    if args.json:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "nodes": target.nodes,
                    "gpus_per_node": target.gpus_per_node,
                    "world_size": target.world,
                    "device_memory_bytes": target.device_bytes,
                    "mfu": target.mfu,
                    "peak_tflops": target.peak_tflops,
                    "params_dtype": cfg.model.precision.params_dtype,
                    "config_error": error,
                    "proposals": [p.to_dict() for p in proposals],
                }
            )
        )
        return 0 if proposals else 2
    from megatron_lol.perf.plan_report import format_plan
    from megatron_lol.perf.planner import memory_bytes

    own = None if error is not None else memory_bytes(cfg, _vocab(cfg), target.world)
    print(format_plan(args.config, cfg, target, error, proposals, own))
    if args.output and proposals:
        print(f"wrote {args.output}: the config with proposal 1's values")
    return 0 if proposals else 2


def _target(args: argparse.Namespace):
    from megatron_lol.perf.planner import Target

    nodes = args.nodes
    if nodes is None and os.environ.get("SLURM_JOB_NUM_NODES", "").isdigit():
        nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    if nodes is None:
        raise CliError("--nodes: required (or run inside a Slurm job: SLURM_JOB_NUM_NODES)")
    if nodes < 1:
        raise CliError(f"--nodes: must be >= 1 (got {nodes})")
    if args.gpus_per_node < 1:
        raise CliError(f"--gpus-per-node: must be >= 1 (got {args.gpus_per_node})")
    gib = DEFAULT_DEVICE_GIB if args.device_memory is None else args.device_memory
    if gib <= 0:
        raise CliError(f"--device-memory: must be > 0 GiB (got {gib:g})")
    if not 0 < args.mfu <= 1:
        raise CliError(f"--mfu: must be in (0, 1] (got {args.mfu:g})")
    if args.peak_tflops <= 0:
        raise CliError(f"--peak-tflops: must be > 0 (got {args.peak_tflops:g})")
    if args.batch_tolerance < 0:
        raise CliError(f"--batch-tolerance: must be >= 0 (got {args.batch_tolerance:g})")
    if args.top < 1:
        raise CliError(f"--top: must be >= 1 (got {args.top})")
    return Target(
        nodes=nodes,
        gpus_per_node=args.gpus_per_node,
        device_bytes=gib * 2**30,
        mfu=args.mfu,
        peak_tflops=args.peak_tflops,
        batch_tolerance=args.batch_tolerance,
    )


def _requested_dtype(path: str, overrides: list) -> str:
    """``model.precision.params_dtype`` as written (the loaded config has ``auto`` resolved for this machine)."""
    for key, value, _ in reversed(overrides):
        if key == "model.precision.params_dtype":
            return str(value)
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "auto"
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        return "auto"
    import warnings

    from megatron_lol.config.migration import migrate_sections

    with warnings.catch_warnings():  # the load that follows warns about a deprecated spelling once
        warnings.simplefilter("ignore")
        precision = migrate_sections(model, path).get("precision")
    return str(precision.get("params_dtype", "auto")) if isinstance(precision, dict) else "auto"


def _vocab(cfg) -> int:
    from megatron_lol.perf.params_cli import padded_vocab

    vocab = padded_vocab(cfg)
    if vocab is None:
        raise CliError("model.vocab_size: not set and no data.tokenizer_model to take it from; set model.vocab_size")
    return vocab


def _memory_error(cfg, vocab: int, target) -> str | None:
    from megatron_lol.perf.planner import memory_bytes

    need = memory_bytes(cfg, vocab, target.world)
    if need > target.device_bytes:
        return (
            f"parallel: the layout needs an estimated {need / 2**30:.1f} GiB per device "
            f"(megatron-lol memory), more than --device-memory {target.device_bytes / 2**30:g} GiB"
        )
    return None


def _set_nested(raw: dict, key: str, value) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if part == "plan" and i == 1 and isinstance(child, str):
            child = {"kind": child}  # `plan: lol` written as a name
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[parts[-1]] = value


def _write_derived(args, overrides: list, proposals: list, target, error) -> None:
    """The config file with the command line's overrides and proposal 1's changes applied; checked by
    loading it back (as ``train`` will) before it replaces ``--output``."""
    from megatron_lol.config.loader import load_config
    from megatron_lol.perf.planner import layout_error

    if not proposals:
        raise CliError(f"--output: no layout to write ({error or 'none found'})")
    out = Path(args.output)
    if not out.parent.is_dir():
        raise CliError(f"--output: directory {out.parent} does not exist")
    raw = yaml.safe_load(Path(args.config).read_text()) or {}
    for key, value, _ in overrides:
        _set_nested(raw, key, value)
    p = proposals[0]
    for key, (_, new) in p.changes.items():
        _set_nested(raw, key, new)
    changed = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in p.changes.items()) or "nothing"
    head = (
        f"# derived by `megatron-lol plan-layout` from {args.config} for {target.nodes} nodes x "
        f"{target.gpus_per_node} devices ({target.world} ranks); changed: {changed}\n"
    )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(head + yaml.safe_dump(raw, sort_keys=False))
        cfg = load_config(tmp, check_data=False)
        problem = layout_error(cfg, target.world)
        if problem is not None:
            raise CliError(f"--output: the derived config does not validate at {target.world} ranks ({problem})")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
