"""What the checkpoint checksums cost: SHA-256 of files just written, as the save's commit computes them.

    python bench/checkpoint_hash.py [--mib 256] [--ranks 8]

Writes ``--mib`` MiB of random bytes to a temporary file, then times
:func:`megatron_lol.training.checkpointing.files.file_digest` on it twice: a
re-read from the page cache (as at save time, right after megatron-core's writer
wrote the shard), and the same with the ``fsync`` the commit adds (it also
flushes what the write left dirty). It prints the rates and the seconds this
costs each rank for the checkpoint of a 1B and a 7B parameter model with BF16
weights, FP32 main parameters and Adam's two moments (14 bytes per parameter),
its files divided over ``--ranks`` ranks (each rank hashes its own shards).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_lol.training.checkpointing.files import file_digest  # noqa: E402

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # BF16 weights, FP32 main parameters, Adam exp_avg and exp_avg_sq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the test file (MiB)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks the checkpoint files are divided over")
    args = parser.parse_args()
    size = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "shard.bin")
        rates = {}
        for sync in (False, True):
            with open(path, "wb") as f:  # freshly written (dirty pages) for each measurement
                f.write(os.urandom(size))
            t0 = time.perf_counter()
            file_digest(path, sync=sync)
            rates[sync] = size / (time.perf_counter() - t0) / 2**20
    print(
        f"SHA-256 of a file just written ({args.mib} MiB): {rates[False]:,.0f} MiB/s from the page cache, "
        f"{rates[True]:,.0f} MiB/s with fsync"
    )
    for billions in (1, 7):
        total = billions * 1e9 * BYTES_PER_PARAM / 2**20
        per_rank = total / args.ranks
        print(
            f"{billions}B parameters: checkpoint {total / 1024:,.0f} GiB, {per_rank / 1024:,.1f} GiB per rank "
            f"over {args.ranks} ranks: {per_rank / rates[False]:,.1f} s of hashing per rank "
            f"({per_rank / rates[True]:,.1f} s with fsync)"
        )


if __name__ == "__main__":
    main()
