"""What the micro-batches of a training step observed, and the step's one read of its scalars.

The loss, the balancing loss and the block loads stay on the device through the micro-batches and the
reductions over the ranks; :func:`step_scalars` reads them to the host in one transfer per step
(docs/gpu.md, "Host reads of a training step").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class StepStats:
    """What the micro-batches of one step observed, collected from the model's return values on the device
    (read to the host once per step, with the loss: :meth:`Trainer.train_step`)."""

    loads: Optional[torch.Tensor] = None  # [depth, L] windows per block, summed over micro-batches
    aux_sum: Optional[torch.Tensor] = None  # [] float64: the micro-batches' balancing losses, summed
    aux_count: int = 0  # micro-batches with a balancing loss
    budgets: list = field(default_factory=list)  # accordion: the budget of each micro-batch
    moe_records: list = field(default_factory=list)  # MoERecord of the step (log steps only)

    def add(self, core) -> None:
        if core is None:
            return
        if core.block_loads is not None:
            loads = core.block_loads.double()
            self.loads = loads if self.loads is None else self.loads + loads
        if core.aux_loss is not None:
            # float64 sums of the FP32 values, in micro-batch order: the mean the host computed before
            aux = core.aux_loss.detach().double().reshape(())
            self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
            self.aux_count += 1
        self.moe_records.extend(core.moe_records)


def loss_on_device(outputs, device) -> torch.Tensor:
    """Token-mean LM loss over the global batch (summed over micro-batches and DP ranks), a float64
    scalar on the device, not read back."""
    from megatron.core import parallel_state

    stat = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for out in outputs:
            stat += out["lm loss"].double()
    torch.distributed.all_reduce(stat, group=parallel_state.get_data_parallel_group())
    # the last pipeline stage holds the loss: share it with every stage
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(stat, group=parallel_state.get_pipeline_model_parallel_group())
    return stat[0] / stat[1].clamp(min=1)


def step_scalars(outputs, stats: StepStats, depth: int, plan, device) -> tuple:
    """``(loss, mean balancing loss, utilisation [depth][block])`` of the step, reduced over the ranks
    on the device and read to the host in one transfer: the step's only read besides the gradient
    norm."""
    from megatron.core import parallel_state

    parts = [loss_on_device(outputs, device).reshape(1)]
    if stats.aux_sum is not None:
        parts.append(stats.aux_sum.reshape(1))
    shape = None
    if plan.routed:
        L = plan.num_stored_blocks
        loads = (
            stats.loads.clone()
            if stats.loads is not None
            else torch.zeros(plan.depth, L, dtype=torch.float64, device=device)
        )
        torch.distributed.all_reduce(loads, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # depths live on several stages
            torch.distributed.all_reduce(loads, group=parallel_state.get_pipeline_model_parallel_group())
        loads = loads[:depth]
        shape = loads.shape
        parts.append((loads / loads.sum(dim=1, keepdim=True).clamp(min=1)).reshape(-1))
    values = torch.cat(parts).tolist()
    loss = values[0]
    aux = values[1] / stats.aux_count if stats.aux_sum is not None else 0.0
    utilisation = []
    if shape is not None:
        depths, blocks = shape
        flat = values[len(values) - depths * blocks :]
        utilisation = [flat[d * blocks : (d + 1) * blocks] for d in range(depths)]
    return loss, aux, utilisation
