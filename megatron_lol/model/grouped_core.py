"""Where the grouped executor applies: one rule for the build-time choice and the trainer's check.

A LoL core runs its routed depths' blocks with one executor (:mod:`.executors`),
chosen when the model is built: :class:`~.executors.GroupedGEMMs` (every
block of a depth at once, no host read) where :func:`routes_grouped` asks for
it and :func:`grouped_core_support` accepts the built blocks, else
:class:`~.executors.PerBlockCalls`. Routing is the same either way.
"""

from __future__ import annotations

from typing import Optional

from megatron_lol.model.grouped_blocks import grouped_support


def routes_grouped(model, cuda: bool, mode: str = "auto") -> bool:
    """Whether ``model``'s routed depths will run grouped under ``mode`` (``parallel.routed_core``: how the
    model runs, not part of what it computes), decided from the config when the model is built, so the
    library's blocks can be built for it: ``grouped`` always (the trainer refuses with one line what
    :func:`grouped_core_support` declines), ``auto`` on CUDA for a plan of routed depths only, with the
    window router, no router-only tokens and no MoE blocks.

    Under the Transformer Engine spec such a model keeps TE layers for its prelude and coda and builds
    its library with the local spec, whose weights the grouped computation stacks (``torch._grouped_mm``
    in the parameters' dtype: FP8, when configured, covers the prelude and coda only)."""
    if mode == "reference" or (mode == "auto" and not cuda):
        return False
    plan = model.execution_plan()
    if mode == "grouped":
        return plan.routed and all(step.routed for step in plan.steps())
    # MoE blocks: grouped_support declines them from the built blocks; here from the config
    return grouped_config_support(model, plan) is None and model.moe.layers != "all"


def grouped_config_support(model, plan) -> Optional[str]:
    """What the config alone says against running ``plan``'s routed depths grouped (one line), or None: the
    rules :func:`routes_grouped` (at build time) and :func:`grouped_core_support` (on the built core) share."""
    if not plan.routed or any(not step.routed for step in plan.steps()):
        return f"plan {plan.name!r} has fixed steps (only routed LoL depths run grouped)"
    return None


def grouped_core_support(core) -> Optional[str]:
    """Why ``core`` cannot run grouped (one line), or None when it can."""
    reason = grouped_config_support(core.cfg, core.plan)
    if reason is not None:
        return reason
    return grouped_support([core.block(i) for i in core.local_block_ids()])
