"""The per-pass parts of a block call, written once as plain torch functions.

A plan step may give a block call parts of its own (docs/model.md, "Execution
plans"): FiLM after the block's two norms, Accordion's loop gates on the two
residual writes, input injection before the step. Their arithmetic lives here
and nowhere else: the megatron-core layers (``megatron_lol/model``) and this
remote code (shipped with every HF export, so it imports torch only) both call
these functions, which keeps the two sides equal by construction.
"""

from __future__ import annotations

import torch


def film(y: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """FiLM: ``gamma * y + beta`` per channel, on a norm's output ``y`` (docs/model.md, "FiLM")."""
    return gamma.to(y.dtype) * y + beta.to(y.dtype)


def gated_write(before: torch.Tensor, after: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A residual write scaled per channel: ``before + gate * (after - before)`` (Accordion's loop
    gates on its second pass; a gate of 1 is the ordinary write)."""
    return before + gate.to(before.dtype) * (after - before)


def inject(state: torch.Tensor, injected: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """Input injection: ``sigmoid(theta) * s + (1 - sigmoid(theta)) * s0``, mixing the core's input
    ``s0`` back into the state before a step (docs/model.md, "Input injection")."""
    mix = torch.sigmoid(logit).to(state.dtype)
    return mix * state + (1 - mix) * injected
