"""Growing-depth schedule (docs/model.md, "Growing depth").

The core starts shallow: at 0-based step ``t`` of a growth period of ``T``
steps it runs

    depth(t) = ceil(D0 + (D - D0) * (1 - sqrt(1 - t / T)))    for t < T
    depth(t) = D                                             for t >= T

routed depths ``1..depth(t)`` (with the full core's window offsets). The value
is computed exactly, in integer / rational arithmetic: with ``c = D - D0``,

    ceil(D0 + c - sqrt(c^2 (T - t) / T)) = D - floor(sqrt(c^2 (T - t) / T))
                                         = D - isqrt(floor(c^2 (T - t) / T))

(``floor(sqrt(q)) == isqrt(floor(q))`` for rational ``q >= 0``). A float
``ceil`` gives 7 instead of 6 at ``t=5, T=9, D0=1, D=16``. ``T`` may be a
non-integer number of steps (e.g. ``0.75 * train_iters``); floats are read as
the decimal they print as, so every rank computes the same depth.

The growth period of a run is ``floor(growth_fraction * train_iters)`` in the
same exact arithmetic (:func:`growth_period`): ``0.29 * 100`` is 29, where
binary floating point gives ``28.999999999999996`` and so 28.

How many steps a run spends at each depth (:func:`steps_per_depth`) follows from
the same formula without visiting the steps: for ``k = D - d >= 1``, ``depth(t) <= d``
iff ``c^2 (T - t) / T >= k^2`` iff ``t <= T (c^2 - k^2) / c^2``, so the steps at
depth ``d`` or below are the integers ``0 .. floor(T (c^2 - k^2) / c^2)``. A run's
FLOPs (and the iterations a FLOP budget buys, ``training.train_flops``) sum over
``D - D0 + 1`` depths instead of ``train_iters`` steps.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Union

Number = Union[int, float, Fraction]


def _exact(x: Number) -> Fraction:
    if isinstance(x, float):
        return Fraction(repr(x))
    return Fraction(x)


def depth_at_step(step: Number, growth_iters: Number, initial_depth: int, full_depth: int) -> int:
    """Routed depth at 0-based ``step`` with growth period ``growth_iters`` (exact).

    ``initial_depth`` is ``D0`` (depth at step 0), ``full_depth`` is ``D``.
    ``growth_iters <= 0`` means no growing (always ``D``).
    """
    if not 1 <= initial_depth <= full_depth:
        raise ValueError(f"initial_depth must be in [1, full_depth={full_depth}] (got {initial_depth})")
    t, T = _exact(step), _exact(growth_iters)
    if t < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    if T <= 0 or t >= T:
        return full_depth
    c = full_depth - initial_depth
    q = c * c * (T - t) / T  # (c * sqrt(1 - t/T))^2, a non-negative rational
    return full_depth - math.isqrt(q.numerator // q.denominator)


def growth_period(growth_fraction: Number, train_iters: int) -> int:
    """``floor(growth_fraction * train_iters)``, the fraction read as the decimal it prints as."""
    return math.floor(_exact(growth_fraction) * train_iters)


def steps_per_depth(train_iters: int, full_depth: int, initial_depth: Optional[int], growth_fraction: Number) -> dict:
    """``{depth: steps}`` of a run of ``train_iters`` steps (exact; equal to counting
    :func:`depth_at` over every step). Depths with no step are left out."""
    if train_iters <= 0:
        return {}
    if initial_depth is None:
        return {full_depth: train_iters}
    if not 1 <= initial_depth <= full_depth:
        raise ValueError(f"initial_depth must be in [1, full_depth={full_depth}] (got {initial_depth})")
    T = growth_period(growth_fraction, train_iters)
    c = full_depth - initial_depth
    counts: dict = {}
    below = 0  # steps at depth < d
    if T > 0 and c > 0:
        for d in range(initial_depth, full_depth):
            k = full_depth - d
            at_most = min(T, (T * (c * c - k * k)) // (c * c) + 1)  # steps 0 .. floor(T (c^2 - k^2) / c^2)
            if at_most > below:
                counts[d] = at_most - below
            below = at_most
    counts[full_depth] = train_iters - below
    return {d: n for d, n in counts.items() if n}


def depth_at(
    step: int, full_depth: int, initial_depth: Optional[int], growth_fraction: Number, train_iters: int
) -> int:
    """Core depth of a run at 0-based ``step``: ``full_depth`` without growing
    (``initial_depth`` None), else the growing schedule over :func:`growth_period`."""
    if initial_depth is None:
        return full_depth
    return depth_at_step(step, growth_period(growth_fraction, train_iters), initial_depth, full_depth)
