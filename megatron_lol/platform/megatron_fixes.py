"""Fixes of megatron-core behaviour that is wrong on every platform (CUDA included)."""

from __future__ import annotations

from megatron_lol.platform._common import _mark, _require, _require_source


def _patch_moe_aux_loss_scale_shape() -> None:
    """MoE auxiliary-loss scale: a backward outside megatron's schedules leaves a 0-dim scale.

    ``MoEAuxLossAutoScaler.backward`` creates its process-global scale as
    ``torch.tensor(1.0)`` (0-dim) when none was set, as happens when a MoE model is
    trained or checked with a plain ``loss.backward()``. The schedules then set the
    scale with ``copy_`` from a ``[1]`` tensor, which raises "output with shape []
    doesn't match the broadcast shape [1]": one such backward in a process breaks
    every later schedule-driven step. Setting the scale replaces a tensor of another
    shape (or on another device) instead of copying into it.
    """
    if not _mark("moe_aux_loss_scale_shape"):
        return
    from megatron.core.transformer.moe import moe_utils

    scaler = _require(moe_utils, "MoEAuxLossAutoScaler", "moe_aux_loss_scale_shape")
    _require_source(scaler.set_loss_scale, "main_loss_backward_scale.copy_(scale)", "moe_aux_loss_scale_shape")

    def set_loss_scale(scale):
        current = scaler.main_loss_backward_scale
        if current is None or current.shape != scale.shape or current.device != scale.device:
            scaler.main_loss_backward_scale = scale
        else:
            current.copy_(scale)

    scaler.set_loss_scale = staticmethod(set_loss_scale)
