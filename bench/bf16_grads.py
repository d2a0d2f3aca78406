#!/usr/bin/env python
"""BF16 block weight gradients of the grouped routed core against the reference core's, both against FP32.

Both paths train BF16 with megatron-core's ``gradient_accumulation_fusion``: the
reference core (per-block layer calls) adds each call's weight gradient, formed
in FP32, to the block's FP32 ``main_grad``; the grouped core
(``model/grouped_blocks.py``) adds each depth's gradient of the stacked weights
(one grouped GEMM's BF16 output per depth) to it. What BF16 training costs the
library's gradients on either path: one micro-batch through the core (the same
weights, input and output gradient) in FP32 (the truth) and in BF16 by both
paths; per block weight, ``|g - g_fp32| / |g_fp32|``; the table gives the mean
and the worst over the library's weights, for each number of routed depths
``D``. (The FP32 accumulation itself, against float64, is checked by
``tests/test_gpu_first_run.py -k accumulate``.)

    python bench/bf16_grads.py                  # D = 4, 12, 24
    python bench/bf16_grads.py --depths 8 --hidden 128
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from _shared import add_threads_arg, setup_megatron  # bench/ is sys.path[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int, nargs="+", default=[4, 12, 24])
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=3)
    add_threads_arg(p)
    return p.parse_args(argv)


def build(args, depth: int, dtype: str):
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.lol_model import LoLGPTModel

    model = dict(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=2 * args.hidden,
        plan=dict(kind="lol", num_blocks=args.blocks, routed_depth=depth, windows={"size": 8, "shift": 4}),
        n_prelude=1,
        n_coda=1,
        params_dtype=dtype,
    )
    cfg = config_from_dict({"model": model}).model
    net = LoLGPTModel(cfg, 97, 0, init_seed=args.seed, gradient_accumulation_fusion=dtype == "bf16")
    gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():  # routes spread over the blocks (zero-initialised routers tie everywhere)
        for router in net.core.routers:
            router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen))
    return net.train()


def block_grads(net, impl: str, layout, seeds, x0, grad_out, depth: int) -> dict:
    """One core forward + backward; each block weight's gradient as megatron-core's DDP would see it
    (``main_grad`` plus a gradient autograd left in ``.grad``)."""
    core = net.core
    for p in core.parameters():
        p.grad = None
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    x = x0.to(net.core.tconfig.params_dtype).requires_grad_(True)
    rope = net.rotary(x0.shape[0])
    steps = core.plan.steps()
    from megatron_lol.model.executors import GroupedGEMMs, PerBlockCalls

    core.executor = GroupedGEMMs() if impl == "grouped" else PerBlockCalls()  # as routed_core would build it
    out = core(x, layout.document_layout(), rope, steps, depth=depth, layout=layout, noise_seeds=seeds)
    out.states.backward(grad_out.to(x.dtype))
    grads = {}
    for name, p in core.named_parameters():
        if name.startswith("blocks."):
            g = p.main_grad.clone()
            if p.grad is not None and not p.grad_added_to_main_grad:
                g += p.grad.float()
            grads[name] = g
    return grads


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron-core's notes on missing apex / TE
    os.environ["MEGATRON_LOL_CPU_BACKEND"] = "0"  # the per-block executor's layer calls, as on a GPU
    setup_megatron(args.threads)
    from megatron_lol.model.host_layout import build_host_layout

    g = torch.Generator().manual_seed(args.seed + 2)
    tokens = torch.randint(1, 97, (args.batch, args.seq), generator=g)
    tokens[torch.rand(args.batch, args.seq, generator=g) < 0.05] = 0
    seeds = torch.arange(1, args.batch + 1)
    x0 = torch.randn(args.seq, args.batch, args.hidden, generator=g)
    grad_out = torch.randn(args.seq, args.batch, args.hidden, generator=g)

    print(f"{'D':>4} {'path':<26} {'mean rel. error':>16} {'worst':>10}")
    for depth in args.depths:
        layout = build_host_layout(tokens, 0, 8, 4, range(1, depth + 1), args.blocks, seeds)
        fp32 = build(args, depth, "fp32")
        truth = block_grads(fp32, "reference", layout, seeds, x0, grad_out, depth)
        bf16 = build(args, depth, "bf16")
        with torch.no_grad():
            for p, q in zip(bf16.parameters(), fp32.parameters()):
                p.copy_(q)
        for impl, label in (("reference", "reference (per block call)"), ("grouped", "grouped (per depth)")):
            got = block_grads(bf16, impl, layout, seeds, x0, grad_out, depth)
            errors = [float((got[n] - truth[n]).norm() / truth[n].norm()) for n in truth]
            print(f"{depth:>4} {label:<26} {sum(errors) / len(errors):>16.2e} {max(errors):>10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
