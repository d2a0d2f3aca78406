"""Expert-parallel grouped dispatch: whole windows travel to their block's rank.

Like MoE token dispatch, but the unit is a window (attention runs inside it),
so a window is never split across ranks. With ``L`` blocks over ``EP`` ranks,
rank ``e`` holds blocks ``[e*L/EP, (e+1)*L/EP)``. One depth:

1. the local grouping (tokens grouped by block, windows contiguous) already groups
   tokens by destination rank, because blocks of a rank are contiguous;
2. per-block token counts are all-gathered over the EP group (one small
   collective), giving every rank the split sizes of both directions;
3. hidden states go out with an autograd all-to-all (megatron-core's), window
   ids (made unique per source rank) and RoPE positions with a plain one;
4. the receiver sorts what it got by block (stable: windows stay contiguous)
   and runs each local block once on all of its windows, from every rank;
5. the updates return by the reverse all-to-all, in the sender's grouping order.

The router stays replicated: every rank routes its own windows.
"""

from __future__ import annotations

import torch


def run_grouped_expert_parallel(
    grouping, states: torch.Tensor, run_block, rope_index: torch.Tensor, group
) -> torch.Tensor:
    """Block updates ``E(s) - s`` of the grouped tokens, in ``grouping.order`` order.

    ``grouping``: a ``megatron_lol.model.dispatch.WindowGrouping`` (``order``,
    ``counts``, ``segments``); ``run_block(block, rows, segments, rope_index)``
    runs a local block. ``rope_index``: [T] per flat token, what ``run_block``
    uses to look up RoPE (the token's row position; on the packed layout its
    position in its window). Collective over ``group``: every EP rank calls it
    at every depth, even with no tokens.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import all_to_all

    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = states.device  # NCCL: every collective's tensors on the device
    num_blocks = len(grouping.counts)
    per_rank = num_blocks // ep
    counts = torch.tensor(grouping.counts, dtype=torch.long, device=dev)
    everyone = [torch.zeros_like(counts) for _ in range(ep)]
    dist.all_gather(everyone, counts, group=group)
    # split sizes are host integers (all_to_all takes lists): one device-to-host read per depth
    table = torch.stack(everyone).view(ep, ep, per_rank).cpu()  # [source, destination rank, local block]
    send_splits = table[rank].sum(dim=1).tolist()
    recv_splits = table[:, rank].sum(dim=1).tolist()

    packed = states.index_select(0, grouping.order)
    meta = torch.stack([grouping.segments, rope_index.index_select(0, grouping.order)], dim=1)
    received = all_to_all(group, packed, recv_splits, send_splits)
    meta_in = torch.empty(sum(recv_splits), 2, dtype=torch.long, device=dev)
    dist.all_to_all_single(meta_in, meta.contiguous(), recv_splits, send_splits, group=group)
    source = torch.repeat_interleave(
        torch.arange(ep, device=dev),
        torch.tensor(recv_splits, dtype=torch.long, device=dev),
        output_size=sum(recv_splits),
    )

    # group what arrived by local block; (source, window) pairs stay contiguous and ordered
    local_counts = table[:, rank]  # [source, local block], host
    block_ids = torch.arange(per_rank, device=dev)
    block_of = torch.cat(
        [
            torch.repeat_interleave(block_ids, local_counts[s].to(dev), output_size=int(local_counts[s].sum()))
            for s in range(ep)
        ]
    )
    by_block, perm = torch.sort(block_of, stable=True)
    x = received.index_select(0, perm)
    window = meta_in[perm, 0] * ep + source[perm]  # unique window key across sources
    positions = meta_in[perm, 1]
    outputs = []
    start = 0
    for local, count in enumerate(local_counts.sum(dim=0).tolist()):
        if count:
            chunk = x[start : start + count]
            seg = window[start : start + count]
            outputs.append(run_block(rank * per_rank + local, chunk, seg, positions[start : start + count]) - chunk)
        start += count
    # nothing arrived: the (empty) updates still come from what arrived, so that the reverse all-to-all's
    # output needs a gradient here as on the other ranks, and every rank runs its backward (else they hang)
    updates = torch.cat(outputs, dim=0) if outputs else x * 0
    unpermuted = updates.new_zeros(updates.shape).index_copy(0, perm, updates)
    return all_to_all(group, unpermuted, send_splits, recv_splits)
