"""The ``routing`` sub-section of a plan kind whose router picks blocks per window (docs/model.md,
"Router" and "Load balancing").

One definition, included as the ``routing`` option of every kind that routes (``lol`` today:
``model.plan: {kind: lol, num_blocks: 8, routed_depth: 8, routing: {balancing: aux_loss}}``),
so a second routed kind takes the same keys with the same meaning and the same checks, and a
kind without a router has none of them. The window geometry (W, S) is not here but in the
``windows`` sub-section (:mod:`megatron_lol.plan.windows`): the fixed kinds' ``sliding`` /
``strided`` attention (``model.plan.attention``) uses the same windows without a router, so
``windows`` is a sub-section of its own, included by lol and by those kinds.

This module is pure Python (no torch): the config validates against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lol.checks import choice, nonnegative, positive
from megatron_lol.errors import ConfigError

BALANCING = ("loss_free", "aux_loss", "none")
ROUTER_INPUTS = ("windows", "depth")


@dataclass
class RoutingOptions:
    """The window router and its load balancing."""

    # router (docs/model.md, "Router"): one router for every depth (tied) or one per depth; Gumbel-style
    # noise on its logits in training, clamped to +-router_noise_clamp
    router_tied: bool = True
    router_noise: bool = True
    router_noise_clamp: float = 10.0
    # what the router reads: "windows" = the past windows' states (LoL); "depth" = only the depth vector
    # e^(l), a learned route that ignores the input (the control run that separates input adaptivity from
    # the shared library, masks, FiLM and growth schedule)
    router_input: str = "windows"
    # router-only tokens (docs/model.md, "Router-only tokens"): these ids reach the router only (the mean
    # of their router embeddings, up to each window's first token, is added to the router's input); the
    # layers see router_only_filler in their place and their labels carry no loss
    router_only_tokens: list = field(default_factory=list)
    router_only_filler: Optional[int] = None
    # balancing (docs/model.md, "Load balancing"): loss-free bias, an auxiliary loss, or none
    balancing: str = "loss_free"
    bias_update_speed: float = 1e-3
    bias_clamp: float = 16.0
    bias_update_stop_fraction: float = 0.966
    per_depth_bias: bool = False
    seq_aux_loss_coeff: float = 1e-4
    aux_loss_coeff: float = 0.02

    def validate(self, prefix: str) -> None:
        """``prefix``: the sub-section's key as the user writes it (``model.plan.routing``)."""

        choice(f"{prefix}.balancing", self.balancing, BALANCING)
        choice(f"{prefix}.router_input", self.router_input, ROUTER_INPUTS)
        positive(f"{prefix}.router_noise_clamp", self.router_noise_clamp)
        nonnegative(f"{prefix}.bias_update_speed", self.bias_update_speed)
        positive(f"{prefix}.bias_clamp", self.bias_clamp)
        if not 0 <= self.bias_update_stop_fraction <= 1:
            raise ConfigError(
                f"{prefix}.bias_update_stop_fraction: must be in [0, 1] (got {self.bias_update_stop_fraction})"
            )
        nonnegative(f"{prefix}.seq_aux_loss_coeff", self.seq_aux_loss_coeff)
        nonnegative(f"{prefix}.aux_loss_coeff", self.aux_loss_coeff)
        self._validate_router_only(prefix)

    def _validate_router_only(self, prefix: str) -> None:
        ids = self.router_only_tokens
        if not ids:
            if self.router_only_filler is not None:
                raise ConfigError(f"{prefix}.router_only_filler: set without {prefix}.router_only_tokens")
            return
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids) or len(set(ids)) < len(ids):
            raise ConfigError(f"{prefix}.router_only_tokens: must be distinct token ids >= 0 (got {ids})")
        if self.router_input != "windows":
            raise ConfigError(f"{prefix}.router_only_tokens: needs router_input: windows (got {self.router_input})")
        filler = self.router_only_filler
        if not isinstance(filler, int) or filler < 0 or filler in ids:
            raise ConfigError(
                f"{prefix}.router_only_filler: the token id the layers see in place of a router-only token, "
                f"not one of router_only_tokens (got {filler})"
            )


def routing_option():
    """The ``routing`` field of a routed kind's ``Options``: the one :class:`RoutingOptions` definition."""
    return field(default_factory=RoutingOptions, metadata={"help": "the window router and its load balancing"})


def routing_of(model) -> RoutingOptions:
    """The ``routing`` sub-section of ``model``'s plan (a ``ModelConfig``); for a kind without a router,
    the defaults, which nothing routes by: code that runs for every kind (the model's router-only
    buffer, the exported ``config.json``) reads them as "no router-only tokens"."""
    return getattr(model.plan, "routing", None) or RoutingOptions()
