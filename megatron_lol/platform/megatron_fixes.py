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


def _patch_float16_optimizer_fp32_params() -> None:
    """A bf16 model with FP32 parameters saves through the non-distributed optimizer.

    This package keeps the LoL routers, depth vectors and other routing parameters in
    FP32 inside a bf16 model (docs/gpu.md). megatron-core's
    ``Float16OptimizerWithFloat16Params.sharded_state_dict`` numbers only the bf16
    parameters when it maps optimizer-state ids to the model's sharded tensors,
    while the optimizer numbers every parameter of a group in order: with FP32
    parameters among them the ids disagree and saving fails (``KeyError``) or, in
    an unlucky order, files one tensor's state under another's key. Here every
    parameter is numbered in the optimizer's own order (each bf16 model parameter
    standing for its FP32 main copy), and each main copy is saved under its own id.
    With only bf16 parameters the result is the one megatron-core produces.
    """
    name = "float16_optimizer_fp32_params"
    if not _mark(name):
        return
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )
    from megatron.core.optimizer import optimizer as optimizer_module

    cls = _require(optimizer_module, "Float16OptimizerWithFloat16Params", name)
    _require_source(cls.sharded_state_dict, "chain.from_iterable(g for g in self.float16_groups)", name)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        model_of_main = {
            id(main): model
            for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups)
            for model, main in zip(models, mains)
        }
        in_optimizer_order = [
            model_of_main.get(id(p), p) for group in self.optimizer.param_groups for p in group["params"]
        ]
        id_to_sharded_param = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_optimizer_order)
        fp32_from_fp16 = []
        for mains, group, saved_group in zip(
            state_dict["fp32_from_fp16_params"], self.optimizer.param_groups, state_dict["optimizer"]["param_groups"]
        ):
            main_ids = [pid for pid, p in zip(saved_group["params"], group["params"]) if id(p) in model_of_main]
            fp32_from_fp16.append(
                [
                    make_sharded_optimizer_tensor(id_to_sharded_param[pid], main, prefix="optimizer.state.fp32_param")
                    for pid, main in zip(main_ids, mains)
                ]
            )
        state_dict["fp32_from_fp16_params"] = fp32_from_fp16
        step = self._extract_common_per_param_step(state_dict["optimizer"])
        optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param, exclude_keys="step")
        if step:
            state_dict["optimizer"]["state"]["common_step"] = step
        return state_dict

    cls.sharded_state_dict = sharded_state_dict


def _patch_distributed_optimizer_fp32_params() -> None:
    """A bf16 model with FP32 parameters saves and loads through the distributed optimizer.

    megatron-core's ``DistributedOptimizer`` records each model parameter's place in
    its optimizer group (``model_param_group_index_map``) in grad-buffer order, then
    builds the groups as [FP32 parameters..., main copies of the bf16 ones...]. With
    FP32 and bf16 parameters in one group the recorded places point at other
    tensors: saving fails copying one tensor's state into another's range, and
    loading would put states on the wrong parameters. After construction the map
    is rebuilt from the groups as built (a no-op with only bf16 parameters).
    """
    name = "distributed_optimizer_fp32_params"
    if not _mark(name):
        return
    import functools

    from megatron.core.optimizer import distrib_optimizer

    cls = _require(distrib_optimizer, "DistributedOptimizer", name)
    _require_source(cls._build_model_and_main_param_groups, "*shard_fp32_params_this_group,", name)
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.model_param_group_index_map = {
            param: (group_index, order)
            for group_index, (fp32, float16) in enumerate(zip(self.model_fp32_groups, self.model_float16_groups))
            for order, param in enumerate([*fp32, *float16])
        }

    cls.__init__ = __init__
