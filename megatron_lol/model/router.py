"""The causal window router (docs/model.md, "Router").

For window ``k`` of a document at routed depth ``l`` the router reads only the
past of the window:

    r_0 = 0.5 * (e^(l) + s_first_token_of_window_0)       e^(l): learned per-depth vector
    r_k = (1/k) * sum_{j<k} mu_j                          mu_j: mean of window j's input states
    z   = W_r r + b_r                                     fp32 logits over the L blocks
    z~  = z + eps * min(softplus(W_n z + b_n), 10)        training only, eps ~ N(0, I)
    a   = softmax(z~)
    rho = argmax_m (a_m + b_m)                            b: balancing bias, only to choose
    alpha = a_rho                                         the unbiased probability is the gate

No gradient flows through ``rho``; the LM loss reaches the router through
``alpha`` only. Ties in the argmax go to the lowest block index.

This module holds the router's parameters, the top-1 rule and its noise; a
routed depth computes its summaries, decision, loads and update with them in
:mod:`.static_routing` and :mod:`.executors`, one path on every device and
layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lol.model.windows import WindowLayout


@dataclass
class RoutingDecision:
    """What the router decided for the windows of one depth."""

    probs: torch.Tensor  # [N, L] a (noise included in training), fp32
    choice: torch.Tensor  # [N] rho
    gate: torch.Tensor  # [N] alpha = a_rho (carries the router's gradient)


def choose_blocks(probs: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 by ``a + b``; gate is the unbiased ``a`` of the chosen block.

    ``torch.argmax`` returns the first maximal index, which is the tie rule of docs/model.md, "Router".
    """
    biased = probs if bias is None else probs + bias.to(probs.dtype)
    choice = torch.argmax(biased.detach(), dim=-1)
    # a_rho as a masked sum (one non-zero term: exact) rather than ``gather``, whose backward is a
    # scatter-add (CUDA atomics): the router's gradient is the same on every rank that computes it
    others = choice.unsqueeze(-1) != torch.arange(probs.shape[-1], device=probs.device)
    gate = probs.masked_fill(others, 0).sum(dim=-1)
    return choice, gate


class WindowRouter(nn.Module):
    """One linear router ``(W_r, b_r, W_n, b_n)``: ``d*L + L^2 + 2L`` parameters.

    Kept in fp32 whatever the model precision: window means, prefix sums and
    logits are computed in fp32 (docs/model.md, "Router").
    """

    def __init__(self, hidden_size: int, num_blocks: int, noise: bool = True, noise_clamp: float = 10.0):
        super().__init__()
        self.num_blocks = num_blocks
        self.noise = noise
        self.noise_clamp = noise_clamp
        self.logits = nn.Linear(hidden_size, num_blocks, dtype=torch.float32)
        # W_n, b_n start at zero: the initial noise std is softplus(0) = 0.69
        self.noise_scale = nn.Linear(num_blocks, num_blocks, dtype=torch.float32)
        with torch.no_grad():
            nn.init.zeros_(self.logits.weight)
            nn.init.zeros_(self.logits.bias)
            nn.init.zeros_(self.noise_scale.weight)
            nn.init.zeros_(self.noise_scale.bias)
        # W_r, b_r start at zero too: every window is a tie at the start (docs/model.md, "Router"),
        # broken towards block 0 and then by the balancing bias.

    def probabilities(self, summaries: torch.Tensor, eps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``softmax(z~)``; ``eps`` [N, L] is the standard normal noise (drawn here if None)."""
        z = self.logits(summaries.float())
        if self.training and self.noise:
            std = torch.clamp(F.softplus(self.noise_scale(z)), max=self.noise_clamp)
            if eps is None:
                eps = torch.randn_like(z)
            z = z + eps.to(z) * std
        return torch.softmax(z, dim=-1)


def window_noise(
    windows: WindowLayout, row_seeds: torch.Tensor, depth: int, num_blocks: int, row_length: int
) -> torch.Tensor:
    """Router noise ``eps`` [N, L] drawn per (sample, depth) from its own seed.

    Each row of the micro-batch carries a seed derived from (run seed, step,
    global sample index), so a window's noise does not depend on which rank or
    micro-batch the sample lands in: runs on different parallel layouts route
    identically, and a resumed run draws the noise the uninterrupted run drew.
    """
    rows = torch.div(windows.window_first_token, row_length, rounding_mode="floor")
    per_row = torch.bincount(rows, minlength=len(row_seeds)).tolist()
    # windows are numbered row-major, so each row's windows are one contiguous block of rows of eps;
    # each is filled in place from the row's seed (one generator, reseeded: no per-row tensors to cat)
    eps = torch.empty(windows.num_windows, num_blocks)
    gen = torch.Generator()
    start = 0
    for seed, n in zip(row_seeds.tolist(), per_row):
        if n:
            gen.manual_seed((int(seed) * 1_000_003 + depth) % (2**63 - 1))
            eps[start : start + n].normal_(generator=gen)
        start += n
    return eps.to(windows.window_first_token.device)
