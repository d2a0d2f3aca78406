"""Patch 6 (whenever Transformer Engine and apex are absent, also with CUDA)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_lol.platform._common import _mark, _require, _require_source


def _patch_te_general_gemm() -> None:
    """Item 6a: define ``moe_utils.te_general_gemm = None`` when TE is absent.

    Fixes: the MoE router's ``RouterGatingLinearFunction`` reads the module
    global ``te_general_gemm``, which ``moe_utils`` only imports when TE
    imports: NameError without TE. ``None`` selects the torch matmul path.
    """
    if not _mark("te_general_gemm"):
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _require_source(moe_utils.RouterGatingLinearFunction.forward, "te_general_gemm", "te_general_gemm")
        moe_utils.te_general_gemm = None


def _patch_distrib_optimizer_torch_adam_step() -> None:
    """Item 6b: distributed-optimizer checkpoints with the torch Adam(W) fallback.

    Without TE/apex (``distrib_optimizer.HAVE_APEX_OR_TE`` False) the inner
    optimizer is ``torch.optim.Adam(W)``, which keeps a per-parameter ``step``:

    * ``DistributedOptimizer.state_dict()`` does ``assert len(steps) == 1``
      over the per-parameter steps; a freshly built optimizer has none, and
      ``sharded_state_dict(is_loading=True)`` calls it before loading, so every
      checkpoint load fails. The patch: no state -> the step of the param groups, or 0.
    * ``_set_main_param_and_optimizer_states`` copies every key of the inner
      state, including ``step``, from the loaded parameter state, which has no
      ``step`` (the loaders skip it): KeyError. The patch leaves ``step`` alone there,
      and the copy runs under ``no_grad`` (the ``dp_reshardable`` loader lacks
      it: "a view of a leaf Variable ... in-place" with fp32 params).
    * Adam then resumes at the wrong step (wrong bias correction): with
      ``dp_reshardable`` the per-parameter ``step`` stays 0; with
      ``fully_reshardable`` every parameter shares *one* step tensor, which
      torch Adam increments in place once per parameter. The patch re-applies the step saved in
      the checkpoint's param groups after ``load_state_dict``, as
      one fresh tensor per parameter.
    """
    if not _mark("distrib_optimizer_torch_adam_step"):
        return
    from megatron.core.optimizer import distrib_optimizer as dopt

    name = "distrib_optimizer_torch_adam_step"
    if _require(dopt, "HAVE_APEX_OR_TE", name):
        return
    cls = _require(dopt, "DistributedOptimizer", name)
    orig_state_dict = _require(cls, "state_dict", name)
    orig_load_state_dict = _require(cls, "load_state_dict", name)
    orig_set_states = _require(cls, "_set_main_param_and_optimizer_states", name)
    _require_source(orig_state_dict, "assert len(steps) == 1", name)
    _require_source(orig_load_state_dict, 'param_groups"]]))', name)
    _require_source(orig_set_states, "dst_tensors[key].copy_(tensors[key])", name)

    def _as_float(v: Any) -> float:
        return float(v.item() if torch.is_tensor(v) else v)

    @functools.wraps(orig_state_dict)
    def state_dict(self):
        if getattr(self.ddp_config, "use_megatron_fsdp", False) or isinstance(
            self.optimizer, getattr(dopt, "HybridDeviceOptimizer", ())
        ):
            return orig_state_dict(self)
        inner = self.optimizer
        steps = {_as_float(s["step"]) for s in inner.state.values() if "step" in s}
        if len(steps) == 1 and all("step" in s for s in inner.state.values()):
            return orig_state_dict(self)
        if len(steps) > 1:
            raise RuntimeError(f"DistributedOptimizer: Adam steps differ across parameters: {sorted(steps)}")
        group_steps = {_as_float(g["step"]) for g in inner.param_groups if g.get("step") is not None}
        step = next(iter(group_steps)) if len(group_steps) == 1 else 0.0
        orig_inner_state_dict = inner.state_dict

        def inner_state_dict_with_step():
            sd = orig_inner_state_dict()
            sd["state"] = {k: {**v, "step": torch.tensor(step)} for k, v in sd["state"].items()} or {
                0: {"step": torch.tensor(step)}
            }
            return sd

        inner.state_dict = inner_state_dict_with_step
        try:
            return orig_state_dict(self)
        finally:
            del inner.state_dict

    @functools.wraps(orig_set_states)
    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # no_grad: load_parameter_state_from_dp_reshardable (unlike the other
        # loaders) is not decorated with it, and copying into an fp32 model
        # param's shard view (a view of a leaf requiring grad) then raises.
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig_set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst_tensors = {"param": main_param, **self.optimizer.state[main_param]}
        for key, dst in dst_tensors.items():
            if key == "step":
                continue  # torch Adam's step is restored from the param groups
            dst.copy_(tensors[key])

    @functools.wraps(orig_load_state_dict)
    def load_state_dict(self, state_dict):
        result = orig_load_state_dict(self, state_dict)
        if getattr(self.ddp_config, "use_megatron_fsdp", False) or "optimizer" not in state_dict:
            return result
        steps = {
            _as_float(g["step"]) for g in state_dict["optimizer"].get("param_groups", []) if g.get("step") is not None
        }
        if len(steps) == 1:
            step = next(iter(steps))
            for st in self.optimizer.state.values():
                if "step" in st:
                    old = st["step"]
                    st["step"] = torch.tensor(step, dtype=old.dtype if torch.is_tensor(old) else torch.float32)
        return result

    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


class TorchWgradAccumulation:
    """The two functions of apex's ``fused_weight_gradient_mlp_cuda`` extension, in torch.

    megatron-core's local linears with ``gradient_accumulation_fusion`` (model/library.py turns it on for
    BF16 training under megatron-core's DDP) add each call's weight gradient ``grad_output^T @ input``
    straight into the parameter's FP32 ``main_grad`` instead of returning it to autograd, which would
    sum the calls of a layer used at several depths in BF16 first. Without apex the extension is
    missing and megatron-core refuses the option; this class does what apex's kernels do.
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(fp32_product(grad_output.t(), total_input))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(torch.matmul(grad_output.t(), total_input).to(main_grad.dtype))


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands with an FP32 result: on CUDA one GEMM with FP32 output (products of
    BF16 values are exact, sums FP32); elsewhere, or where that overload is missing, the operands are
    widened first (exact too, slower)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # torch without the out_dtype overload
            pass
    return torch.mm(a.float(), b.float())


