"""What FP8's row padding costs a routed core: padded rows per routed depth, from the model's own windows.

Under FP8 each block's packed windows at a routed depth are padded with zero rows to a multiple of 16
(megatron_lol/model/precision.py). This counts those rows for the paper's W=128 configs: the windows of
every depth (megatron_lol.model.windows, shifted by ((l-1) S) mod W and clipped at document and row
boundaries) over micro-batches of synthetic rows of documents (lengths uniform in [seq/4, seq), cut at
the row's end: the profiler's synthetic data), each window sent to a block uniformly at random (balanced routing's
expected loads) or all to one block (the least padding) -- and prints, per config, the padding as a share
of the routed blocks' rows (= of their GEMM FLOPs) and of all layer rows of a step.

    python bench/fp8_padding.py [--batches 4]
"""

from __future__ import annotations

import argparse

import torch

CONFIGS = [  # (name, L, D, W, S, prelude + coda layers, seq, micro-batch)
    ("lol-360m-L4, paper batch", 4, 16, 128, 64, 8, 1024, 26),
    ("lol-360m-L4, run_all.sh", 4, 16, 128, 64, 8, 2048, 8),
    ("lol-360m-L2", 2, 16, 128, 64, 8, 1024, 26),
    ("lol-360m-L8", 8, 16, 128, 64, 8, 1024, 26),
    ("lol-360m-L4, micro-batch 1", 4, 16, 128, 64, 8, 1024, 1),
]
MULTIPLE = 16


def padded_rows(counts: torch.Tensor) -> int:
    return int(((-counts) % MULTIPLE).sum())


def document_starts(seq: int, mbs: int, gen: torch.Generator) -> torch.Tensor:
    """``[mbs, seq]`` bool: where documents start (lengths uniform in [seq/4, seq), cut at the row's end)."""
    starts = torch.zeros(mbs, seq, dtype=torch.bool)
    for row in range(mbs):
        pos = 0
        while True:
            pos += int(torch.randint(max(2, seq // 4), max(3, seq), (1,), generator=gen))
            if pos >= seq:
                break
            starts[row, pos] = True
    return starts


def measure(L: int, D: int, W: int, S: int, seq: int, mbs: int, batches: int, seed: int = 0) -> dict:
    from megatron_lol.model.windows import DocumentLayout, WindowLayout

    gen = torch.Generator().manual_seed(seed)
    rows = pad_uniform = pad_one = 0
    for _ in range(batches):
        docs = DocumentLayout.from_starts(document_starts(seq, mbs, gen))
        for depth in range(1, D + 1):
            windows = WindowLayout.build(docs, depth, W, S)
            choice = torch.randint(0, L, (windows.num_windows,), generator=gen)
            per_block = torch.zeros(L, dtype=torch.long).index_add_(0, choice, windows.window_length)
            pad_uniform += padded_rows(per_block)
            pad_one += padded_rows(windows.window_length.sum().view(1))
            rows += int(windows.window_length.sum())
    return {"rows": rows, "uniform": pad_uniform / rows, "one_block": pad_one / rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batches", type=int, default=4, help="micro-batches per config (default 4)")
    args = ap.parse_args()
    print(f"FP8 row padding to multiples of {MULTIPLE}, routed depths only; {args.batches} micro-batches per config")
    print(
        f"{'config':28s} {'L':>2s} {'tokens/mb':>9s} {'pad rows, uniform routing':>26s} "
        f"{'all to one block':>17s} {'of all layer rows':>18s}"
    )
    for name, L, D, W, S, fixed, seq, mbs in CONFIGS:
        r = measure(L, D, W, S, seq, mbs, args.batches)
        share_of_layers = r["uniform"] * D / (D + fixed)  # fixed layers and the head are never padded
        print(
            f"{name:28s} {L:2d} {seq * mbs:9d} {100 * r['uniform']:25.3f}% {100 * r['one_block']:16.3f}% "
            f"{100 * share_of_layers:17.3f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
