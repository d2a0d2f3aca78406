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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from megatron_lol.model.windows import WindowLayout, segment_means, segmented_inclusive_sum


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
    chosen = choice.unsqueeze(-1) == torch.arange(probs.shape[-1], device=probs.device)
    gate = torch.where(chosen, probs, 0).sum(dim=-1)
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


def router_summaries(windows: WindowLayout, states: torch.Tensor, depth_vector: torch.Tensor) -> torch.Tensor:
    """``r_k`` for every window of a depth, fp32 ``[N, h]``.

    ``states`` is the *input* of the depth, flattened ``[T, h]``.
    """
    means, first = window_inputs(windows, states)
    summaries = windows.prefix_means(means)
    r0 = 0.5 * (depth_vector.float().unsqueeze(0) + first)
    return torch.where((windows.window_ordinal == 0).unsqueeze(1), r0, summaries)


def depth_only_summaries(num_windows: int, depth_vector: torch.Tensor) -> torch.Tensor:
    """``r = e^(l)`` for every window (``router_input: depth``), fp32 ``[N, h]``.

    The route then depends on the depth alone (plus training noise): the same library, masks,
    FiLM and growth schedule on a learned route that does not read the input, the control that
    tells input adaptivity apart from the rest of the architecture.
    """
    return depth_vector.float().unsqueeze(0).expand(num_windows, -1)


def router_only_prefix_means(
    embeddings: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, bound: int
) -> torch.Tensor:
    """Per token ``t`` of a row-major stream: the mean router embedding of the router-only tokens of
    ``t``'s document at positions up to and including ``t`` (zero where there is none), fp32 ``[T, h]``.

    ``index`` [T]: each token's row of ``embeddings`` ``[n, h]``, -1 for an ordinary token;
    ``positions`` [T]: position in the document; ``bound``: an upper bound of a position + 1 (the
    row length). Sums and counts are one running sum per document that restarts at position 0
    (:func:`~.windows.segmented_inclusive_sum`): a fixed order, no atomics and no floating-point
    ``cumsum``, the same bits on every rank and device.
    """
    is_ro = index >= 0
    rows = embeddings.float().index_select(0, index.clamp(min=0))
    rows = torch.where(is_ro.unsqueeze(1), rows, 0.0)
    both = segmented_inclusive_sum(torch.cat([rows, is_ro.to(torch.float32).unsqueeze(1)], dim=1), positions, bound)
    sums, counts = both[:, :-1], both[:, -1:]
    return sums / counts.clamp(min=1.0)


def window_inputs(windows: WindowLayout, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the router reads of the depth's input: window means ``mu_j`` and first-token rows, fp32 ``[N, h]``.

    Values are ``windows.window_means(states)`` and ``states[first].float()``.
    With gradients, one autograd Function (:class:`_WindowInputs`) gives the
    states one dense gradient for both: written in one pass, not the means'
    expanded gradient plus a zero-filled (or sparse, which autograd adds by
    copying the dense one) tensor for a few first-token rows.
    """
    if not (torch.is_grad_enabled() and states.requires_grad):
        return windows.window_means(states), states.index_select(0, windows.window_first_token).float()
    return _WindowInputs.apply(
        states, windows.token_window, windows.window_length, windows.window_first_token, windows._max_length()
    )


class _WindowInputs(torch.autograd.Function):
    """``(window means, first-token rows)`` of ``states``, both fp32; see :func:`window_inputs`.

    Forward is ``windows.segment_means`` (what ``WindowLayout.window_means``
    runs) and an ``index_select``. Backward: the means' gradient divided by the lengths,
    expanded to the tokens, plus the first rows' gradient at their rows, cast back to the
    states' dtype: the sum autograd would form for the two, in one buffer. Both are gathers
    (every token reads its window's row) and an elementwise select, no scatter-add: the
    same bits on every rank.
    """

    @staticmethod
    def forward(ctx, states, token_window, window_length, first_token, max_length):
        ctx.save_for_backward(token_window, window_length, first_token)
        ctx.dtype = states.dtype
        return (
            segment_means(states, first_token, window_length, max_length),
            states.index_select(0, first_token).float(),
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_means, grad_first):
        token_window, window_length, first_token = ctx.saved_tensors
        if grad_means is None:
            grad = torch.zeros(
                token_window.shape[0], grad_first.shape[-1], dtype=torch.float32, device=grad_first.device
            )
        else:
            grad = (grad_means / window_length.unsqueeze(1).to(torch.float32)).index_select(0, token_window)
        if grad_first is not None:
            tokens = torch.arange(token_window.shape[0], device=token_window.device)
            is_first = (first_token.index_select(0, token_window) == tokens).unsqueeze(1)
            grad = grad + torch.where(is_first, grad_first.index_select(0, token_window), 0)
        return grad.to(ctx.dtype), None, None, None, None
