"""Host synchronisations of whole training steps, counted as a GPU run pays them.

A GPU step is fast when the host queues the next step's kernels while the device still runs
this one; every value read back to the host (a loss, a norm, a count that sizes a tensor) makes
the host wait for the device instead. ``megatron-lol profile`` and the GPTModel baseline
(``bench/gpu/gpt_baseline.py``) count these reads in a few untimed steps right after their timed
ones, with the same step function and data: :class:`~megatron_lol.perf.op_count.OpCounter`'s
dispatch mode costs host time per operation, so the timed steps run without it.

What is no device read on a GPU is left out of the count (and reported as host reads): on an
accelerator, reads of CPU tensors; everywhere, the data loader's work (it builds each batch from
CPU tensors before the step moves it to the device) and ``torch.optim``'s per-parameter ``step``
counters, which it keeps on the host unless the optimizer is ``capturable`` or ``fused``
(``torch/optim/adam.py``, ``_init_group``), so ``bias_correction`` reads them on the host.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_lol.perf.op_count import OpCounter

METHOD = (
    "OpCounter (megatron_lol/perf/op_count.py) over untimed steps right after the timed ones (same step "
    "function and data); the data loader's host work and torch.optim's host-side step counters not counted"
)


def _torch_optimizers(optimizer) -> list:
    """The ``torch.optim.Optimizer`` objects inside megatron-core's (chained) optimizer wrappers."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        found += _torch_optimizers(inner)
    if not found and getattr(optimizer, "optimizer", None) is not None:
        found = _torch_optimizers(optimizer.optimizer)
    return found


def host_resident_state(optimizer) -> list:
    """``torch.optim``'s ``step`` counters that stay on the host in a GPU run too (neither ``capturable``
    nor ``fused``): reading them is no device synchronisation."""
    out = []
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    out.append(step)
    return out


class HostSideIterator:
    """An iterator whose ``next`` is not counted by ``counter`` (the data loader's host-side work)."""

    def __init__(self, it, counter: OpCounter):
        self.it, self.counter = it, counter

    def __iter__(self):
        return self

    def __next__(self):
        with self.counter.host_side():
            return next(self.it)


def count_step_syncs(run_step: Callable[[Any], Any], data, steps: int, device, optimizer) -> dict:
    """Run ``run_step(data)`` ``steps`` times under an :class:`OpCounter`; per step: host syncs (total and
    by name), ATen operations (about one kernel launch each) and the host reads left out.

    ``data``: the step's data iterator, or a list of them (one per virtual pipeline chunk)."""
    counter = OpCounter(device=device, host_tensors=host_resident_state(optimizer))
    wrapped = (
        [HostSideIterator(d, counter) for d in data] if isinstance(data, list) else HostSideIterator(data, counter)
    )
    with counter:
        for _ in range(steps):
            run_step(wrapped)
    return {
        "per_step": counter.syncs / steps,
        "by_name": {name: n / steps for name, n in sorted(counter.sync_names.items())},
        "ops_per_step": counter.ops / steps,
        "host_reads_per_step": counter.host_reads / steps,
        "steps": steps,
        "method": METHOD,
    }
