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
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lol.config.schema import bias_updates_allowed
from megatron_lol.model.router import RoutingDecision
from megatron_lol.model.windows import WindowLayout, segmented_inclusive_sum


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
    def record(self, depth: int, choice: torch.Tensor) -> None:
        row = depth - 1 if self.per_depth else 0
        self.loads[row] += torch.bincount(choice, minlength=self.bias.shape[1]).to(self.loads.dtype)

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


def sequence_aux_loss(windows: WindowLayout, decision: RoutingDecision) -> torch.Tensor:
    """Per-document ``L * sum_m f_m * abar_m``, summed over documents (caller averages).

    ``f_m`` (share of the document's windows choosing m) carries no gradient;
    ``abar_m`` is the mean of the probabilities used in the forward pass.
    """
    n, num_blocks = decision.probs.shape
    device = decision.probs.device
    if n == 0:
        return decision.probs.float().sum()
    # a document's windows are consecutive: its counts and probability sums are running sums that
    # restart at ordinal 0, read at its last window (ordered sums, no scatter-add: the same bits on
    # every rank that computes them)
    ordinal = windows.window_ordinal
    bound = windows._ordinal_bound()
    chosen = (decision.choice.unsqueeze(1) == torch.arange(num_blocks, device=device)).to(torch.float32)
    counts = segmented_inclusive_sum(chosen, ordinal, bound)  # [N, L] windows per block so far
    prob_sums = segmented_inclusive_sum(decision.probs.float(), ordinal, bound)
    last = torch.cat([ordinal[1:] == 0, torch.ones(1, dtype=torch.bool, device=device)])
    windows_in_doc = (ordinal + 1).to(torch.float32)  # at a document's last window: all of them
    per_doc = (counts * prob_sums).sum(dim=1) / (windows_in_doc * windows_in_doc)  # sum_m f_m abar_m
    return num_blocks * torch.where(last, per_doc, 0).sum()


def global_aux_loss(decision: RoutingDecision) -> torch.Tensor:
    """``L * sum_m f_m * abar_m`` over all windows of the batch at one depth."""
    n, num_blocks = decision.probs.shape
    f = torch.bincount(decision.choice, minlength=num_blocks).float() / n
    abar = decision.probs.float().mean(dim=0)
    return num_blocks * (f * abar).sum()
