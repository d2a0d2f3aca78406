"""``looped``: a recurrent block of ``layers`` layers applied ``loops`` times (Huginn-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lol.plan.execution import ExecutionPlan, Step, option, register_plan
from megatron_lol.plan.pass_parts import PassParts
from megatron_lol.plan.windows import FixedAttention


@dataclass
class LoopedOptions(FixedAttention, PassParts):
    layers: Optional[int] = option(help="layers of the recurrent block")
    loops: Optional[int] = option(help="passes over the block")
    untie_attention: Optional[bool] = option(
        help="one attention (and its input norm) per (layer, pass); MLPs stay shared"
    )


@register_plan
class LoopedPlan(ExecutionPlan):
    """A recurrent block of ``layers`` layers applied ``loops`` times."""

    name = "looped"
    Options = LoopedOptions

    @property
    def untie_attention(self) -> bool:
        return bool(self.options.untie_attention)

    @property
    def pipeline_ok(self) -> bool:  # type: ignore[override]
        return not self.untie_attention

    def _stored_blocks(self) -> int:
        self.loops = self._require("loops", self.options.loops)
        return self._require("layers", self.options.layers)

    def _build_steps(self) -> list:
        att = self._fixed_attention()
        n = self.num_stored_blocks
        return [
            Step(
                depth=d + 1,
                block=d % n,
                pass_index=d // n,
                attention=att,
                untied_attention=self.untie_attention and d >= n,
            )
            for d in range(n * self.loops)
        ]

    def describe(self) -> str:
        tie = ", attention untied per pass" if self.untie_attention else ""
        return f"{self.num_stored_blocks} layers x {self.loops} loops{tie}"
