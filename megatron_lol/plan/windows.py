"""The ``windows`` sub-section of a plan kind: the window geometry W (``size``) and S (``shift``)
(docs/model.md, "The routed core" and "Execution plans").

LoL's router picks a block per window: the windows of depth ``l`` are ``size`` tokens long,
shifted by ``((l - 1) * shift) mod size``. The fixed kinds' ``sliding`` / ``strided`` attention
(``model.plan.attention``) uses the same geometry, so it is one definition, included as the
``windows`` option of every kind that has windows (``model.plan: {kind: lol, windows: {size: 64}}``,
``{kind: dense, layers: 8, attention: strided, windows: {size: 64}}``); a kind without windows
(accordion) has no such keys.

The ``attention`` option and its ``windows`` are one mixin (:class:`FixedAttention`) that the fixed
kinds calling ``ExecutionPlan._fixed_attention`` inherit, so they share the keys and the checks.

This module is pure Python (no torch): the config validates against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lol.checks import choice, positive
from megatron_lol.errors import ConfigError

#: a fixed kind's attention inside the core: full causal, sliding over the last ``size`` tokens,
#: or LoL's shifted windows with a fixed block per depth (``strided``)
FIXED_ATTENTION = ("full", "sliding", "strided")


@dataclass
class WindowOptions:
    """The windows' length W and the shift S of each depth's windows against the previous depth's."""

    size: int = 32  # W
    shift: int = 16  # S: depth l is shifted by ((l-1)*S) mod W

    def validate(self, prefix: str) -> None:
        """``prefix``: the sub-section's key as the user writes it (``model.plan.windows``)."""
        positive(f"{prefix}.size", self.size)
        if not isinstance(self.size, int) or isinstance(self.size, bool):
            raise ConfigError(f"{prefix}.size: must be an integer (got {self.size!r})")
        if isinstance(self.shift, bool) or not isinstance(self.shift, int) or not 0 <= self.shift < self.size:
            raise ConfigError(f"{prefix}.shift: must be in [0, size={self.size}) (got {self.shift!r})")


def windows_option():
    """The ``windows`` field of a kind's ``Options``: the one :class:`WindowOptions` definition."""
    return field(default_factory=WindowOptions, metadata={"help": "the windows' size W and shift S"})


def windows_of(model) -> WindowOptions:
    """The ``windows`` sub-section of ``model``'s plan (a ``ModelConfig``); for a kind without windows,
    the defaults: code that runs for every kind (the exported ``config.json``, the host layout of a
    plan whose steps are never windowed) reads them, and no step of such a kind uses them."""
    return getattr(model.plan, "windows", None) or WindowOptions()


@dataclass
class FixedAttention:
    """The attention of a fixed kind's core steps (``model.plan.attention``) and the windows that its
    ``sliding`` / ``strided`` modes use (``model.plan.windows``); inherited by the kinds' ``Options``."""

    attention: str = field(default="full", metadata={"help": "full | sliding | strided, inside the core"})
    windows: WindowOptions = windows_option()

    def validate_attention(self, prefix: str) -> None:
        choice(f"{prefix}.attention", self.attention, FIXED_ATTENTION)
        self.windows.validate(f"{prefix}.windows")


def fixed_attention_of(model) -> str:
    """``model.plan.attention`` of a fixed kind; ``full`` for a kind without the option (lol attends
    inside its routed windows, accordion causally): what the exported ``config.json`` records."""
    return getattr(model.plan, "attention", "full")
