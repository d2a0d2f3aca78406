"""A per-pass part and the plan kind that uses it, defined here and nowhere in megatron_lol/.

``ResidualGate`` (part ``residual_gate``): one scalar gate per pass on each of a block's two
residual updates, ``before + g[pass, row] * (after - before)`` (row 0 the attention write, row 1
the MLP write; 1 is the ordinary layer). Its class says everything the stack needs: its tensor
and init, the slice a step reads, where it applies (``write``), its arithmetic, its parameter
category (one of its own: ``residual_gates``) and that tensor-parallel ranks must keep it
bit-identical. Its body uses torch only, so the HF export ships it as source.

``GatedLoopPlan`` (kind ``gated-loop``): ``layers`` stored layers run ``loops`` times, every
step with the part. Importing this module registers neither; :func:`register` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lol.model.parts import Part, register_part, unregister_part
from megatron_lol.plan import ExecutionPlan, Step, option, register_plan, unregister_plan


class ResidualGate(Part):
    """A per-pass scalar gate on each residual update of the block call."""

    name = "residual_gate"
    param_names = ("residual_gate",)
    hook = "write"
    category = "residual_gates"
    replicated = True

    @classmethod
    def parameters(cls, config, num_blocks, depth, passes):
        return {"residual_gate": ((passes, 2), 1.0)}

    @classmethod
    def select(cls, params, depth, pass_index, block):
        return (params["residual_gate"][pass_index],)

    @staticmethod
    def apply(before, after, row, gate):
        # gate [2] (or [rows, 2] in the grouped executor): keep a trailing axis to broadcast over channels
        g = gate[..., row : row + 1].to(before.dtype)
        return before + g * (after - before)


@dataclass
class GatedLoopOptions:
    layers: int = option(2, help="stored layers of the looped block")
    loops: int = option(2, help="passes over them; every step gates its residual updates per pass")


class GatedLoopPlan(ExecutionPlan):
    """``layers`` stored layers run ``loops`` times in order, every step with the ``residual_gate`` part."""

    name = "gated-loop"
    Options = GatedLoopOptions

    def _stored_blocks(self) -> int:
        self.loops = self._require("plan.loops", self.options.loops)
        return self._require("plan.layers", self.options.layers)

    def _build_steps(self) -> list:
        n, attention = self.num_stored_blocks, self._fixed_attention()
        return [
            Step(depth=d + 1, block=d % n, pass_index=d // n, attention=attention, parts=("residual_gate",))
            for d in range(n * self.loops)
        ]

    def describe(self) -> str:
        return f"{self.num_stored_blocks} layers x {self.loops} passes, per-pass residual gates"


GATED = {"plan": {"kind": "gated-loop", "layers": 2, "loops": 2}}
#: the gates a test writes before saving (a few training steps barely move them from 1)
GATE_VALUES = [[0.75, 1.25], [0.5, 0.875]]


def register() -> None:
    register_part(ResidualGate)
    register_plan(GatedLoopPlan)


def unregister() -> None:
    unregister_plan(GatedLoopPlan.name)
    unregister_part(ResidualGate.name)
