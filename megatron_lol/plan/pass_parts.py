"""The model-wide per-pass parts as plan options: ``model.plan.film`` and ``model.plan.input_injection``
(docs/model.md, "FiLM" and "Input injection").

One definition (:class:`PassParts`), inherited by the ``Options`` of every kind whose steps take them
(lol, dense, looped, foil), so the keys mean the same everywhere; a kind that cannot take them
(accordion) does not inherit it, and ``model.plan: {kind: accordion, film: depth}`` is "not an option
of plan accordion". The parts themselves are plug-ins
(:mod:`megatron_lol.convert.hf_modeling.parts_lol`); these options turn them on for every step.

This module is pure Python (no torch): the config validates against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lol.checks import choice
from megatron_lol.errors import ConfigError

FILM_MODES = ("off", "depth", "depth_block")


@dataclass
class PassParts:
    """FiLM per depth (or per depth and block) and the diagonal input injection."""

    film: str = field(default="off", metadata={"help": "off | depth | depth_block: FiLM on the block norms"})
    input_injection: bool = field(default=False, metadata={"help": "mix the core's input back in before each step"})

    def validate_parts(self, prefix: str) -> None:
        choice(f"{prefix}.film", self.film, FILM_MODES)
        if not isinstance(self.input_injection, bool):
            raise ConfigError(f"{prefix}.input_injection: must be true or false (got {self.input_injection!r})")


def pass_parts_of(model) -> PassParts:
    """The plan's FiLM / injection options of ``model`` (a ``ModelConfig``); for a kind without them, the
    defaults (both off): code that runs for every kind (params, exports) reads them."""
    plan = model.plan
    if isinstance(plan, PassParts):
        return plan
    return PassParts()
