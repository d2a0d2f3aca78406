"""Routing metrics of a looped MoE core (Foil): U_t, B2 and MMR (docs/model.md, "Foil").

Each property stated below is a test (tests/test_foil_accordion.py):

* **U_t, distinct experts reached per token**: for token ``t`` and block layer
  ``d``, the union over passes of the top-k sets ``S_{t,d}^{(p)}``; summed over
  the layers of the looped block, averaged over tokens. Without looping it is
  ``k * D`` (16 for (E, D, L) = (8, 8, 1)); its cap is ``D * min(E, k L)``.
* **B2, load balance** of one (layer, pass): with ``q_i`` the share of the
  routing assignments that went to expert ``i``, ``B2 = 1 / (E * sum_i q_i^2)``,
  the effective number of experts (inverse Simpson / Renyi-2) over ``E``: 1 for
  a uniform load, ``1/E`` when one expert takes everything, and unchanged when
  every logit vector is mapped to ``a z + b`` (``a > 0``), because the top-k
  selections are. Reported per pass as the mean over the block's layers.
* **MMR, median margin ratio**: per routing decision ``R = p_(1) / p_(m)``, the
  top probability over the probability at the median rank ``m = ceil(E/2)``,
  i.e. ``exp(z_(1) - z_(m))`` in logits; aggregated as a geometric mean over
  decisions (per pass, and over all passes for the model-level figure). Then
  MMR >= 1, MMR = 1 exactly when the top ``m`` logits coincide at every decision
  (``z = (0,0,0,0,-c,-c,-c,-c)`` gives 1), and ``a z + b`` sends MMR to ``MMR^a``
  — three properties of the definition.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch


def load_balance_b2(routing_map: torch.Tensor) -> float:
    """``1 / (E sum q_i^2)`` from a ``[T, E]`` boolean routing map."""
    counts = routing_map.sum(dim=0).double()
    total = counts.sum()
    if total == 0:
        return float("nan")
    q = counts / total
    return float(1.0 / (routing_map.shape[1] * (q * q).sum()))


def log_margin_ratios(logits: torch.Tensor) -> torch.Tensor:
    """``z_(1) - z_(m)`` per decision (``[T]``), ``m = ceil(E/2)``: the log of ``p_(1)/p_(m)``."""
    z = logits.double().sort(dim=-1, descending=True).values
    m = math.ceil(z.shape[-1] / 2)
    return z[:, 0] - z[:, m - 1]


def median_margin_ratio(logits: Iterable[torch.Tensor]) -> float:
    """Geometric mean of ``p_(1)/p_(m)`` over every decision of the given ``[T, E]`` logits."""
    logs = [log_margin_ratios(x) for x in logits]
    if not logs:
        return float("nan")
    return float(torch.cat(logs).mean().exp())


def distinct_experts_per_token(records) -> float:
    """Mean over tokens of ``sum_d |union_p S_{t,d}^{(p)}|`` (records of one forward pass)."""
    reached = {}
    for r in records:
        prev = reached.get(r.block)
        reached[r.block] = r.routing_map if prev is None else prev | r.routing_map
    if not reached:
        return float("nan")
    per_token = sum(m.sum(dim=1).double() for m in reached.values())
    return float(per_token.mean())


def summarise(records, num_experts: int, topk: int) -> dict:
    """U_t, B2 and MMR of a list of :class:`~megatron_lol.model.core.MoERecord`.

    Records may come from several micro-batches: U_t unions passes within one
    forward pass only, so records are split into forward passes where a block's
    pass index restarts (or repeats).
    """
    passes = defaultdict(list)
    for r in records:
        passes[r.pass_index].append(r)
    by_pass = []
    for p in sorted(passes):
        rs = passes[p]
        by_pass.append(
            {
                "pass": p,
                "b2": sum(load_balance_b2(r.routing_map) for r in rs) / len(rs),
                "mmr": median_margin_ratio(r.logits for r in rs),
                "decisions": sum(len(r.logits) for r in rs),
            }
        )
    forwards, current, seen = [], [], set()
    for r in records:
        key = (r.block, r.pass_index)
        if key in seen:
            forwards.append(current)
            current, seen = [], set()
        current.append(r)
        seen.add(key)
    if current:
        forwards.append(current)
    u_t = [distinct_experts_per_token(f) for f in forwards]
    blocks = len({r.block for r in records})
    return {
        "distinct_experts_per_token": sum(u_t) / len(u_t),
        "distinct_experts_cap": blocks * min(num_experts, topk * len(passes)),
        "b2": sum(p["b2"] for p in by_pass) / len(by_pass),
        "mmr": median_margin_ratio(r.logits for r in records),
        "by_pass": by_pass,
    }