def _patch_wgrad_accumulation_fusion() -> None:
    """Item 6c (without apex's ``fused_weight_gradient_mlp_cuda``): megatron-core's
    ``tensor_parallel.layers`` gets :class:`TorchWgradAccumulation` in its place, so
    ``gradient_accumulation_fusion`` works on the local spec."""
    if not _mark("wgrad_accumulation_fusion"):
        return
    from megatron.core.tensor_parallel import layers

    name = "wgrad_accumulation_fusion"
    if _require(layers, "_grad_accum_fusion_available", name):
        return  # apex's extension is there
    _require_source(
        layers.LinearWithGradAccumulationAndAsyncCommunication.backward,
        "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32",
        name,
    )
    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's ``local_multi_tensor_l2_norm`` (megatron/core/utils.py), read back nowhere.

    Same signature and result: the L2 norm of all tensors of ``tensor_lists`` together, as a ``[1]`` float32
    tensor on their device, and None. megatron-core's fallback takes ``torch.norm`` of every tensor, builds
    a tensor of those norms with ``torch.tensor(list)`` (one ``.item()`` per tensor, so one host read per
    parameter every step) and ``float()``s the result; here ``torch._foreach_norm`` (one fused launch per
    device and dtype on CUDA) gives the per-tensor norms and the norm of their stack stays on the device.
    Norms are taken in FP32, as the fallback's are for the FP32 main gradients it gets."""
    del chunk_size, noop_flag, args
    assert not per_tensor, "per-tensor norms are not asked for by clip_grads"
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _patch_grad_norm_without_host_reads() -> None:
    """Item 6d (without TE's and apex's multi-tensor kernels): megatron-core's gradient clipping takes
    :func:`foreach_l2_norm` as its ``l2_norm_impl``, so the gradient norm is read to the host once per step
    (``get_grad_norm_fp32``'s ``total_norm.item()``, after the reduction over ranks) instead of once per
    parameter. The reduction across ranks is megatron-core's own, unchanged."""
    if not _mark("grad_norm_without_host_reads"):
        return
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    name = "grad_norm_without_host_reads"
    local = _require(utils, "local_multi_tensor_l2_norm", name)
    if _require(clip_grads, "l2_norm_impl", name) is not local:
        return  # TE's or apex's fused kernel: already on the device
    _require_source(clip_grads.get_grad_norm_fp32, "l2_norm_impl", name)
    clip_grads.l2_norm_impl = foreach_l2_norm
