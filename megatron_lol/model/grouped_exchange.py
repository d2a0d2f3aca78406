"""A routed depth under expert parallelism: the depth's rows travel to their blocks' ranks at once.

With ``L`` blocks over ``EP`` ranks, rank ``e`` holds blocks
``[e L/EP, (e+1) L/EP)`` (``plan.stages.local_blocks``). A routed depth
(:func:`~.executors.routed_update`) already holds its rows sorted by block, so they are
sorted by destination rank too, and one exchange carries them:

1. the per-block row counts ``[L]`` (device sums of the grouping's offsets)
   are all-gathered over the EP group, and read to the host once: the
   all-to-all's split sizes (the only device-to-host read of the depth);
2. the rows go out in one autograd all-to-all (megatron-core's
   ``tensor_parallel.mappings.all_to_all``), each row's window id and RoPE
   position in one integer all-to-all;
3. the receiver puts what arrived in local-block order (a stable sort on the
   device; windows stay whole and in order) and runs its blocks with its
   executor, as without expert parallelism;
4. the block outputs return in the reverse all-to-all, in the sender's order.

Either executor (:mod:`.executors`) runs what arrived: per-block calls
(sizes from the split table, no further read) or one grouped computation. Window ids are made unique across senders
(``id * EP + source``), so the receiver's attention never joins two senders'
windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lol.model.static_routing import TokenGrouping, group_tokens, permute_rows


@dataclass
class ExchangedRows:
    """What one rank received for its local blocks, in local-block order, and the way back."""

    rows: torch.Tensor  # [R, h] (autograd: gradients return to the senders)
    grouping: TokenGrouping  # over the local blocks: order / inverse map received -> local-block order
    positions: torch.Tensor  # [R] each row's RoPE position
    group: object
    send_splits: list
    recv_splits: list
    counts: list  # rows received per local block (host integers, from the split table)

    def send_back(self, outputs: torch.Tensor) -> torch.Tensor:
        """The block outputs ``[R, h]`` (local-block order) back to their senders: ``[T, h]`` in the
        sender's grouped order."""
        from megatron.core.tensor_parallel.mappings import all_to_all

        received_order = permute_rows(outputs, self.grouping.inverse, self.grouping.order)
        return all_to_all(self.group, received_order, self.send_splits, self.recv_splits)


def exchange_rows(
    rows: torch.Tensor, grouping: TokenGrouping, positions: torch.Tensor, num_blocks: int, group
) -> ExchangedRows:
    """Send the grouped rows ``[T, h]`` of a depth (sorted by block over all ``num_blocks``) to the ranks
    holding their blocks. ``positions`` ``[T]``: each grouped row's RoPE position. A collective over
    ``group``: every EP rank calls it once per routed depth."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import all_to_all

    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = num_blocks // ep
    device = rows.device  # NCCL: every collective's tensors on the device
    counts = (grouping.group_offsets[1:] - grouping.group_offsets[:-1]).contiguous()
    everyone = [torch.empty_like(counts) for _ in range(ep)]
    dist.all_gather(everyone, counts, group=group)
    table = torch.stack(everyone).view(ep, ep, per_rank)  # [source, destination rank, local block]
    host = table.tolist()  # the depth's one device-to-host read: the all-to-all's split sizes
    send_splits = [sum(host[rank][d]) for d in range(ep)]
    recv_splits = [sum(host[s][rank]) for s in range(ep)]
    received_total = sum(recv_splits)

    received = all_to_all(group, rows, recv_splits, send_splits)
    meta = torch.stack([grouping.segments, positions], dim=1).contiguous()
    meta_in = torch.empty(received_total, 2, dtype=meta.dtype, device=device)
    dist.all_to_all_single(meta_in, meta, recv_splits, send_splits, group=group)

    # what arrived is ordered by source, then by local block: sort it by local block (stable)
    local = table[:, rank]  # [source, local block], on the device
    block_ids = torch.arange(per_rank, device=device).repeat(ep)
    block_of = torch.repeat_interleave(block_ids, local.reshape(-1), output_size=received_total)
    source = torch.repeat_interleave(torch.arange(ep, device=device), local.sum(dim=1), output_size=received_total)
    window = meta_in[:, 0] * ep + source  # unique across senders
    grouping = group_tokens(block_of, window, per_rank)  # stable: windows stay whole and in order
    return ExchangedRows(
        rows=permute_rows(received, grouping.order, grouping.inverse),
        grouping=grouping,
        positions=meta_in[:, 1].index_select(0, grouping.order),
        group=group,
        send_splits=send_splits,
        recv_splits=recv_splits,
        counts=[sum(host[s][rank][m] for s in range(ep)) for m in range(per_rank)],
    )
