"""How a model's executions are laid out over pipeline stages and expert-parallel ranks.

The *execution order* of a model is ``[prelude 0..P-1, core step 1..D, coda
0..C-1]`` (``D`` the plan's full depth). Pipeline parallelism cuts it into
``pp * vpp`` equal virtual stages; virtual stage ``v = chunk * pp + pp_rank``
(megatron-core's interleaving) runs the items ``[v*n, (v+1)*n)``. A stage that
hosts at least one core step holds the stored blocks (sharded over the
expert-parallel group when the plan routes), the router(s) and the balancing
bias; the blocks' gradients are summed over all such stages, like tied
embeddings.

Expert parallelism shards the ``L`` blocks of a routed library: EP rank ``e``
holds blocks ``[e*L/EP, (e+1)*L/EP)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lol.errors import ConfigError
from megatron_lol.plan.pass_parts import pass_parts_of


@dataclass
class StageLayout:
    """What one (virtual) pipeline stage runs."""

    prelude: list = field(default_factory=list)  # global prelude layer indices
    depths: Optional[tuple] = None  # inclusive (first, last) core step, 1-based
    coda: list = field(default_factory=list)  # global coda layer indices
    first: bool = True  # holds the embedding
    last: bool = True  # holds the final norm and LM head


def execution_order(model, depth: int) -> list:
    """``[("prelude", i) ..., ("depth", l) ..., ("coda", i) ...]`` for a core of ``depth`` steps."""
    return (
        [("prelude", i) for i in range(model.n_prelude)]
        + [("depth", d) for d in range(1, depth + 1)]
        + [("coda", i) for i in range(model.n_coda)]
    )


def check_pipeline_layout(
    model, depth: int, pp: int, vpp: Optional[int], plan_name: str = "", pipeline_ok: bool = True
) -> None:
    """One-line errors for layouts that cannot be cut evenly (before any process group work)."""
    stages = pp * (vpp or 1)
    if pp > 1 and not pipeline_ok:
        raise ConfigError(
            f"parallel.pipeline_model_parallel_size: plan {plan_name} (with its per-pass parts) is "
            f"not supported with pipeline parallelism (got {pp}); use tensor/expert/data parallelism"
        )
    n = len(execution_order(model, depth))
    if n % stages:
        raise ConfigError(
            f"parallel.pipeline_model_parallel_size: {pp} x virtual {vpp or 1} = {stages} stages do not divide "
            f"the {n} executions of the model (n_prelude {model.n_prelude} + core depth {depth} + "
            f"n_coda {model.n_coda})"
        )
    if vpp is not None and pp == 1:
        raise ConfigError("parallel.virtual_pipeline_model_parallel_size: needs pipeline_model_parallel_size > 1")
    if pp > 1 and pass_parts_of(model).input_injection:
        hosting = {v for v in range(stages) for kind, _ in stage_items(model, depth, stages, v) if kind == "depth"}
        if len(hosting) > 1:
            raise ConfigError(
                "model.plan.input_injection: not supported when the core's steps span several "
                "pipeline stages (the injected prelude output is not sent along the pipeline)"
            )


def stage_items(model, depth: int, num_stages: int, virtual_stage: int) -> list:
    items = execution_order(model, depth)
    per = len(items) // num_stages
    return items[virtual_stage * per : (virtual_stage + 1) * per]


def stage_layout(
    model, depth: int, pp: int = 1, vpp: Optional[int] = None, pp_rank: int = 0, vp_stage: Optional[int] = None
) -> StageLayout:
    stages = pp * (vpp or 1)
    v = (vp_stage or 0) * pp + pp_rank
    items = stage_items(model, depth, stages, v)
    depths = [i for kind, i in items if kind == "depth"]
    return StageLayout(
        prelude=[i for kind, i in items if kind == "prelude"],
        depths=(depths[0], depths[-1]) if depths else None,
        coda=[i for kind, i in items if kind == "coda"],
        first=v == 0,
        last=v == stages - 1,
    )


def stages_hosting_core(model, depth: int, pp: int, vpp: Optional[int]) -> list:
    """Physical pipeline ranks that host at least one core step (in any chunk)."""
    ranks = set()
    for chunk in range(vpp or 1):
        for r in range(pp):
            if stage_layout(model, depth, pp, vpp, r, chunk).depths is not None:
                ranks.add(r)
    return sorted(ranks)


def local_blocks(num_blocks: int, ep: int, ep_rank: int) -> list:
    """The stored blocks expert-parallel rank ``ep_rank`` of ``ep`` holds."""
    per = num_blocks // ep
    return list(range(ep_rank * per, (ep_rank + 1) * per))
