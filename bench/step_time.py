#!/usr/bin/env python
"""Training-step time of a LoL model against a fixed path and a dense GPT, in one run.

Models (same width, heads, FFN, vocabulary, sequence, batch; same optimizer):

  lol      LoLGPTModel, plan lol: the router picks a block per window (training
           mode, router noise on, so windows spread over the blocks);
  fixed    the same library executed with a fixed path and no router:
           ``plan: {kind: looped, attention: strided}`` runs block ``(l-1) mod L``
           on LoL's shifted windows at depth ``l`` (same windows, same chunked
           attention, no router, no dispatch);
  forced   LoLGPTModel with a ForcedPath (block ``(l-1) mod L``, gate 1) for
           every window: note that the routed step still computes the
           router's probabilities before the override, so this run pays for the
           router but executes one block per depth;
  dense    megatron-core ``GPTModel`` (local spec, RMSNorm, SwiGLU, RoPE) with
           ``n_prelude + D + n_coda`` layers and full causal attention.

A step is ``zero_grad; loss = model(tokens, labels).mean(); loss.backward();
AdamW.step()``; the LoL-family models get the micro-batch's host layout built
with the batch (``host_layout.host_layout_for_batch``, as the trainer builds it
beside each batch), so their forward does not build it. Steps of the models are interleaved (lol, fixed, forced, dense,
lol, ...) so that load from other processes hits them alike; the median step
time of each is reported, with the ratios and the FLOP model's predictions
(``megatron_lol.perf.flops``, executed and allowed attention pairs) beside them,
then paired ratios (median and quartiles over steps of the i-th LoL step over the
i-th step of the other model, which ran right after it), system time and minor
page faults per step.

    python bench/step_time.py                    # defaults: 2 CPU cores, a few minutes
    python bench/step_time.py --seq 1024 --window 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch
from _shared import add_layer_size_args, add_threads_arg, setup_megatron  # bench/ is sys.path[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_layer_size_args(p)
    p.add_argument("--blocks", type=int, default=4, help="L")
    p.add_argument("--depth", type=int, default=4, help="D (a multiple of L for the fixed run)")
    p.add_argument("--prelude", type=int, default=1)
    p.add_argument("--coda", type=int, default=1)
    p.add_argument("--window", type=int, default=64, help="W")
    p.add_argument("--shift", type=int, default=32, help="S")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--steps",
        type=int,
        default=30,
        help="timed steps per model (the machine's speed drifts by 10-30%% within minutes; with fewer "
        "steps the ratio of medians moves by several per cent)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--models", default="lol,fixed,forced,dense")
    add_threads_arg(p)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def model_config(args, **over):
    from megatron_lol.config import config_from_dict

    m = dict(
        plan={"kind": "lol", "num_blocks": args.blocks, "routed_depth": args.depth},
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        n_prelude=args.prelude,
        n_coda=args.coda,
        vocab_size=args.vocab,
    )
    m.update(over)
    m["plan"] = dict(m["plan"], windows={"size": args.window, "shift": args.shift})  # every kind here has them
    return config_from_dict({"model": m}).model


def build_models(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lol.model.core import ForcedPath
    from megatron_lol.model.library import transformer_config
    from megatron_lol.model.lol_model import LoLGPTModel

    names = args.models.split(",")
    built = {}
    cfgs = {}
    cfgs["lol"] = model_config(args)
    cfgs["forced"] = cfgs["lol"]
    if args.depth % args.blocks:
        raise SystemExit(f"--depth {args.depth} must be a multiple of --blocks {args.blocks} (the fixed path loops)")
    cfgs["fixed"] = model_config(
        args,
        plan={"kind": "looped", "layers": args.blocks, "loops": args.depth // args.blocks, "attention": "strided"},
    )
    n_layers = args.prelude + args.depth + args.coda
    cfgs["dense"] = model_config(args, plan={"kind": "dense", "layers": args.depth, "attention": "full"})
    for name in names:
        torch.manual_seed(1234)
        if name == "dense":
            tconf = transformer_config(cfgs["dense"], num_layers=n_layers)
            net = GPTModel(
                tconf,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=args.vocab,
                max_sequence_length=args.seq,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
            )
        else:
            net = LoLGPTModel(cfgs[name], vocab_size=args.vocab, eod_id=None, max_sequence_length=args.seq)
        built[name] = net.train()
    forced = None
    if "forced" in names:
        K = args.seq // args.window + 2
        ids = torch.tensor([[(l - 1) % args.blocks] * K for l in range(1, args.depth + 1)])
        forced = ForcedPath(ids=ids, gates=torch.ones(args.depth, K))
    return built, cfgs, forced


def make_step(name, net, forced, tokens, labels):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked
    layout = None
    if name != "dense":  # built with the batch, as the trainer does: the forward does not build it
        from megatron_lol.model.host_layout import host_layout_for_batch

        layout = host_layout_for_batch({"tokens": tokens}, net.cfg, net.plan, net.eod_id, 0, pin=False)

    def step():
        opt.zero_grad(set_to_none=True)
        if name == "dense":
            loss = net(tokens, None, causal, labels=labels).float().mean()
        elif name == "forced":
            loss = net(tokens, labels=labels, forced_path=forced, layout=layout).float().mean()
        else:
            loss = net(tokens, labels=labels, layout=layout).float().mean()
        loss.backward()
        opt.step()
        return float(loss)

    return step


def predictions(args, cfgs):
    from megatron_lol.perf.flops import training_flops

    out = {}
    for name in ("lol", "fixed", "forced", "dense"):
        cfg = cfgs[name]
        row = {}
        for mode in ("allowed", "executed"):
            # routed: up to L packed streams per depth, each padded to a multiple of W
            streams = args.blocks if name == "lol" else 1
            row[mode] = training_flops(
                cfg, args.vocab, args.seq, args.batch, attention_pairs=mode, streams_per_depth=streams
            ).total
        out[name] = row
    return out


def _quantile(sorted_values, q: float) -> float:
    """Linear-interpolation quantile of an already sorted list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads != 1:
        print("note: with more than one thread, process CPU time is summed over threads; compare wall times")
    setup_megatron(args.threads)
    from megatron_lol.backends.cpu.kernels import routing_kernels

    fused = routing_kernels() is not None  # built (or found in the cache) before anything is timed

    built, cfgs, forced = build_models(args)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    steps = {name: make_step(name, net, forced, tokens, labels) for name, net in built.items()}
    times: dict = {name: [] for name in steps}
    walls: dict = {name: [] for name in steps}
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    sys_times: dict = {name: [] for name in steps}
    faults: dict = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, fn in steps.items():
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.process_time() - c0)
            walls[name].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            sys_times[name].append(r1.ru_stime - r0.ru_stime)
            faults[name].append(r1.ru_minflt - r0.ru_minflt)
    pred = predictions(args, cfgs)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    wmed = {k: statistics.median(v) for k, v in walls.items()}
    wlow = {k: min(v) for k, v in walls.items()}
    n_windows = args.seq / args.window
    print(
        f"step time, {args.batch} x {args.seq} tokens, width {args.hidden}, L={args.blocks}, D={args.depth}, "
        f"W={args.window}, S={args.shift} ({n_windows:g} windows per context), "
        f"{torch.get_num_threads()} threads, {args.steps} steps"
    )
    print(
        "times: process CPU seconds per step (median, min) and wall seconds (median, min); ratios from median CPU time"
    )
    print(
        "routed depth's gated combine: "
        + (
            "fused CPU kernel (megatron_lol/backends/cpu)"
            if fused
            else "torch operations (CPU kernel off or not built)"
        )
    )
    base = "lol" if "lol" in med else next(iter(med))
    print(
        f"{'model':8s} {'cpu med':>8s} {'cpu min':>8s} {'wall med':>9s} {'wall min':>9s} {'lol/this':>9s}"
        f" {'pred exec':>10s} {'pred allow':>11s} {'GFLOP exec':>11s} {'GFLOP allow':>12s}"
    )
    result = {"args": vars(args), "fused_cpu_kernel": fused, "models": {}}
    for name in med:
        r = med[base] / med[name]
        pe = pred[base]["executed"] / pred[name]["executed"]
        pa = pred[base]["allowed"] / pred[name]["allowed"]
        print(
            f"{name:8s} {med[name]:8.3f} {low[name]:8.3f} {wmed[name]:9.3f} {wlow[name]:9.3f} {r:9.3f}"
            f" {pe:10.3f} {pa:11.3f}"
            f" {pred[name]['executed'] / 1e9:11.2f} {pred[name]['allowed'] / 1e9:12.2f}"
        )
        result["models"][name] = {
            "cpu_median_s": med[name],
            "cpu_min_s": low[name],
            "cpu_times_s": times[name],
            "wall_median_s": wmed[name],
            "wall_min_s": wlow[name],
            "wall_times_s": walls[name],
            "ratio_lol_over_this": r,
            "predicted_ratio_executed": pe,
            "predicted_ratio_allowed": pa,
            "flops_executed": pred[name]["executed"],
            "flops_allowed": pred[name]["allowed"],
        }
    print(
        "lol/this: the LoL step time divided by this model's (<= 1 means LoL is as fast or faster);"
        " pred: the same ratio of FLOP-model training FLOPs"
    )
    # Paired ratios: the steps of the models are interleaved, so the ratio of the i-th LoL step to the
    # i-th step of another model sees about the same background load; their median and quartiles
    # are less sensitive to load drifting during the run than the ratio of medians above.
    # The ratio of minimum times compares each model's least-disturbed step (timeit's estimator).
    print(
        f"{'model':8s} {'paired lol/this: q25':>20s} {'median':>7s} {'q75':>6s} {'of mins':>8s} {'sys s med':>10s}"
        f" {'minor faults med':>17s}"
    )
    for name in med:
        pairs = sorted(a / b for a, b in zip(times[base], times[name]))
        q25, pmed, q75 = _quantile(pairs, 0.25), statistics.median(pairs), _quantile(pairs, 0.75)
        smed, fmed = statistics.median(sys_times[name]), statistics.median(faults[name])
        rmin = low[base] / low[name]
        print(f"{name:8s} {q25:20.3f} {pmed:7.3f} {q75:6.3f} {rmin:8.3f} {smed:10.3f} {fmed:17.0f}")
        result["models"][name].update(
            {
                "paired_ratio_median": pmed,
                "paired_ratio_q25": q25,
                "paired_ratio_q75": q75,
                "ratio_of_mins": rmin,
                "sys_median_s": smed,
                "minor_faults_median": fmed,
                "sys_times_s": sys_times[name],
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
