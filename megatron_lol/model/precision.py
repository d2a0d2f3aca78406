"""Precision policy of a forward: which computations may run in FP8, and how packed rows are padded for it.

Mixed precision is Megatron-LM's: parameters in ``params_dtype`` (BF16 on
GPUs), FP32 main gradients in megatron-core's DDP (``grad_reduce_in_fp32``)
and FP32 master weights in its optimizer. What must stay exact does not follow
the dtype: the router (:class:`~megatron_lol.model.router.WindowRouter`),
window means, prefix sums, the balancing bias and loads are FP32 tensors in
every precision.

FP8 (Transformer Engine, ``model.precision.fp8`` with megatron-core's recipes) applies
to the GEMMs of the transformer layers only: the model enters
:func:`fp8_autocast` around its layers (one context per forward, as
megatron-core's ``TransformerBlock`` does, so delayed scaling reduces its
amaxes once), the core's router runs inside :func:`fp8_disabled`, and the
embedding and the LM head run outside. Those are plain torch / megatron-core
modules, which FP8 would not touch anyway; the contexts make the boundary
explicit and testable.

FP8 GEMMs need row counts that are multiples of megatron-core's
``get_fp8_align_size`` for the recipe (16; 32 for MXFP8). A micro-batch's
``micro_batch_size x seq_length`` tokens are checked by config validation; the
per-block batches of a routed depth vary in length, so the core pads each
block's packed windows with zero rows (one extra packed sequence, whose outputs
are dropped): :func:`row_multiple`.

Routed plans run a block at several depths and only where windows were routed
to it, so the FP8 recipe of every plan that runs layers more than once is
current scaling (``tensorwise``) by default and delayed scaling is refused
(``config.schema.runs_layers_repeatedly``; docs/gpu.md gives Transformer
Engine's reasons). Full recomputation under FP8 uses Transformer Engine's
checkpoint (:func:`recompute`), which re-enters the forward's FP8 autocast in
backward, as megatron-core's ``TransformerBlock`` does.
"""

from __future__ import annotations

import contextlib


def row_multiple(config) -> int:
    """Multiple the rows of a block's packed batch are padded to (1: no padding): megatron-core's
    ``fp8_utils.get_fp8_align_size`` for the config's recipe."""
    if not getattr(config, "fp8", None):
        return 1
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(config.fp8_recipe)


def recompute(config, function, *args):
    """Full activation recomputation of ``function(*args)`` (megatron-core's ``tensor_parallel.checkpoint``);
    under FP8 Transformer Engine's checkpoint, which saves the forward's FP8 state (recipe, scaling
    factors) and recomputes in backward inside the same autocast (megatron's ``te_checkpoint``), where
    megatron-core's own would recompute outside it, in higher precision than the forward ran."""
    from megatron.core import parallel_state, tensor_parallel

    if getattr(config, "fp8", None):
        from megatron.core.extensions import transformer_engine as te_ext

        group = (
            parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
        )
        return te_ext.te_checkpoint(function, False, tensor_parallel.random.get_cuda_rng_tracker, group, *args)
    return tensor_parallel.checkpoint(function, False, *args)


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


def enable_tf32(device, params_dtype: str) -> bool:
    """FP32 parameters on CUDA: matmuls in TF32 (``torch.set_float32_matmul_precision("high")``), as
    Megatron-LM runs FP32 on Ampere and later; MFU is then reported against the TF32 peak. Returns whether
    it was enabled (never on CPUs, nor for BF16 parameters, whose matmuls do not use it)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or params_dtype != "fp32":
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return True
