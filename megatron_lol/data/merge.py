"""``megatron-lol merge-datasets``: concatenate indexed datasets (e.g. preprocess shards).

``--input`` takes directories (every .bin/.idx pair inside, in name order, as
Megatron-LM's ``tools/merge_datasets.py`` does), globs or dataset prefixes.
Shard outputs of ``preprocess --shard I/N`` (``*.shard-IIIII-of-NNNNN``) are
ordered by shard index and must all be present. Merging streams: memory does
not grow with the dataset, and the result is byte-identical to one unsharded
preprocess run over the same input.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

SHARD_RE = re.compile(r"^(?P<base>.*)\.shard-(?P<i>\d{5})-of-(?P<n>\d{5})$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", required=True, nargs="+", help="directory, glob or prefixes of the datasets to merge (in order)"
    )
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.bin/.idx")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--multimodal", action="store_true", help="not supported")


def _strip(path: str) -> str:
    for ext in (".idx", ".bin"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def resolve_prefixes(inputs: list) -> list:
    prefixes: list = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(_strip(p) for p in glob.glob(os.path.join(item, "*.idx")))
            if not found:
                raise ValueError(f"{item}: no .idx files")
            prefixes.extend(found)
        elif glob.has_magic(item):
            pattern = item if item.endswith((".idx", ".bin")) else item + ".idx"
            found = sorted({_strip(p) for p in glob.glob(pattern)})
            if not found:
                raise ValueError(f"{item}: no dataset matches")
            prefixes.extend(found)
        else:
            prefixes.append(_strip(item))
    seen, out = set(), []
    for p in prefixes:
        if p not in seen:
            seen.add(p)
            out.append(p)
    for p in out:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                raise ValueError(f"missing {p + ext}")
    return order_shards(out)


def order_shards(prefixes: list) -> list:
    """If the inputs are preprocess shards, sort by index and insist they are complete."""
    matches = [SHARD_RE.match(os.path.basename(p)) for p in prefixes]
    if not any(matches):
        return prefixes
    if not all(matches):
        odd = next(p for p, m in zip(prefixes, matches) if not m)
        raise ValueError(f"{odd}: mixing shard outputs with other datasets")
    groups = {(os.path.dirname(p), m["base"], int(m["n"])) for p, m in zip(prefixes, matches)}
    if len(groups) != 1:
        raise ValueError(f"shards of different datasets or shard counts: {sorted(groups)}")
    ((_, base, n),) = groups
    by_index = {int(m["i"]): p for p, m in zip(prefixes, matches)}
    missing = [i for i in range(n) if i not in by_index]
    if missing:
        raise ValueError(f"{base}: missing shard(s) {', '.join(map(str, missing))} of {n}")
    return [by_index[i] for i in range(n)]


def run(args) -> int:
    from megatron_lol.data.indexed import merge_datasets, remove_stale_tmp
    from megatron_lol.errors import CliError

    if args.multimodal:
        raise CliError("--multimodal is not supported")
    try:
        prefixes = resolve_prefixes(args.input)
        out = args.output_prefix
        if out in prefixes:
            raise ValueError(f"{out} is also an input")
        if not args.overwrite:
            for ext in (".bin", ".idx"):
                if os.path.exists(out + ext):
                    raise ValueError(f"{out + ext} exists (pass --overwrite to replace it)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise ValueError(f"output directory of {out} does not exist")
        for ext in (".bin", ".idx"):  # left by a killed merge
            remove_stale_tmp(out + ext)
        info = merge_datasets(prefixes, out)
    except (ValueError, OSError) as err:
        raise CliError(str(err)) from None
    print(
        f"merge-datasets: {info['datasets']} datasets, {info['documents']:,} documents, "
        f"{info['bytes'] / 2**20:.1f} MB ({info['dtype']}) -> {out}.bin/.idx"
    )
    return 0
