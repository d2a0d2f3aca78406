"""Execution plans (which stored block runs where), the growing-depth curriculum and the
pipeline / expert-parallel layout of a model's executions. Pure Python: the config
validates against it and every other package reads it."""

from megatron_lol.plan.curriculum import depth_at, depth_at_step, growth_period, steps_per_depth
from megatron_lol.plan.execution import (
    PLANS,
    ExecutionPlan,
    NoOptions,
    Step,
    build_plan,
    option,
    plan_kind,
    register_plan,
    unregister_plan,
)
from megatron_lol.plan.kinds import AccordionPlan, DensePlan, FoilPlan, LoLPlan, LoopedPlan

__all__ = [
    "PLANS",
    "AccordionPlan",
    "DensePlan",
    "ExecutionPlan",
    "FoilPlan",
    "LoLPlan",
    "LoopedPlan",
    "NoOptions",
    "Step",
    "build_plan",
    "option",
    "plan_kind",
    "register_plan",
    "unregister_plan",
    "depth_at",
    "depth_at_step",
    "growth_period",
    "steps_per_depth",
]
