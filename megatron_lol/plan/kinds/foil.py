"""``foil``: a looped block of MoE layers, shape ``(E, D, L)`` = (``experts``, ``layers``, ``loops``);
experts and routers shared across passes, attention untied per (layer, pass) unless
``untie_attention: false`` (proto-Foil, Base-tied)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lol.errors import ConfigError
from megatron_lol.plan.execution import option, register_plan
from megatron_lol.plan.kinds.looped import LoopedPlan
from megatron_lol.plan.pass_parts import PassParts
from megatron_lol.plan.windows import FixedAttention


@dataclass
class FoilOptions(FixedAttention, PassParts):
    experts: Optional[int] = option(help="E, experts per MoE layer of the looped block")
    layers: Optional[int] = option(help="D, MoE layers of the looped block")
    loops: Optional[int] = option(help="L, passes over the block")
    untie_attention: Optional[bool] = option(help="attention untied per (layer, pass); default true (false: Base-tied)")


@register_plan
class FoilPlan(LoopedPlan):
    """Foil: ``layers`` MoE layers with ``experts`` experts each, looped ``loops`` times."""

    name = "foil"
    Options = FoilOptions

    @property
    def untie_attention(self) -> bool:
        return self.options.untie_attention is not False

    def _stored_blocks(self) -> int:
        n = super()._stored_blocks()
        m = self.model
        if m.moe.layers != "all":
            raise ConfigError(
                f"{self.prefix}.moe.layers: plan foil loops a block of MoE layers: set model.moe.layers: all "
                f"(got {m.moe.layers})"
            )
        self._require("experts", self.options.experts)
        if m.moe.core_num_experts is not None:
            raise ConfigError(f"{self.prefix}.moe.core_num_experts: plan foil takes its core experts from plan.experts")
        return n

    @property
    def core_experts(self) -> Optional[int]:
        return self.options.experts

    def describe(self) -> str:
        e, d, l = self.options.experts, self.num_stored_blocks, self.loops
        tie = "untied" if self.untie_attention else "shared"
        return f"(E, D, L) = ({e}, {d}, {l}), attention {tie} across passes"
