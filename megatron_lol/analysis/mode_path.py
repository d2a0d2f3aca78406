"""The mode path (docs/model.md, "Path forcing").

A mode path averages the *pre-bias* router probabilities ``a`` over validation
examples per (depth, window ordinal) and freezes the argmax of the average and
its mean probability as the block id and gate of a :class:`ForcedPath`.

Choices (also in docs/model.md, "Path forcing"):

* every window with a given (depth, ordinal) is one observation, so a row
  holding several documents contributes one observation per document that
  reaches that ordinal; ordinals reached by only some documents are averaged
  over those that reach them;
* ordinals reached by no observation get id ``-1`` (routed normally) and gate 0;
* ties in the argmax of the average go to the lowest block index, as in routing.

The records come from ``model(..., record=True)`` in eval mode
(``CoreOutput.records`` of ``model(..., record=True, return_core=True)``); their ``probs``
are the router's softmax, before the balancing bias (the bias is used only to choose).
"""

from __future__ import annotations

from typing import Sequence

import torch


def mode_path_from_records(records_per_example: Sequence[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [D, K] long, gates [D, K] float32)`` from a list (one per example) of
    per-depth routing records (objects with ``probs [N, L]`` and ``window_ordinal [N]``).
    """
    examples = [list(r) for r in records_per_example]
    if not examples or not examples[0]:
        raise ValueError("mode_path_from_records: no records")
    depth = len(examples[0])
    if any(len(r) != depth for r in examples):
        raise ValueError("mode_path_from_records: every example must record the same number of depths")
    num_blocks = examples[0][0].probs.shape[-1]
    k_max = 1 + max(int(rec.window_ordinal.max()) for r in examples for rec in r if rec.window_ordinal.numel())
    sums = torch.zeros(depth, k_max, num_blocks, dtype=torch.float64)
    counts = torch.zeros(depth, k_max, dtype=torch.float64)
    for records in examples:
        for d, rec in enumerate(records):
            if rec.probs is None:
                raise ValueError("mode_path_from_records: a record without router probabilities (fixed plan)")
            ordinal = rec.window_ordinal.detach().cpu().long()
            sums[d].index_add_(0, ordinal, rec.probs.detach().cpu().to(torch.float64))
            counts[d].index_add_(0, ordinal, torch.ones(ordinal.numel(), dtype=torch.float64))
    mean = sums / counts.clamp(min=1).unsqueeze(-1)
    best, ids = mean.max(dim=-1)  # first maximal index on ties
    seen = counts > 0
    ids = torch.where(seen, ids, torch.full_like(ids, -1))
    gates = torch.where(seen, best, torch.zeros_like(best)).to(torch.float32)
    return ids, gates
