"""Sizes of routed paths (docs/model.md, "Parameter accounting")."""

from __future__ import annotations


def expected_distinct_blocks(num_blocks: int, depth: int) -> float:
    """``E[U] = L (1 - (1 - 1/L)^D)``: expected number of distinct blocks on one path of
    ``D`` routed depths when every depth picks one of ``L`` blocks uniformly and
    independently (7.06 for L=8, 11.85 for L=24 at D=16).
    """
    if num_blocks < 1 or depth < 0:
        raise ValueError(f"need num_blocks >= 1 and depth >= 0 (got L={num_blocks}, D={depth})")
    L = num_blocks
    return L * (1.0 - (1.0 - 1.0 / L) ** depth)
