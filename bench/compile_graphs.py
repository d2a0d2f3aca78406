#!/usr/bin/env python
"""Graphs and graph breaks under ``torch.compile``: the grouped routed core, the whole LoL model, a dense model.

A routed depth with static shapes (the host-built layout, sync-free routing,
grouped blocks: docs/gpu.md, "The routed depth on a GPU") is something
``torch.compile`` can capture whole. ``torch._dynamo.explain`` counts the
graphs and the breaks of one forward, in BF16 (torch's meta function of
``_grouped_mm`` takes BF16 only):

  core grouped    every routed depth of the core given the host layout (FiLM per
                  block, input injection, truncated backprop), local and packed;
  model grouped   the whole LoL model (embedding, prelude, core, coda, loss) with
                  the grouped core;
  dense           ``plan: dense`` with the same executed layers (the baseline:
                  what megatron-core's layers themselves break on).

Then the break reasons, grouped by the source line where they happen.

    python bench/compile_graphs.py
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections import Counter

import torch
from _shared import add_threads_arg, setup_megatron  # bench/ is sys.path[0]

VOCAB, EOD = 97, 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=40)
    add_threads_arg(p)
    return p.parse_args(argv)


def model_config(args, **plan):
    from megatron_lol.config import config_from_dict

    model = dict(
        hidden_size=32,
        num_attention_heads=4,
        n_prelude=1,
        n_coda=1,
        precision={"params_dtype": "bf16"},
        plan=dict(plan or dict(kind="lol", num_blocks=args.blocks, routed_depth=args.depth)),
    )
    if not plan:  # LoL's windows, and the parts the grouped executor runs per block
        model["plan"].update(windows={"size": 8, "shift": 4}, film="depth_block", input_injection=True)
    return config_from_dict({"model": model}).model


def tokens_and_layout(args):
    from megatron_lol.model.host_layout import build_host_layout

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (args.batch, args.seq), generator=g)
    tokens[torch.rand(args.batch, args.seq, generator=g) < 0.08] = EOD
    seeds = torch.arange(1, args.batch + 1)
    layout = build_host_layout(tokens, EOD, 8, 4, range(1, args.depth + 1), args.blocks, seeds)
    return tokens, layout, seeds


def explain(fn, *inputs):
    """``(graphs, breaks, Counter of 'reason @ file:line')`` of one call of ``fn``."""
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*inputs)
    where = Counter()
    for b in ex.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        at = "?"
        if frame:
            path = os.path.normpath(frame.filename).split("site-packages/")[-1]
            at = f"{os.path.relpath(path, REPO) if path.startswith(REPO) else path}:{frame.lineno}"
        where[f"{b.reason.splitlines()[0][:70]} @ {at}"] += 1
    return ex.graph_count, ex.graph_break_count, where


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"  # the path a GPU runs
    setup_megatron(args.threads)
    from megatron_lol.config.schema import ParallelConfig
    from megatron_lol.model.lol_model import LoLGPTModel

    tokens, layout, seeds = tokens_and_layout(args)
    labels = torch.roll(tokens, -1, dims=1)
    rows = []
    for packed in (False, True):
        grouped = ParallelConfig(routed_core="grouped")  # what CUDA's auto builds
        net = LoLGPTModel(
            model_config(args), VOCAB, EOD, parallel=grouped, init_seed=3, packed_sequences=packed
        ).train()
        rope, steps, h = net.rotary(args.seq), net.core.plan.steps(), net.cfg.hidden_size

        def core(x, net=net, rope=rope, steps=steps):
            out = net.core(x, layout.document_layout(), rope, steps, depth=args.depth, backprop_depth=2, layout=layout)
            return out.states, out.aux_loss

        shape = (args.batch * args.seq, 1, h) if packed else (args.seq, args.batch, h)
        name = "packed" if packed else "local"
        rows.append((f"core grouped ({name})", *explain(core, torch.randn(shape, dtype=torch.bfloat16))))
        if not packed:
            rows.append(
                ("model grouped (local)", *explain(lambda t, y: net(t, labels=y, layout=layout), tokens, labels))
            )
    executed = args.depth
    dense = LoLGPTModel(model_config(args, kind="dense", layers=executed), VOCAB, EOD, init_seed=3).train()
    rows.append((f"dense ({executed} core layers)", *explain(lambda t, y: dense(t, labels=y), tokens, labels)))

    print(f"{'forward':<28} {'graphs':>7} {'breaks':>7}")
    for name, graphs, breaks, _ in rows:
        print(f"{name:<28} {graphs:>7} {breaks:>7}")
    print("\nbreak reasons (distinct, per forward)")
    for name, _, _, where in rows:
        for reason, n in where.most_common():
            print(f"  {name:<26} {n:>3}  {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
