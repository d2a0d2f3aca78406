"""``megatron-lol profile``: throughput, TFLOP/s, MFU, step-time breakdown and routing statistics.

    megatron-lol profile --config FILE [--steps N] [--warmup K] [--json OUT]
    megatron-lol profile --config FILE --synthetic-data --set model.vocab_size=32000
    megatron-lol profile --merge node0.json node1.json ... [--json OUT]

Builds the trainer of the config (``Trainer(cfg).setup()``: the same model,
optimizer, parallel layout and data), runs ``--warmup`` steps, then times
``--steps`` training steps at the core depth ``--depth`` (default: the full
depth, whatever the growing curriculum would use). It reports:

* tokens/s per device and per node, model TFLOP/s per device (FLOP model of
  :mod:`megatron_lol.perf.flops`, allowed attention pairs) and MFU against the
  device's peak (:mod:`megatron_lol.perf.peaks`, ``--peak-tflops`` overrides;
  omitted on CPU); the executed-FLOP rate (hardware FLOPs of the local
  attention, masked scores included) as well;
* step times of whole training steps: CUDA events recorded around each step
  and read once after the last (wall clock on CPUs), so the GPU keeps its queue;
* a step-time breakdown (unless ``--no-breakdown``): forward of the prelude,
  routed core (of which: the library blocks, the dispatch bookkeeping = plan +
  gather/scatter, and the rest = windows, router, balancing, gated update),
  coda (+ final norm and LM head), then backward (the rest of the step),
  optimizer, data. Forward sections are timed with module hooks
  (``torch.cuda.synchronize`` around them on GPUs, unless ``--no-sync``):
  on a GPU that stalls the queue at every module, and a LoL step calls many
  modules, so throughput is measured in a run without it (``--no-breakdown``;
  the report's ``timing`` says which kind of run it is);
* peak memory (CUDA allocator peak, or the process's peak RSS on CPU) beside
  the per-rank estimate of ``megatron-lol memory`` (:mod:`megatron_lol.perf.memory`);
* a warning on stderr when the timed steps differ by more than 2x (a busy
  machine: the median-based figures are then not the model's);
* with several ranks, the slowest and fastest rank (``stragglers``) by their
  median time to the gradient reduction (a rank's own work; whole steps are equal);
* the host synchronisations of a step (``host_syncs``: reads of device values, total and by
  name, and ATen operations), counted by :mod:`megatron_lol.perf.host_syncs` in
  ``--count-steps`` untimed steps right after the timed ones (its counter costs host time per
  operation, so the timed steps run without it);
* routing statistics: block utilisation per depth (share of windows), the mean
  number of distinct blocks on a token's path through the core (with the
  uniform-routing expectation ``L (1 - (1 - 1/L)^D)`` beside it), recorded in
  ``--routing-steps`` untimed steps of their own after those (:class:`RoutingStats`
  reads every depth's choices back to the host: the report's ``routing.source`` says so),
  beside the trainer's own utilisation of the timed steps (``block_utilisation_trainer``);
* with GPUs, a background NVML sampler (:mod:`.gpu_monitor`): utilisation,
  memory, power, SM clock (mean and minimum) and throttle reasons per GPU.

Multi-process runs (torchrun / srun, several nodes) gather every rank's
measurements on rank 0, which writes one report with a row per node
(``nodes``, keyed by the node's index in the job, see
:func:`~megatron_lol.training.profile_report.node_identity`); ``--merge`` combines
reports written by separate runs (e.g. one per node) into one, with
:func:`~megatron_lol.training.profile_report.merge_reports`. The table goes to
stdout, the report to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Optional

from megatron_lol.errors import CliError
from megatron_lol.perf.timing import StepTimer
from megatron_lol.plan.windows import windows_of
from megatron_lol.training.profile_report import (  # noqa: F401 - the report API, re-exported
    format_nodes,
    format_report,
    median_or_none,
    merge_reports,
    node_identity,
    node_rows,
    stragglers,
    write_json,
)
from megatron_lol.training.step_sections import RoutingStats, SectionTimer, TimedIterator, module_list
from megatron_lol.training.synthetic_data import StubTokenizer as _StubTokenizer  # noqa: F401 - re-exported
from megatron_lol.training.synthetic_data import SyntheticDataset, build_trainer  # noqa: F401 - re-exported


# ----------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lol.config import add_config_arguments
    from megatron_lol.config.loader import PROFILE_GROUPS, add_threads_argument

    add_config_arguments(parser, groups=PROFILE_GROUPS)
    add_threads_argument(parser)
    for action in parser._actions:  # --config is not needed with --merge
        if "--config" in action.option_strings:
            action.required = False
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--depth", type=int, default=None, help="core depth to run (default: the full depth)")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report here")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s per device for MFU (default: from the device table)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=("bf16", "fp16", "fp8", "tf32", "fp32"),
        help="which peak to use (default: bf16 for bf16 models, fp8 with FP8, else tf32)",
    )
    parser.add_argument(
        "--synthetic-data",
        action="store_true",
        help="random tokens (with EOD-separated documents) instead of data.paths",
    )
    parser.add_argument("--no-sync", action="store_true", help="do not synchronise the GPU in section timers")
    parser.add_argument(
        "--no-breakdown",
        action="store_true",
        help="no section timers: whole-step times only (what throughput should be read from)",
    )
    parser.add_argument(
        "--count-steps",
        type=int,
        default=2,
        help="untimed steps after the timed ones whose host synchronisations are counted (default 2; 0: none)",
    )
    parser.add_argument(
        "--routing-steps",
        type=int,
        default=2,
        help="untimed steps after those that record routing statistics (default 2; 0: none)",
    )
    parser.add_argument("--sample-interval", type=float, default=0.5, help="NVML sampling period in seconds")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="REPORT",
        help="merge these profile reports (JSON) into one; no training",
    )


SPREAD_WARNING = 2.0  # slowest / fastest timed step above which the figures are flagged


def step_time_warning(step_times: list) -> Optional[str]:
    """A warning when the timed steps differ by more than :data:`SPREAD_WARNING` x: the machine was
    busy, or the steps did different work; the figures (from the median) are then not the model's."""
    fastest, slowest = min(step_times), max(step_times)
    if fastest <= 0 or slowest / fastest <= SPREAD_WARNING:
        return None
    return (
        f"warning: the timed step times vary {slowest / fastest:.1f}x ({fastest:.3f} s to {slowest:.3f} s): "
        f"another load on the machine, or steps doing different work; the figures use the median "
        f"(rerun with more --steps / --warmup on an idle machine)"
    )


