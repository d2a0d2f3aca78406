"""``dense``: ``layers`` distinct layers in order, every token through each (a GPT's core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lol.plan.execution import ExecutionPlan, Step, option, register_plan
from megatron_lol.plan.pass_parts import PassParts
from megatron_lol.plan.windows import FixedAttention


@dataclass
class DenseOptions(FixedAttention, PassParts):
    layers: Optional[int] = option(help="layers of the core, each run once")


@register_plan
class DensePlan(ExecutionPlan):
    """``layers`` distinct layers in order, every token through each."""

    name = "dense"
    Options = DenseOptions

    def _stored_blocks(self) -> int:
        return self._require("layers", self.options.layers)

    def _build_steps(self) -> list:
        att = self._fixed_attention()
        return [Step(depth=i + 1, block=i, attention=att) for i in range(self.num_stored_blocks)]

    def describe(self) -> str:
        return f"{self.num_stored_blocks} core layers"
