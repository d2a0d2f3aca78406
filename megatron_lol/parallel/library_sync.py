"""Keep the copies of the block library in step across pipeline stages.

Under pipeline parallelism every stage that hosts a core step holds the
library (and the routers, per-depth vectors, FiLM parameters and balancing
bias). Like megatron-core's tied embeddings, the copies start equal (same
per-component seeds) and stay equal because their gradients are summed over
all hosting stages before the optimizer step, and the balancing loads are
summed over them before the bias update.

The gradient sum must happen *before* megatron's data-parallel reduction
(with the distributed optimizer that reduction is a reduce-scatter whose shard
boundaries differ between stages), so it is installed as a wrapper around
``finalize_model_grads``. All but one copy are marked ``shared`` so that the
gradient norm counts the library once.
"""

from __future__ import annotations

from typing import Optional

import torch


def _core_of(chunk):
    module = getattr(chunk, "module", chunk)
    return getattr(module, "core", None), module


class LibrarySync:
    def __init__(self, model_chunks: list, model_cfg):
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_lol.plan.stages import stage_layout, stages_hosting_core

        self.chunks = model_chunks
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        first = model_chunks[0]
        cfg_m = getattr(first, "module", first).config
        vpp = cfg_m.virtual_pipeline_model_parallel_size if pp > 1 else None
        depth = model_cfg.core_depth
        hosting = stages_hosting_core(model_cfg, depth, pp, vpp)
        self.group: Optional[object] = None
        if pp > 1 and len(hosting) > 1:
            my_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, my_ranks)
            for ranks in sorted({tuple(r) for r in everyone}):  # same order on every rank
                members = [ranks[s] for s in hosting]
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    self.group = group
        # the copy on the first virtual stage that hosts routed depths counts for the grad norm
        stages = pp * (vpp or 1)
        v_first = next(v for v in range(stages) if stage_layout(model_cfg, depth, stages, None, v).depths is not None)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.local_cores = []
        for chunk_index, chunk in enumerate(model_chunks):
            core, _ = _core_of(chunk)
            if core is None:
                continue
            self.local_cores.append(core)
            owner = chunk_index * pp + pp_rank == v_first
            for p in core.parameters():
                p.shared = not owner

    @property
    def needed(self) -> bool:
        return self.group is not None or len(self.local_cores) > 1

    def sync_grads(self) -> None:
        """Sum library gradients over local chunks and hosting stages (in place, every copy)."""
        if not self.needed or not self.local_cores:
            return
        per_core = [[p for p in core.parameters() if p.requires_grad] for core in self.local_cores]
        grads = [_grad(p) for p in per_core[0]]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        for params in per_core[1:]:
            flat += torch.cat([_grad(p).reshape(-1).to(torch.float32) for p in params])
        if self.group is not None:
            torch.distributed.all_reduce(flat, group=self.group)
        for params in per_core:
            offset = 0
            for p in params:
                g = _grad(p)
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def reduce_loads(self, loads: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(loads, group=self.group)
        return loads

    def finalize_model_grads(self, *args, **kwargs):
        from megatron.core.distributed import finalize_model_grads

        self.sync_grads()
        return finalize_model_grads(*args, **kwargs)


def _grad(p: torch.Tensor) -> torch.Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
    return g
