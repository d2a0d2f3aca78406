"""``accordion``: the ``window`` layers once, then the first ``k`` of them once more, ``k`` the loop
budget (one of ``budgets``; ``k = 0`` is the unlooped model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lol.errors import ConfigError
from megatron_lol.plan.execution import ExecutionPlan, Step, option, register_plan


@dataclass
class AccordionOptions:
    window: Optional[int] = option(help="layers of the loopable window")
    budgets: list = option([0], help="loop budgets k trained over (increasing)")
    budget: Optional[int] = option(help="a fixed budget for training, evaluation and inference (default: sampled)")
    second_pass_router: str = option("shared", help="shared | separate: one extra MoE router per loopable layer")
    gates: bool = option(True, help="per-channel gates on the second pass's residual writes")


@register_plan
class AccordionPlan(ExecutionPlan):
    """Accordion: the ``window`` layers once, then the first ``k`` of them once more."""

    name = "accordion"
    Options = AccordionOptions
    growable = False
    pipeline_ok = False

    def _stored_blocks(self) -> int:
        m, o = self.model, self.options
        n = self._require("window", o.window)
        budgets = o.budgets
        key = self.key("budgets")
        if (
            not isinstance(budgets, list)
            or not budgets
            or any(not isinstance(k, int) or isinstance(k, bool) for k in budgets)
        ):
            raise ConfigError(f"{key}: must be a non-empty list of integers (got {budgets!r})")
        if len(set(budgets)) != len(budgets) or budgets != sorted(budgets):
            raise ConfigError(f"{key}: must be increasing without repeats (got {budgets})")
        if budgets[0] < 0 or budgets[-1] > n:
            raise ConfigError(f"{key}: every budget must be in [0, window={n}] (got {budgets})")
        if o.budget is not None and o.budget not in budgets:
            raise ConfigError(f"{self.key('budget')}: {o.budget} is not one of budgets {budgets}")
        if o.second_pass_router not in ("shared", "separate"):
            raise ConfigError(
                f"{self.key('second_pass_router')}: must be one of shared, separate (got {o.second_pass_router!r})"
            )
        if o.second_pass_router == "separate" and m.moe.layers != "all":
            raise ConfigError(f"{self.key('second_pass_router')}: separate needs MoE blocks (model.moe.layers: all)")
        return n

    def _build_steps(self) -> list:
        o = self.options
        n, k_max = self.num_stored_blocks, max(o.budgets)
        first = [Step(depth=i + 1, block=i) for i in range(n)]
        second = [
            Step(
                depth=n + i + 1,
                block=i,
                pass_index=1,
                parts=("loop_gates",) if o.gates else (),
                separate_router=o.second_pass_router == "separate",
            )
            for i in range(k_max)
        ]
        return first + second

    @property
    def budgets(self) -> list:
        return list(self.options.budgets)

    @property
    def has_budgets(self) -> bool:
        return True

    def resolve_budget(self, budget: Optional[int]) -> int:
        """The given budget, else the section's ``budget``, else the largest."""
        o = self.options
        k = budget if budget is not None else o.budget if o.budget is not None else max(o.budgets)
        if k not in o.budgets:
            raise ConfigError(f"budget: {k} is not one of the model's budgets {o.budgets}")
        return k

    def depth_for(self, budget: Optional[int] = None) -> int:
        return self.num_stored_blocks + self.resolve_budget(budget)

    def eval_budgets(self) -> list:
        o = self.options
        return [o.budget] if o.budget is not None else list(o.budgets)

    def sample_budget(self, seed: int, iteration: int, microbatch: int) -> int:
        """Uniform over ``budgets`` from a generator seeded with (seed, iteration, micro-batch):
        every rank draws the same budget without communicating, and a resumed run draws what the
        uninterrupted one would have. A fixed ``budget`` wins."""
        o = self.options
        if o.budget is not None:
            return o.budget
        import numpy as np

        rng = np.random.default_rng([seed, iteration, microbatch])
        return int(o.budgets[int(rng.integers(len(o.budgets)))])

    def describe(self) -> str:
        return f"loop window of {self.num_stored_blocks} layers, budgets {list(self.options.budgets)}"
