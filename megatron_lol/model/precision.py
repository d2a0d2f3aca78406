"""Precision policy of a forward: which computations may run in FP8, and how packed rows are padded for it.

Mixed precision is Megatron-LM's: parameters in ``params_dtype`` (BF16 on
GPUs), FP32 main gradients in megatron-core's DDP (``grad_reduce_in_fp32``)
and FP32 master weights in its optimizer. What must stay exact does not follow
the dtype: the router (:class:`~megatron_lol.model.router.WindowRouter`),
window means, prefix sums, the balancing bias and loads are FP32 tensors in
every precision.

FP8 (Transformer Engine, ``model.fp8`` with megatron-core's recipes) applies
to the GEMMs of the transformer layers only: the model enters
:func:`fp8_autocast` around its layers (one context per forward, as
megatron-core's ``TransformerBlock`` does, so delayed scaling reduces its
amaxes once), the core's router runs inside :func:`fp8_disabled`, and the
embedding and the LM head run outside. Those are plain torch / megatron-core
modules, which FP8 would not touch anyway; the contexts make the boundary
explicit and testable.

FP8 GEMMs need row counts that are multiples of :data:`FP8_ROW_MULTIPLE`. A
micro-batch's ``micro_batch_size x seq_length`` tokens are checked by config
validation; the per-block batches of a routed depth vary in length, so the
core pads each block's packed windows with zero rows (one extra packed
sequence, whose outputs are dropped): :func:`row_multiple`.
"""

from __future__ import annotations

import contextlib

#: FP8 GEMMs need the rows of their operands in multiples of 16 (Transformer Engine)
FP8_ROW_MULTIPLE = 16


def row_multiple(config) -> int:
    """Multiple the rows of a block's packed batch are padded to (1: no padding)."""
    return FP8_ROW_MULTIPLE if getattr(config, "fp8", None) else 1


def _te_autocast(config, enabled: bool):
    """Transformer Engine's autocast: megatron-core's recipe from ``config`` when enabled."""
    if enabled:
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(config)
    import transformer_engine.pytorch as te

    return te.fp8_autocast(enabled=False)


def fp8_autocast(config):
    """FP8 for the transformer layers run inside (a no-op context unless ``config.fp8``)."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    return _te_autocast(config, True)


def fp8_disabled(config):
    """Inside :func:`fp8_autocast`: a region that stays in higher precision (the router)."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    return _te_autocast(config, False)
