"""The ``model`` section's sub-sections with settings of their own: ``model.moe`` and ``model.precision``.

Each is a typed dataclass read by the loader like any section (an unknown key is an error
with a did-you-mean over the sub-section's own keys, ``model.moe.num_expert`` ->
``model.moe.num_experts``) and validated with the model it belongs to (its messages name
the key as the user writes it, ``model.moe.router_topk: ...``).

Why sub-sections of ``model`` and not top-level sections: both change what the network
computes (which MLPs are mixtures of experts; the dtype of the weights and which GEMMs run
in FP8), so a checkpoint's ``run_config.yaml`` keeps them with the shape, the HF export and
the converters read them from the model config alone, and a model built from a
``ModelConfig`` (tests, analyses) needs no other section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_lol.checks import choice, nonnegative, positive
from megatron_lol.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from megatron_lol.config.model_config import ModelConfig

MOE_LAYERS = ("none", "fixed", "all")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
PARAMS_DTYPES = ("auto", "fp32", "bf16")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclass
class MoEConfig:
    """FFN mixtures of experts (megatron-core MoE layers) in the fixed layers and/or the core's blocks.

    The names are Megatron-LM's without their ``moe_`` prefix (``--moe-router-topk`` is
    ``model.moe.router_topk``); ``layers`` says which layers are MoE: ``none``, ``fixed``
    (prelude and coda) or ``all``.
    """

    layers: str = "none"  # none | fixed (prelude+coda) | all
    num_experts: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # an expert's hidden width (default: the model's ffn_hidden_size)
    router_topk: int = 2
    core_num_experts: Optional[int] = None  # experts per MoE layer of the core; default num_experts
    shared_expert_intermediate_size: Optional[int] = None  # one always-on shared expert (Accordion)
    aux_loss_coeff: float = 0.01  # Switch load-balancing loss (megatron-core "aux_loss")
    z_loss_coeff: Optional[float] = None  # router z-loss (Foil: 1e-3)
    # megatron-core's router score (--moe-router-score-function): softmax over the top-k logits,
    # or sigmoid scores normalised over the chosen k
    router_score_function: str = "softmax"
    # megatron-core's auxiliary-loss-free balancing (--moe-router-enable-expert-bias, sigmoid scores only): a
    # per-expert bias added to the scores for the top-k choice only, moved after every optimizer step by
    # router_bias_update_rate toward equal loads (the global batch's token counts)
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    # Foil: average the two losses over all MoE layer executions (every layer on every pass)
    # instead of megatron-core's sum over layers
    loss_average_over_executions: bool = False

    @property
    def enabled(self) -> bool:
        return self.layers != "none"

    def validate(self, prefix: str = "model.moe") -> None:
        choice(f"{prefix}.layers", self.layers, MOE_LAYERS)
        if not self.enabled:
            for key in ("core_num_experts", "shared_expert_intermediate_size", "z_loss_coeff"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"{prefix}.{key}: needs MoE layers ({prefix}.layers is none)")
            if self.router_enable_expert_bias:
                raise ConfigError(f"{prefix}.router_enable_expert_bias: needs MoE layers ({prefix}.layers is none)")
            return
        if self.num_experts is None or self.num_experts < 1:
            raise ConfigError(f"{prefix}.num_experts: {prefix}.layers={self.layers} needs num_experts >= 1")
        if self.ffn_hidden_size is not None:
            positive(f"{prefix}.ffn_hidden_size", self.ffn_hidden_size)
        if not 1 <= self.router_topk <= self.num_experts:
            raise ConfigError(
                f"{prefix}.router_topk: must be in [1, num_experts={self.num_experts}] (got {self.router_topk})"
            )
        if self.core_num_experts is not None:
            if self.layers != "all":
                raise ConfigError(f"{prefix}.core_num_experts: needs {prefix}.layers: all (got {self.layers})")
            if not self.router_topk <= self.core_num_experts:
                raise ConfigError(
                    f"{prefix}.core_num_experts: must be >= router_topk={self.router_topk} "
                    f"(got {self.core_num_experts})"
                )
        if self.shared_expert_intermediate_size is not None:
            positive(f"{prefix}.shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        nonnegative(f"{prefix}.aux_loss_coeff", self.aux_loss_coeff)
        if self.z_loss_coeff is not None:
            nonnegative(f"{prefix}.z_loss_coeff", self.z_loss_coeff)
        choice(f"{prefix}.router_score_function", self.router_score_function, MOE_SCORE_FUNCTIONS)
        nonnegative(f"{prefix}.router_bias_update_rate", self.router_bias_update_rate)
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            # megatron-core's TransformerConfig refuses it too: the bias is added to sigmoid scores
            raise ConfigError(
                f"{prefix}.router_enable_expert_bias: needs router_score_function: sigmoid (megatron-core "
                f"adds the expert bias to sigmoid scores only; got {self.router_score_function})"
            )


def resolve_params_dtype(value: str) -> str:
    """``auto``: ``bf16`` on a CUDA target (Megatron-LM's ``--bf16``), ``fp32`` on CPUs (:mod:`.target`)."""
    if value != "auto":
        return value
    from megatron_lol.config.target import target_has_cuda

    return "bf16" if target_has_cuda() else "fp32"


def fp8_row_multiple(recipe: Optional[str]) -> int:
    """Rows an FP8 GEMM operand needs in multiples of: megatron-core's ``fp8_utils.get_fp8_align_size``
    (32 for MXFP8, else 16), restated here so that validation does not import megatron-core."""
    return 32 if recipe == "mxfp8" else 16


@dataclass
class PrecisionConfig:
    """The weights' dtype, the layer implementation and FP8 (docs/gpu.md, "Precision").

    ``params_dtype``: ``auto`` | ``fp32`` | ``bf16`` (BF16 weights, FP32 main grads and master
    weights); ``auto`` is bf16 where CUDA is present, fp32 on CPUs, resolved by validation
    (run_config.yaml records the result). ``transformer_engine``: the TE layer spec
    (Megatron-LM's ``--transformer-impl``); unset: when TE imports and CUDA is present. The
    ``fp8*`` keys are Megatron-LM's ``--fp8-format``, ``--fp8-recipe``, ``--fp8-margin``,
    ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo`` (the layers' GEMMs only, see
    model/precision.py); ``fp8_recipe`` defaults (by validation) to delayed for plans that run
    each layer once per forward and to tensorwise for the others.
    """

    params_dtype: str = "auto"
    transformer_engine: Optional[bool] = None
    fp8: Optional[str] = None  # e4m3 | hybrid
    fp8_recipe: Optional[str] = None  # delayed | tensorwise (current scaling) | mxfp8 | blockwise
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # most_recent | max

    def uses_transformer_engine(self) -> bool:
        """The layer spec: ``transformer_engine``, or (unset) whether TE imports with CUDA."""
        if self.transformer_engine is not None:
            return bool(self.transformer_engine)
        from megatron_lol.config.target import machine_has_cuda

        if not machine_has_cuda():
            return False  # as has_transformer_engine() answers without CUDA, and without importing torch
        from megatron_lol.platform import has_transformer_engine

        return has_transformer_engine()

    def validate(self, model: "ModelConfig", prefix: str = "model.precision") -> None:
        if self.params_dtype == "fp16":
            raise ConfigError(f"{prefix}.params_dtype: fp16 is not offered (it needs loss scaling); use bf16")
        choice(f"{prefix}.params_dtype", self.params_dtype, PARAMS_DTYPES)
        self.params_dtype = resolve_params_dtype(self.params_dtype)
        if self.fp8 is not None:
            self._validate_fp8(model, prefix)
        if self.transformer_engine:
            from megatron_lol.platform import has_transformer_engine

            if not has_transformer_engine():
                raise ConfigError(
                    f"{prefix}.transformer_engine: true, but Transformer Engine with CUDA "
                    f"is not available on this machine"
                )
        if self.params_dtype == "fp32" and self.uses_transformer_engine():
            # TE 2.9/2.10 get_attention_backend: FlashAttention and FusedAttention take fp16/bf16 only and
            # UnfusedDotProductAttention no THD, the packed layout of this spec (docs/gpu.md, "Precision")
            raise ConfigError(
                f"{prefix}.params_dtype: fp32 under the Transformer Engine spec has no attention "
                f"backend (TE's fused attention needs bf16, its unfused one does not take the packed "
                f"THD layout); use bf16 (or auto), or {prefix}.transformer_engine: false"
            )

    def _validate_fp8(self, model: "ModelConfig", prefix: str) -> None:
        """FP8 needs TE on CUDA (and Blackwell for MXFP8); the block GEMMs it runs need rows in
        multiples of 16 (checked with the batch shape in :meth:`ExperimentConfig.validate`)."""
        from megatron_lol.config.model_config import fp8_recipe_default, runs_layers_repeatedly
        from megatron_lol.platform import cuda_available, has_transformer_engine

        choice(f"{prefix}.fp8", self.fp8, FP8_FORMATS)
        plan = model.execution_plan()
        if self.fp8_recipe is None:
            self.fp8_recipe = fp8_recipe_default(plan)
        choice(f"{prefix}.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        choice(f"{prefix}.fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("most_recent", "max"))
        positive(f"{prefix}.fp8_amax_history_len", self.fp8_amax_history_len)
        nonnegative(f"{prefix}.fp8_margin", self.fp8_margin)
        if self.transformer_engine is False or not has_transformer_engine():
            why = (
                f"disabled by {prefix}.transformer_engine: false"
                if self.transformer_engine is False
                else "not available on this machine"
            )
            raise ConfigError(f"{prefix}.fp8: {self.fp8} needs Transformer Engine on CUDA ({why})")
        if self.params_dtype != "bf16":
            raise ConfigError(f"{prefix}.fp8: FP8 training needs params_dtype: bf16 (got {self.params_dtype})")
        if self.fp8_recipe == "mxfp8" and cuda_available():
            import torch

            major, _ = torch.cuda.get_device_capability()
            if major < 10:
                raise ConfigError(
                    f"{prefix}.fp8_recipe: mxfp8 needs a Blackwell GPU (compute capability 10+, "
                    f"this one has {major}.x); use delayed or tensorwise"
                )
        if self.fp8_recipe == "delayed" and runs_layers_repeatedly(plan):
            # TE's autocast: with reduce_amax a module must not run more than once per region, and every
            # rank must register the same modules in the same order for the amax all-reduce
            raise ConfigError(
                f"{prefix}.fp8_recipe: delayed scaling needs every FP8 layer to run once per forward "
                f"on every rank, but plan {plan.name} runs its blocks "
                f"{'where windows are routed' if plan.routed else 'several times'}; "
                f"use tensorwise (current scaling, the default for this plan)"
            )
        if plan.routed and model.moe.layers == "all":
            raise ConfigError(
                f"{prefix}.fp8: routed MoE blocks would route the zero rows that pad each block's "
                f"windows to FP8's row multiple to experts; use model.moe.layers: fixed or no fp8"
            )
