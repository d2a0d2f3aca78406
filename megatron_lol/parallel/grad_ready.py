"""Overlapped gradient reduction (``--overlap-grad-reduce``) for a core whose blocks run data-dependently.

megatron-core's DDP starts a bucket's data-parallel reduction during backward, as
soon as a hook on the gradient accumulator of every parameter of the bucket has
fired (``_ParamAndGradBucketGroup.register_grad_ready``). It counts those firings
in the first step and, from then on, launches a bucket only when a step repeats
that count exactly (``golden_per_param_grad_ready_counts``); buckets are launched
in the order they become ready, which must be the same on every rank, since
collectives are matched by order. A LoL core breaks all three assumptions:

* a block that received no windows on a rank in a step gets no gradient there,
  so its hooks never fire and its bucket is never launched (``finish_grad_sync``
  then fails: "Communication call has not been issued for this bucket");
* a block's hooks fire once per backward, or once per recomputed call under full
  recomputation (one reentrant backward per call), so the count follows the
  routing;
* the order in which blocks finish their backward follows the routing too, and
  differs between data-parallel ranks.

:class:`CoreGradReadiness` takes the core's parameters out of DDP's per-parameter
hooks. Their gradients still reach the FP32 ``main_grad`` buffer as they are
accumulated (a post-accumulate hook that does what DDP's hook does, so fused
accumulation and the BF16 ``.grad`` path both work), and all of them are
declared ready at one point that every rank passes exactly once per micro-batch,
in one fixed order: when the backward pass reaches the core's input (an identity
autograd function applied to the core's input states by a forward pre-hook).
Every core parameter's gradient is complete by then: each of its uses depends on
that input, so autograd's engine runs the use, and the parameter's accumulation
(queued first: accumulation nodes have the highest priority), before it. A
gradient that arrived after its bucket was launched anyway would be an error,
and raises instead of being lost. Blocks without windows are declared ready
with zero gradients. The core's buckets are then reduced while the prelude and
the embedding run their backward, in the same order on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch


class _ReadyAtCoreInput(torch.autograd.Function):
    """Identity on the core's input states; its backward declares the core's parameters ready."""

    @staticmethod
    def forward(ctx, states, entry):
        ctx.entry = entry
        return states.view_as(states)

    @staticmethod
    def backward(ctx, grad):
        ctx.entry.declare_ready()
        return grad, None


class _ChunkEntry:
    """The core of one DDP-wrapped model chunk: its parameters in a fixed order and their bucket groups."""

    def __init__(self, ddp, core):
        self.ddp = ddp
        self.params = []
        self.groups = {}
        for param in core.parameters():
            if not param.requires_grad:
                continue
            group = ddp.param_to_bucket_group.pop(param, None)  # DDP's own hook now ignores it
            if group is None:
                continue
            self.params.append(param)
            self.groups[param] = group
            param.register_post_accumulate_grad_hook(self._to_main_grad)

    def _to_main_grad(self, param: torch.nn.Parameter) -> None:
        """What DDP's per-parameter hook does, without declaring the parameter ready."""
        if param.grad is None:
            return
        if self.groups[param].grad_reduce_handle is not None:
            raise RuntimeError(
                "overlap_grad_reduce: a core parameter's gradient arrived after its bucket's "
                "reduction was launched (parallel/grad_ready.py)"
            )
        if not getattr(param, "grad_added_to_main_grad", False) or getattr(param, "zero_out_wgrad", False):
            param.main_grad.add_(param.grad.data)
        param.grad = None

    def declare_ready(self) -> None:
        for param in self.params:
            self._to_main_grad(param)
            self.groups[param].register_grad_ready(param, self.ddp.force_all_reduce)

    def pre_hook(self, module, args):
        states = args[0]
        if not (module.training and torch.is_grad_enabled()):
            return None
        if not states.requires_grad:
            raise RuntimeError(
                "overlap_grad_reduce: the core's input does not require grad, so the core's "
                "gradients could never be declared ready"
            )
        return (_ReadyAtCoreInput.apply(states, self),) + tuple(args[1:])


class CoreGradReadiness:
    """Installs the above on every DDP-wrapped chunk that holds a core (see the module docstring)."""

    def __init__(self, ddp_chunks: list):
        self.entries: list = []
        self.handles: list = []
        for ddp in ddp_chunks:
            core: Optional[torch.nn.Module] = getattr(ddp.module, "core", None)
            if core is None:
                continue
            entry = _ChunkEntry(ddp, core)
            self.entries.append(entry)
            self.handles.append(core.register_forward_pre_hook(entry.pre_hook))

    @property
    def parameters(self) -> list:
        return [p for entry in self.entries for p in entry.params]
