#!/usr/bin/env python
"""Adam against Muon in one run: training-step time and evaluation loss after the same tokens.

Baseline: megatron-core's AdamW (``optimizer.name: adam``, what the quickstart
trains with). Against it: ``optimizer.name: muon`` (megatron-core's Muon for the
attention/MLP matrices, AdamW for the rest; ``megatron_lol/training/optimizer.py``).

Two models, both through the real ``Trainer`` (megatron-core DDP, optimizer,
schedule) on the quickstart corpus:

  tiny   ``examples/configs/tiny-cpu.yaml`` as it is (the quickstart): each
         optimizer trains ``--train-iters`` steps (default 800, the quickstart's
         schedule) from the same initialisation on the same batches; reported:
         step and optimizer-step times, validation loss of the initial model and
         after the run (``eval_iters`` batches);
  big    the same config widened to about 100M parameters (``--big-*`` flags):
         ``--big-steps`` timed steps per optimizer after ``--big-warmup``
         (step time only; the loss is not comparable after a few steps).

Runs are sequential (Adam, then Muon). Times are medians of process CPU
seconds (one torch thread by default), which other jobs on a shared machine
barely move; wall seconds are printed beside them.

    megatron-lol prepare-quickstart --output-dir data/quickstart
    python bench/optimizer.py                              # ~20 min on 2 CPU cores
    python bench/optimizer.py --train-iters 200 --muon-set optimizer.muon_adam_lr=1e-3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import yaml
from _shared import add_threads_arg, setup_megatron  # bench/ is sys.path[0]

OPTIMIZERS = ("adam", "muon")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--config", default="examples/configs/tiny-cpu.yaml", help="the tiny model's config")
    p.add_argument("--train-iters", type=int, default=800, help="steps per optimizer on the tiny model")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every run",
    )
    p.add_argument(
        "--muon-set",
        dest="muon_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the Muon runs only, e.g. optimizer.muon_adam_lr=1e-3",
    )
    p.add_argument("--big-hidden", type=int, default=768)
    p.add_argument("--big-heads", type=int, default=12)
    p.add_argument("--big-ffn", type=int, default=3072)
    p.add_argument("--big-prelude", type=int, default=3)
    p.add_argument("--big-coda", type=int, default=3)
    p.add_argument("--big-blocks", type=int, default=4, help="L")
    p.add_argument("--big-depth", type=int, default=4, help="D")
    p.add_argument("--big-batch", type=int, default=2, help="micro = global batch of the 100M runs")
    p.add_argument("--big-steps", type=int, default=5, help="timed steps per optimizer (0: skip the 100M model)")
    p.add_argument("--big-warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    add_threads_arg(p)
    return p.parse_args(argv)


def _overrides(items: list) -> list:
    out = []
    for item in items:
        key, _, raw = item.partition("=")
        out.append((key.strip(), yaml.safe_load(raw), f"--set {item}"))
    return out


def load(args, optimizer: str, train_iters: int, extra: list):
    from megatron_lol.config import load_config

    overrides = [
        ("optimizer.name", optimizer, "bench"),
        ("training.train_iters", train_iters, "bench"),
        ("training.save", None, "bench"),
        ("training.eval_at_start", False, "bench"),
    ]
    overrides += _overrides(args.overrides) + extra
    if optimizer == "muon":
        overrides += _overrides(args.muon_overrides)
    return load_config(args.config, overrides)


def big_overrides(args) -> list:
    keys = {
        "model.hidden_size": args.big_hidden,
        "model.num_attention_heads": args.big_heads,
        "model.ffn_hidden_size": args.big_ffn,
        "model.n_prelude": args.big_prelude,
        "model.n_coda": args.big_coda,
        "model.plan.num_blocks": args.big_blocks,
        "model.plan.routed_depth": args.big_depth,
        "training.micro_batch_size": args.big_batch,
        "training.global_batch_size": args.big_batch,
        "curriculum.initial_depth": None,
        "optimizer.lr_warmup_iters": 0,
    }
    return [(k, v, "--big") for k, v in keys.items()]


def run(cfg, timed_steps: int, warmup: int, evaluate: bool) -> dict:
    """Train ``warmup + timed_steps`` steps: CPU and wall time of each step and of its optimizer step,
    losses, evaluation losses."""
    from megatron_lol.training.trainer import Trainer

    trainer = Trainer(cfg).setup()
    optimizer_cpu, optimizer_wall = [], []
    step = trainer.optimizer.step

    def timed_optimizer_step():
        c0, t0 = time.process_time(), time.perf_counter()
        out = step()
        optimizer_cpu.append(time.process_time() - c0)
        optimizer_wall.append(time.perf_counter() - t0)
        return out

    trainer.optimizer.step = timed_optimizer_step
    first_eval = trainer.evaluate() if evaluate else None
    data = trainer.data_iterator(trainer.train_ds, 0)
    results, step_cpu = [], []
    for _ in range(warmup + timed_steps):
        c0 = time.process_time()
        results.append(trainer.train_step(data))
        step_cpu.append(time.process_time() - c0)
    return {
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "tokens": sum(r.tokens for r in results),
        "step_cpu_s": step_cpu[warmup:],
        "step_wall_s": [r.seconds for r in results[warmup:]],
        "optimizer_cpu_s": optimizer_cpu[warmup:],
        "optimizer_wall_s": optimizer_wall[warmup:],
        "first_loss": results[0].loss,
        "last_loss": results[-1].loss,
        "eval_start": first_eval,
        "eval_end": trainer.evaluate() if evaluate else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_megatron(args.threads)
    out = {"tiny": {}, "big": {}}
    for name in OPTIMIZERS:
        cfg = load(args, name, args.train_iters, [])
        out["tiny"][name] = run(cfg, args.train_iters, 0, evaluate=True)
    if args.big_steps:
        for name in OPTIMIZERS:
            cfg = load(args, name, args.big_warmup + args.big_steps, big_overrides(args))
            out["big"][name] = run(cfg, args.big_steps, args.big_warmup, evaluate=False)
    print_table(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def print_table(out: dict) -> None:
    med = statistics.median
    print(
        f"\n{'model':6s} {'params':>9s} {'optimizer':9s} {'step CPU s':>10s} {'opt. CPU s':>10s} {'x adam':>7s} "
        f"{'step wall s':>11s} {'tokens':>10s} {'eval start':>10s} {'eval end':>9s}"
    )
    for model, runs in out.items():
        if not runs:
            continue
        base = med(runs["adam"]["step_cpu_s"])
        for name, r in runs.items():
            step = med(r["step_cpu_s"])
            ev0 = f"{r['eval_start']:.4f}" if r["eval_start"] is not None else "-"
            ev1 = f"{r['eval_end']:.4f}" if r["eval_end"] is not None else "-"
            print(
                f"{model:6s} {r['params'] / 1e6:8.2f}M {name:9s} {step:10.3f} {med(r['optimizer_cpu_s']):10.3f} "
                f"{step / base:7.2f} {med(r['step_wall_s']):11.3f} {r['tokens']:10,d} {ev0:>10s} {ev1:>9s}"
            )
    print(
        "medians over the timed steps: process CPU seconds of a training step and of the optimizer step in it "
        "(background load barely moves them), wall seconds of a step; x adam: step CPU time over Adam's; "
        "eval: validation loss of the initial model and after the run"
    )


if __name__ == "__main__":
    raise SystemExit(main())
