"""``lol``: Library of Layers. At each of ``routed_depth`` depths every window runs the block of the
``num_blocks`` in the library that its causal router chose (docs/model.md, "The routed core"). The
router and its balancing are the ``routing`` sub-section (:mod:`megatron_lol.plan.routing`), the
window geometry the ``windows`` sub-section (:mod:`megatron_lol.plan.windows`); FiLM and input
injection are the options every kind with per-pass parts shares (:mod:`megatron_lol.plan.pass_parts`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lol.plan.execution import ExecutionPlan, Step, option, register_plan
from megatron_lol.plan.pass_parts import PassParts
from megatron_lol.plan.routing import RoutingOptions, routing_option
from megatron_lol.plan.windows import WindowOptions, windows_option

LOL_DEFAULT_BLOCKS = 4
LOL_DEFAULT_DEPTH = 4


@dataclass
class LoLOptions(PassParts):
    num_blocks: int = option(LOL_DEFAULT_BLOCKS, help="L, blocks stored in the library")
    routed_depth: int = option(LOL_DEFAULT_DEPTH, help="D, routed depths")
    routing: RoutingOptions = routing_option()
    windows: WindowOptions = windows_option()


@register_plan
class LoLPlan(ExecutionPlan):
    """Every window, at each routed depth, runs the library block its router chose."""

    name = "lol"
    Options = LoLOptions

    def _stored_blocks(self) -> int:
        self.options.windows.validate(self.key("windows"))
        self._require("routed_depth", self.options.routed_depth)
        self.options.routing.validate(self.key("routing"))
        return self._require("num_blocks", self.options.num_blocks)

    def _build_steps(self) -> list:
        return [Step(depth=l, block=None, attention="window") for l in range(1, self.options.routed_depth + 1)]

    def describe(self) -> str:
        o = self.options
        return f"L={o.num_blocks} blocks, D={o.routed_depth} routed depths, W={o.windows.size}, S={o.windows.shift}"
