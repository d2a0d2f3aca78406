#!/usr/bin/env python
"""Block-call cost: the reference layer call (megatron-core's modules) against the CPU backend's short path.

A LoL depth calls each of its L blocks on that block's windows; a fixed path
calls one layer on all tokens. This times forward + backward of the same
2,048 packed tokens split over 1, 4 or 16 calls (each on a different block, as
in a LoL depth; windows of W tokens, chunked window attention), once through
the reference call (``megatron_lol.model.block_call``, megatron-core's
``SelfAttention`` and ``MLP`` modules) and once through the CPU backend's
short halves (``megatron_lol.backends.cpu.layer``), steps interleaved, and
prints the median process CPU time of each and their ratio. The outputs of the
two paths are checked to be identical first.

    python bench/layer_call.py                       # width 256, 2,048 tokens, 1 thread
    python bench/layer_call.py --hidden 512 --tokens 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _shared import add_layer_size_args, add_threads_arg, setup_megatron  # bench/ is sys.path[0]


def _calls(text: str) -> list:
    try:
        calls = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not calls or min(calls) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every number of calls must be >= 1")
    return calls


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_layer_size_args(p)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=64)
    p.add_argument(
        "--calls",
        type=_calls,
        default=[1, 4, 16],
        help="numbers of calls (blocks) the tokens are split over, e.g. 1,4,16",
    )
    p.add_argument("--reps", type=int, default=15)
    add_threads_arg(p)
    args = p.parse_args(argv)
    if max(args.calls) > args.tokens:
        p.error(f"--calls {max(args.calls)}: more calls than --tokens {args.tokens}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_megatron(args.threads)
    from megatron_lol.backends.cpu import CpuBackend
    from megatron_lol.config import config_from_dict
    from megatron_lol.model.attention import SegmentMask
    from megatron_lol.model.block_call import call_block
    from megatron_lol.model.library import block_spec, build_layer, transformer_config
    from megatron_lol.platform import device_mode_suspended

    calls = args.calls
    cfg = config_from_dict(
        {
            "model": dict(
                hidden_size=args.hidden,
                num_attention_heads=args.heads,
                ffn_hidden_size=args.ffn,
                plan=dict(kind="lol", num_blocks=max(calls)),
            )
        }
    ).model
    tconf = transformer_config(cfg)
    torch.manual_seed(0)
    blocks = [build_layer(block_spec(False), tconf, i + 1).train() for i in range(max(calls))]
    T, W = args.tokens, args.window
    head_dim = blocks[0].self_attention.hidden_size_per_attention_head
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(T, 1, args.hidden, generator=gen)
    rope = torch.randn(T, 1, 1, head_dim, generator=gen)
    segments = (torch.arange(T) // W).view(1, -1)

    def run(n: int, backend) -> torch.Tensor:
        for b in blocks:
            for p in b.parameters():
                p.grad = None
        x = x0.clone().requires_grad_(True)
        bounds = [T * i // n for i in range(n + 1)]
        outs = []
        with device_mode_suspended():
            for i in range(n):
                lo, hi = bounds[i], bounds[i + 1]
                mask = SegmentMask(segments=segments[:, lo:hi], chunk=W)
                outs.append(call_block(blocks[i], x[lo:hi], mask, rope[lo:hi], backend=backend)[0])
            y = torch.cat(outs)
        (y * y).sum().backward()
        return y.detach()

    def with_path(short: bool, n: int):
        return run(n, CpuBackend() if short else None)

    for n in calls:
        if not torch.equal(with_path(True, n), with_path(False, n)):
            print(f"error: the two paths differ at {n} calls", file=sys.stderr)
            return 1
    times = {(n, lean): [] for n in calls for lean in (False, True)}
    for _ in range(2):
        for n, lean in times:
            with_path(lean, n)
    for _ in range(args.reps):
        for n, lean in times:
            t0 = time.process_time()
            with_path(lean, n)
            times[(n, lean)].append(time.process_time() - t0)
    print(
        f"forward + backward of {T} packed tokens (windows of {W}), width {args.hidden}, "
        f"{torch.get_num_threads()} threads, median process CPU ms over {args.reps} reps"
    )
    print(
        f"{'calls':>5s} {'tokens/call':>12s} {'reference ms':>13s} {'cpu backend ms':>15s} {'backend/reference':>18s}"
    )
    for n in calls:
        ref = statistics.median(times[(n, False)]) * 1e3
        short = statistics.median(times[(n, True)]) * 1e3
        print(f"{n:5d} {T // n:12d} {ref:13.1f} {short:15.1f} {short / ref:18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
