"""Execution plans (which stored block runs where), the growing-depth curriculum and the
pipeline / expert-parallel layout of a model's executions. Pure Python: the config
validates against it and every other package reads it."""

from megatron_lol.plan.curriculum import depth_at, depth_at_step, growth_period, steps_per_depth
from megatron_lol.plan.execution import PLANS, ExecutionPlan, Step, build_plan

__all__ = [
    "PLANS",
    "ExecutionPlan",
    "Step",
    "build_plan",
    "depth_at",
    "depth_at_step",
    "growth_period",
    "steps_per_depth",
]
