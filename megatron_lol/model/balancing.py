"""Load balancing of the block library (docs/model.md, "Load balancing").

* loss-free bias (default): after each optimizer step
  ``b_m -= u * sign(load_m - mean(load))``, clamped to ``[-16, 16]``; ``load_m``
  counts windows (each window once) that chose ``m``, summed over routed depths
  (global) or per depth (``per_depth_bias``), summed over every rank that saw
  different windows so all ranks hold the same bias. Updates stop after
  ``bias_update_stop_fraction`` of training.
* sequence auxiliary loss: per document ``L * sum_m f_m * abar_m`` summed over
  depths, averaged over the documents of the batch.
* ``aux_loss``: the same product over all windows of the batch (per depth,
  summed over depths), coefficient 0.02.

This module keeps the bias and its update; a depth's loads and both losses are
computed by :mod:`.static_routing` (``window_loads``, ``record_loads``,
``sequence_aux_loss``, ``global_aux_loss``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lol.config.schema import bias_updates_allowed


class BalancingBias(nn.Module):
    """The balancing bias ``b`` and the window loads counted since the last update.

    Buffers, not parameters: they are saved in checkpoints but never touched by
    the optimizer.
    """

    def __init__(
        self, num_blocks: int, routed_depth: int, per_depth: bool, speed: float, clamp: float, stop_fraction: float
    ):
        super().__init__()
        rows = routed_depth if per_depth else 1
        self.per_depth = per_depth
        self.speed = speed
        self.clamp = clamp
        self.stop_fraction = stop_fraction
        self.register_buffer("bias", torch.zeros(rows, num_blocks, dtype=torch.float32))
        self.register_buffer("loads", torch.zeros(rows, num_blocks, dtype=torch.float64), persistent=False)

    def for_depth(self, depth: int) -> torch.Tensor:
        return self.bias[depth - 1] if self.per_depth else self.bias[0]

    @torch.no_grad()
    def record(self, depth: int, loads: torch.Tensor) -> None:
        """Add one depth's window loads ``[L]`` (:func:`~.static_routing.window_loads`): a device add."""
        row = depth - 1 if self.per_depth else 0
        self.loads[row] += loads.to(self.loads.dtype)

    @torch.no_grad()
    def update(self, step: int, train_iters: int, loads: Optional[torch.Tensor] = None) -> bool:
        """Apply the sign rule after 0-based optimizer step ``step``; returns whether it did.

        ``loads``: the loads summed over every rank that saw different windows
        (the trainer reduces them over pipeline stages and data-parallel ranks);
        default: this module's own, for a single process.
        """
        loads = self.loads if loads is None else loads
        applied = False
        if self.speed > 0 and bias_updates_allowed(step, train_iters, self.stop_fraction):
            mean = loads.mean(dim=1, keepdim=True)
            self.bias -= self.speed * torch.sign(loads - mean).to(self.bias.dtype)
            self.bias.clamp_(-self.clamp, self.clamp)
            applied = True
        self.loads.zero_()
        return applied
