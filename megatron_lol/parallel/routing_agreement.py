"""The same routing on every rank of a tensor-parallel group, checked before it can hang.

Every rank of a TP group routes the gathered stream itself, and the blocks it
then runs are tensor parallel: their row-parallel all-reduces (and TE's GEMMs)
assume that every rank of the group runs the same blocks on the same rows. The
routing path is built to decide identically on identical inputs (ordered window
sums, no atomics: ``model/windows.py``, ``model/router.py``), but a decision
that differs anyway (a kernel that is not bit-stable, a flipped bit, a bug)
would make one rank wait for a collective the other never starts, or mix rows
of different windows.

:class:`RoutingAgreement` compares a small digest of each depth's decisions
(:func:`routing_digest`) across the TP group right after the router has
decided and *before* any block of that depth runs: one all-reduce of ``2 (3 +
L)`` integers per routed depth, on the steps the trainer checks (every
``training.check_routing_agreement`` iterations, default ``log_interval``).
Every rank receives the same reduced digest, so on a disagreement all of them
raise :class:`RoutingDisagreement` at the same depth and the job stops with one
line naming the iteration and the depth, instead of hanging.
"""

from __future__ import annotations

from typing import Optional

import torch

#: hash weights of window positions are taken modulo 2**20 and the gate's bits in 20-bit halves, so every
#: product stays below 2**40 and a sum over up to 2**20 windows below 2**60 (int64, no overflow)
_BITS = 20
_MASK = (1 << _BITS) - 1


class RoutingDisagreement(RuntimeError):
    """The ranks of a tensor-parallel group made different routing decisions (one line)."""


def routing_digest(choice: torch.Tensor, gate: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[3 + L]`` int64 on the decisions' device: windows, a position-weighted sum of the chosen blocks,
    a position-weighted sum of the gates' bits (low and high halves, merged), and windows per block.

    Integer sums only (exact, so the same on every rank whatever the reduction order); any single changed
    choice or gate bit changes it.
    """
    n = choice.numel()
    device = choice.device
    pos = torch.arange(n, dtype=torch.int64, device=device)
    weight = (pos * 2654435761 + 97) & _MASK
    bits = gate.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    choices = (weight * (choice.to(torch.int64) + 1)).sum()
    gates = (weight * (bits & _MASK)).sum() + 3 * (weight * ((bits >> _BITS) & _MASK)).sum()
    counts = torch.bincount(choice.to(torch.int64), minlength=num_blocks)[:num_blocks]
    head = torch.stack([torch.tensor(n, dtype=torch.int64, device=device), choices, gates])
    return torch.cat([head, counts.to(torch.int64)])


class RoutingAgreement:
    """The check of one training step: called by the core with each routed depth's decision.

    ``group``: the tensor-parallel process group (ranks routing the same windows); ``step``: the
    1-based iteration, for the message.
    """

    def __init__(self, group, step: int, num_blocks: int):
        self.group = group
        self.step = step
        self.num_blocks = num_blocks
        self.checked_depths: list = []

    def __call__(self, depth: int, decision) -> None:
        digest = routing_digest(decision.choice, decision.gate, self.num_blocks)
        both = torch.cat([digest, -digest])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.group)
        high, low = both[: digest.numel()], -both[digest.numel() :]
        self.checked_depths.append(depth)
        if not torch.equal(high, low):  # a device-to-host read, on checked steps only
            ranks = torch.distributed.get_world_size(self.group)
            what = (
                "window counts"
                if high[0] != low[0]
                else ("blocks" if high[1] != low[1] or not torch.equal(high[3:], low[3:]) else "gates")
            )
            raise RoutingDisagreement(
                f"routing disagreement at iteration {self.step}, depth {depth}: the {ranks} tensor-parallel ranks "
                f"chose different {what} for the same windows (their next collectives would not match); "
                f"see docs/gpu.md, 'Routing on every rank'"
            )


def tensor_parallel_check(step: int, num_blocks: int, interval: Optional[int]) -> Optional[RoutingAgreement]:
    """The check for 1-based iteration ``step``, or None: not a checked step (``interval`` 0 or None: never),
    or a tensor-parallel group of one rank (nothing to compare)."""
    if not interval or step % interval:
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return RoutingAgreement(parallel_state.get_tensor_model_parallel_group(), step, num_blocks)


def replicated_routing_parameters(core) -> list:
    """The core's parameters that act on the tensor-parallel-replicated stream outside any TP reduction:
    the window routers and depth vectors (the routing itself) and the tensors of every per-pass part that
    says so (``Part.replicated``: input injection, Accordion's loop gates, ...: the states the next router
    reads). Sequence-parallel ones (a fixed plan's core on sharded tokens) are excluded: megatron sums those
    over the group already."""
    from megatron_lol.convert.hf_modeling.parts_lol import part_of_parameter

    parts = [n for n in getattr(core, "part_names", ()) if part_of_parameter(n).replicated]
    params = []
    for name in ("routers", "depth_vectors", *parts):
        obj = getattr(core, name, None)
        if isinstance(obj, torch.nn.Parameter):
            params.append(obj)
        elif isinstance(obj, torch.nn.Module):
            params.extend(obj.parameters())
    return [p for p in params if p.requires_grad and not getattr(p, "sequence_parallel", False)]


def average_routing_grads(model_chunks: list) -> None:
    """Average the main gradients of :func:`replicated_routing_parameters` over the tensor-parallel group.

    Every TP rank computes these gradients itself from the same values, but the sums that form them (the
    gate's gradient over a window's tokens, attention backward kernels) are not ordered on GPUs, so the
    copies could drift apart in the last bits, step by step, until two ranks route differently. After the
    average every rank holds the same bits (one all-reduce of the routers' few parameters per step;
    ``(x + x) / 2`` is ``x`` exactly where they already agree).
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return
    grads = []
    for chunk in model_chunks:
        core = getattr(getattr(chunk, "module", chunk), "core", None)
        if core is None:
            continue
        for param in replicated_routing_parameters(core):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads.append(grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
    torch.distributed.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    flat.div_(tp)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