# ------------------------------------------------------------------------ running
def _device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        return {"kind": "cuda", "name": torch.cuda.get_device_name(), "count": torch.cuda.device_count()}
    return {"kind": "cpu", "name": "cpu", "count": 1, "threads": torch.get_num_threads()}


def _peak_memory_bytes() -> dict:
    import torch

    if torch.cuda.is_available():
        return {
            "kind": "cuda_max_allocated",
            "bytes": int(torch.cuda.max_memory_allocated()),
            "reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    import resource

    return {"kind": "cpu_peak_rss", "bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def _precision(cfg, override: Optional[str]) -> str:
    if override:
        return override
    if cfg.model.precision.fp8:
        return "fp8"
    return "bf16" if cfg.model.precision.params_dtype == "bf16" else "tf32"


def profile_trainer(
    trainer,
    steps: int,
    warmup: int,
    *,
    depth: Optional[int] = None,
    sync: bool = True,
    sample_interval: float = 0.5,
    peak_override: Optional[float] = None,
    precision: Optional[str] = None,
    sampler=None,
    breakdown: bool = True,
    count_steps: int = 2,
    routing_steps: int = 2,
) -> dict:
    """Run ``warmup`` + ``steps`` timed training steps of a set-up trainer, then ``count_steps`` whose host
    synchronisations are counted and ``routing_steps`` that record routing statistics (untimed, each
    kind on its own); return this rank's report.

    ``breakdown``: time sections with module hooks too (synchronised on GPUs when ``sync``); without it the
    report has whole-step times only (``breakdown_s`` None)."""
    import torch

    from megatron_lol.perf.gpu_monitor import start_if_available
    from megatron_lol.perf.host_syncs import count_step_syncs

    plan = trainer.plan
    full = plan.depth
    depth = full if depth is None else depth
    if not 1 <= depth <= full:
        raise CliError(f"--depth: must be in [1, {full}] (got {depth})")
    cuda = torch.cuda.is_available()
    timer = SectionTimer(sync=cuda and sync)
    model = trainer.model
    core = getattr(model, "core", None)
    if breakdown:
        _hook_sections(timer, trainer, core)

    own_sampler = sampler is None and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if own_sampler:
        sampler = start_if_available(sample_interval)
    data = trainer.data_iterator(trainer.train_ds, trainer.consumed_train_samples)
    data = [TimedIterator(d, timer) for d in data] if isinstance(data, list) else TimedIterator(data, timer)
    steps_timer = StepTimer(cuda)
    try:
        timer.enabled = False
        for _ in range(warmup):
            trainer.train_step(data, depth=depth)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if sampler is not None:
            sampler.reset()
        timer.enabled = True
        timer.totals = {}
        results = []
        for _ in range(steps):
            steps_timer.start()
            results.append(trainer.train_step(data, depth=depth))
            steps_timer.stop()
        step_times = steps_timer.seconds()
        timer.enabled = False
    finally:
        timer.remove()
        # the GPU samples and the memory peak are the timed steps' (the counted steps run slower)
        gpu = sampler.stop() if own_sampler and sampler is not None else None
    peak_memory = _peak_memory_bytes()
    host_syncs = None
    if count_steps > 0:
        try:
            host_syncs = count_step_syncs(
                lambda it: trainer.train_step(it, depth=depth), data, count_steps, trainer.device, trainer.optimizer
            )
        except Exception as err:  # a kernel library the dispatch counter cannot follow: keep the timed figures
            host_syncs = {"error": f"{type(err).__name__}: {err}"[:500]}
    routing = None
    if routing_steps > 0 and core is not None and core.plan.routed and not (host_syncs or {}).get("error"):
        routing = _routing_run(trainer, core, data, depth, routing_steps)
    return _report(
        trainer,
        timer,
        routing,
        results,
        step_times,
        host_syncs=host_syncs,
        method=steps_timer.method,
        breakdown=breakdown,
        depth=depth,
        full=full,
        precision=precision,
        peak_override=peak_override,
        gpu=gpu,
        peak_memory=peak_memory,
        warmup=warmup,
        synced=sync and cuda,
    )


def _routing_run(trainer, core, data, depth: int, steps: int) -> Optional[dict]:
    """Routing statistics from ``steps`` training steps of their own, with :class:`RoutingStats` attached
    (it reads every depth's choices back to the host, so it never rides along in the timed steps)."""
    m = trainer.cfg.model
    stats = RoutingStats(core, windows_of(m).size, windows_of(m).shift, core.plan.num_stored_blocks)
    stats.enabled = True
    try:
        for _ in range(steps):
            trainer.train_step(data, depth=depth)
    finally:
        stats.remove()
    summary = stats.summary()
    if summary is not None:
        summary["source"] = (
            f"{steps} untimed steps after the timed ones with routing recorded (RoutingStats reads the "
            f"routing back to the host)"
        )
        summary["steps"] = steps
    return summary


def _hook_sections(timer: SectionTimer, trainer, core) -> None:
    """The section timers of the breakdown: module hooks and the core's named ranges."""
    model = trainer.model
    for layer in module_list(getattr(model, "prelude", None)):
        timer.hook_module(layer, "prelude")
    if core is not None:
        timer.hook_module(core, "core")
        for blk in module_list(getattr(core, "blocks", None)):
            timer.hook_module(blk, "core.blocks")
        timer.listen_to_ranges()
    for layer in module_list(getattr(model, "coda", None)):
        timer.hook_module(layer, "coda_head")
    for name in ("final_norm", "output_layer"):
        if getattr(model, name, None) is not None:
            timer.hook_module(getattr(model, name), "coda_head")
    timer.hook_module(model, "forward")
    timer.wrap(trainer.optimizer, "step", "optimizer")


def _report(
    trainer,
    timer,
    routing,
    results,
    step_times,
    *,
    host_syncs=None,
    method,
    breakdown,
    depth,
    full,
    precision,
    peak_override,
    gpu,
    peak_memory,
    warmup,
    synced,
) -> dict:
    import torch

    from megatron_lol.perf import flops as fl
    from megatron_lol.perf.peaks import mfu, peak_tflops

    cfg, plan = trainer.cfg, trainer.plan

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    seq = cfg.training.seq_length
    gbs = trainer.global_batch_size
    tokens = gbs * seq
    step_mean = sum(step_times) / len(step_times)
    step_median = statistics.median(step_times)
    model_flops = fl.training_flops_per_step(cfg, depth, gbs, seq, vocab_size=trainer.vocab_size)
    exec_flops = fl.training_flops(
        cfg.model,
        trainer.vocab_size,
        seq,
        gbs,
        depth=depth,
        attention_pairs="executed",
        backprop_depth=cfg.curriculum.backprop_depth,
        first_window_full_backprop=cfg.curriculum.first_window_full_backprop,
        streams_per_depth=plan.num_stored_blocks if plan.routed else 1,
    ).total
    dev = _device_info()
    prec = _precision(cfg, precision)
    peak = peak_tflops(dev["name"] if dev["kind"] == "cuda" else None, prec, peak_override)
    tflops = model_flops / step_median / world / 1e12
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    tot = timer.totals
    n = len(step_times)
    per = {k: v / n for k, v in tot.items()}
    blocks = per.get("core.blocks", 0.0)
    dispatch = max(0.0, per.get("core.dispatch_range", 0.0) - per.get("core.blocks_in_dispatch", 0.0))
    core_t = per.get("core", 0.0)
    forward = per.get("forward", 0.0)
    fwd_known = per.get("prelude", 0.0) + core_t + per.get("coda_head", 0.0)
    sections = {
        "prelude": per.get("prelude", 0.0),
        "core": core_t,
        "core.blocks": blocks,
        "core.dispatch": dispatch,
        "core.routing": max(0.0, core_t - blocks - dispatch),
        "coda_head": per.get("coda_head", 0.0),
        "forward_other": max(0.0, forward - fwd_known),
        "optimizer": per.get("optimizer", 0.0),
        "data": per.get("data", 0.0),
    }
    sections["backward"] = max(0.0, step_mean - forward - sections["optimizer"] - sections["data"])
    mem = peak_memory
    from megatron.core import parallel_state

    from megatron_lol.perf.memory import Layout, rank_memory

    # the per-rank estimate of `megatron-lol memory` for this rank's pipeline stage (full depth)
    mem_model = rank_memory(
        cfg, trainer.vocab_size, Layout.of(cfg, world), parallel_state.get_pipeline_model_parallel_rank()
    )
    util_steps = [r.utilisation for r in results if r.utilisation]
    utilisation = None
    if util_steps:
        utilisation = [
            [sum(s[d][b] for s in util_steps) / len(util_steps) for b in range(len(util_steps[0][d]))]
            for d in range(len(util_steps[0]))
        ]
    node, host = node_identity()
    report = {
        "host": host,
        "node": node,
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "world_size": world,
        "devices_per_node": local,
        "device": dev,
        "config": {
            "plan": cfg.model.plan.kind,
            "hidden_size": cfg.model.hidden_size,
            "num_blocks": plan.num_stored_blocks,
            "core_depth": full,
            "depth": depth,
            "window_size": windows_of(cfg.model).size,
            "window_shift": windows_of(cfg.model).shift,
            "seq_length": seq,
            "global_batch_size": gbs,
            "micro_batch_size": cfg.training.micro_batch_size,
            "params_dtype": cfg.model.precision.params_dtype,
            "vocab_size": trainer.vocab_size,
        },
        "steps": n,
        "warmup": 0 if warmup is None else warmup,
        "step_time_s": {
            "mean": step_mean,
            "median": step_median,
            "min": min(step_times),
            "max": max(step_times),
            "all": step_times,
        },
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_median,
        "tokens_per_s_per_device": tokens / step_median / world,
        "tokens_per_s_per_node": tokens / step_median / world * local,
        "flops_per_step": model_flops,
        "flops_per_step_executed": exec_flops,
        "tflops_per_device": tflops,
        "tflops_per_device_executed": exec_flops / step_median / world / 1e12,
        "precision": prec,
        "peak_tflops": peak,
        "mfu": mfu(tflops, peak),
        "breakdown_s": sections if breakdown else None,
        # how the step times were taken: throughput is only meaningful from a run without section timers
        "timing": {"steps": method, "section_timers": breakdown, "synchronised_sections": breakdown and synced},
        "peak_memory": mem,
        "memory_model_bytes": mem_model.to_dict(),
        "host_syncs": host_syncs,
        "routing": routing,
        "block_utilisation_trainer": utilisation,  # the timed steps' own (read with their loss)
        # this rank's own work per step, before it waits for the others in the gradient reduction
        "compute_time_s": median_or_none([r.compute_seconds for r in results]),
        "loss": [r.loss for r in results],
        "gpu": gpu,
    }
    return report


def run(args: argparse.Namespace) -> int:
    if args.merge:
        reports = []
        for path in args.merge:
            try:
                with open(path) as f:
                    reports.append(json.load(f))
            except (OSError, json.JSONDecodeError) as err:
                raise CliError(f"--merge: cannot read {path}: {err}") from None
        merged = merge_reports(reports)
        print(format_nodes(merged))
        if args.json_out:
            write_json(args.json_out, merged)
        return 0
    if not args.config:
        raise CliError("--config is required (or --merge REPORT ...)")
    if args.steps < 1:
        raise CliError(f"--steps: must be >= 1 (got {args.steps})")
    for flag, value in (
        ("--warmup", args.warmup),
        ("--count-steps", args.count_steps),
        ("--routing-steps", args.routing_steps),
    ):
        if value < 0:
            raise CliError(f"{flag}: must be >= 0 (got {value})")
    from megatron_lol.config import config_from_args

    cfg = config_from_args(args, check_data=not args.synthetic_data)
    from megatron_lol.training.runtime import apply_threads

    apply_threads(args.threads)
    # enough iterations for the LR schedule to cover the profiled steps (a FLOP budget: the trainer derives them)
    if cfg.training.train_flops is None:
        cfg.training.train_iters = max(cfg.training.train_iters, args.warmup + args.steps)
    trainer = build_trainer(cfg, args.synthetic_data)
    local = profile_trainer(
        trainer,
        args.steps,
        args.warmup,
        depth=args.depth,
        sync=not args.no_sync,
        sample_interval=args.sample_interval,
        peak_override=args.peak_tflops,
        precision=args.precision,
        breakdown=not args.no_breakdown,
        count_steps=args.count_steps,
        routing_steps=args.routing_steps,
    )
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
    else:
        gathered = [local]
    if local["rank"] != 0:
        return 0
    report = dict(local)
    report["nodes"] = node_rows(gathered)
    report["ranks"] = [
        {
            k: r.get(k)
            for k in (
                "host",
                "node",
                "rank",
                "step_time_s",
                "compute_time_s",
                "tokens_per_s_per_device",
                "tflops_per_device",
                "peak_memory",
            )
        }
        for r in gathered
    ]
    report["stragglers"] = stragglers(report["ranks"])
    print(format_report(report))
    spread = step_time_warning(report["step_time_s"]["all"])
    if spread:
        print(spread, file=sys.stderr, flush=True)
    if len(report["nodes"]) > 1:
        print(format_nodes(merge_reports([report])))
    if args.json_out:
        write_json(args.json_out, report)
    return 0
