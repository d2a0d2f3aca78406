"""Patches 3 and 4 (CPU only): collectives that megatron-core runs differently on gloo."""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_lol.platform._common import _mark, _require, _require_source


def _patch_moe_split_sizes() -> None:
    """Item 3: ``moe_utils.maybe_move_tensor_to_cpu`` on CPU tensors.

    Fixes: the alltoall token dispatcher asks for split sizes ``as_numpy=True``
    but the original converts only CUDA tensors, so on CPU a tensor reaches
    ``all_to_all_single(output_split_sizes=...)``, which raises TypeError.
    Patched in ``moe_utils`` and in ``token_dispatcher`` (imported by name).
    """
    if not _mark("moe_split_sizes"):
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = _require(moe_utils, "maybe_move_tensor_to_cpu", "moe_split_sizes")
    _require(token_dispatcher, "maybe_move_tensor_to_cpu", "moe_split_sizes")

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------
# Item 4: gloo batched p2p with 2 pipeline stages
# ---------------------------------------------------------------------------


def _patch_gloo_batched_p2p() -> None:
    """Item 4: route batched pipeline p2p through the unbatched even/odd path on gloo.

    Fixes: gloo's ``batch_isend_irecv`` is a loop of isend/irecv on one
    communicator; with PP=2 (previous == next rank) the interleaved schedule's
    exchanges match the wrong tensors *silently* (wrong loss and grad norm).
    ``p2p_communication._p2p_ops`` orders sends/receives by even/odd rank and
    uses two communicators, which is correct. Non-gloo groups are untouched.
    """
    if not _mark("gloo_batched_p2p"):
        return
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    orig_batched = _require(p2p, "_batched_p2p_ops", "gloo_batched_p2p")
    unbatched = _require(p2p, "_p2p_ops", "gloo_batched_p2p")
    _require_source(p2p.P2PCommunicator._communicate, "_batched_p2p_ops", "gloo_batched_p2p")

    @functools.wraps(orig_batched)
    def _batched_p2p_ops(*, group: Any, **kwargs: Any) -> list:
        if torch.distributed.get_backend(group) == "gloo":
            reqs = unbatched(group=group, **kwargs)
            return list(reqs.values())
        return orig_batched(group=group, **kwargs)

    p2p._batched_p2p_ops = _batched_p2p_ops
