"""Window arithmetic (docs/model.md, "Windows") in plain Python (no torch).

Shared by the model (:mod:`megatron_lol.model.windows`) and the FLOP model
(:mod:`megatron_lol.perf.flops`, which must stay importable without torch), so
the window offsets and allowed-pair counts have one definition.
"""

from __future__ import annotations


def window_offset(depth: int, window_size: int, window_shift: int) -> int:
    """``delta_l = ((l - 1) * S) mod W`` for 1-based depth ``l``."""
    return ((depth - 1) * window_shift) % window_size


def window_lengths(n: int, window_size: int, offset: int) -> list[int]:
    """Lengths of the clipped windows of a document of ``n`` tokens shifted by ``offset``."""
    if n <= 0:
        return []
    first = min(n, window_size - offset)
    lengths = [first]
    rest = n - first
    lengths += [window_size] * (rest // window_size)
    if rest % window_size:
        lengths.append(rest % window_size)
    return lengths


def causal_pairs(n: int) -> int:
    """(query, key) pairs of full causal attention over ``n`` tokens."""
    return n * (n + 1) // 2


def windowed_pairs(n: int, window_size: int, offset: int = 0) -> int:
    """Allowed (query, key) pairs of one document at a depth with window offset ``offset``."""
    return sum(causal_pairs(k) for k in window_lengths(n, window_size, offset))
