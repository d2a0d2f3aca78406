"""Typed configuration for every run: model, parallel layout, data, training.

One YAML file maps onto :class:`ExperimentConfig` section by section. Every
field is validated up front (:meth:`ExperimentConfig.validate`) so that a bad
value stops the run with a one-line error naming the key *before* any process
group, dataset or model is built.

Names follow Megatron-LM's arguments where one exists (``hidden_size``,
``num_attention_heads``, ``ffn_hidden_size``, ``micro_batch_size``,
``tensor_model_parallel_size``, ...); LoL-specific knobs use the symbols of the
paper in their docstrings (L, D, W, S).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional

from megatron_lol.config.checks import asdict, choice, nonnegative, positive
from megatron_lol.errors import ConfigError
from megatron_lol.plan import PLANS, ExecutionPlan, build_plan, plan_kind
from megatron_lol.plan.execution import DENSE_ATTENTION, all_flat_keys, flat_keys
from megatron_lol.plan.legacy import ConfigDeprecationWarning
from megatron_lol.plan.stages import check_pipeline_layout

BALANCING = ("loss_free", "aux_loss", "none")
FILM_MODES = ("off", "depth", "depth_block")
ROUTED_CORES = ("auto", "reference", "grouped")
ROUTER_INPUTS = ("windows", "depth")
PARAMS_DTYPES = ("auto", "fp32", "bf16")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")


def resolve_params_dtype(value: str) -> str:
    """``auto``: ``bf16`` on a CUDA target (Megatron-LM's ``--bf16``), ``fp32`` on CPUs (:mod:`.target`)."""
    if value != "auto":
        return value
    from megatron_lol.config.target import target_has_cuda

    return "bf16" if target_has_cuda() else "fp32"


def runs_layers_repeatedly(plan: ExecutionPlan) -> bool:
    """Whether a forward may call one layer more than once, or a layer on some ranks only: routed plans
    (a block runs at every depth that routes windows to it) and plans whose steps reuse a block."""
    blocks = [step.block for step in plan.steps()]
    return plan.routed or len(set(blocks)) < len(blocks)


def fp8_recipe_default(plan: ExecutionPlan) -> str:
    """Megatron-LM's ``delayed`` where every layer runs once per forward; current (``tensorwise``)
    scaling for plans that run layers repeatedly or data-dependently (delayed scaling is refused there)."""
    return "tensorwise" if runs_layers_repeatedly(plan) else "delayed"


def fp8_row_multiple(recipe: Optional[str]) -> int:
    """Rows an FP8 GEMM operand needs in multiples of: megatron-core's ``fp8_utils.get_fp8_align_size``
    (32 for MXFP8, else 16), restated here so that validation does not import megatron-core."""
    return 32 if recipe == "mxfp8" else 16


@dataclass
class ModelConfig:
    """What the network computes (docs/model.md).

    ``plan`` is how the stored blocks are executed: a tagged section whose ``kind``
    names a registered plan kind (:mod:`megatron_lol.plan.kinds`) and whose other
    keys are that kind's own options, e.g. ``plan: {kind: lol, num_blocks: 8,
    routed_depth: 8}`` or ``plan: {kind: foil, experts: 8, layers: 8, loops: 2}``:

    * ``lol``: ``num_blocks`` (L) blocks in the library, ``routed_depth`` (D)
      routed depths, windows ``window_size`` (W) shifted by ``window_shift`` (S);
    * ``dense``: ``layers`` distinct layers in order;
    * ``looped``: ``layers`` layers looped ``loops`` times (Huginn);
    * ``foil``: a looped block of ``layers`` MoE layers with ``experts`` experts,
      looped ``loops`` times, attention untied per pass;
    * ``accordion``: the ``window`` layers once, then the first ``k`` again
      (``budgets``; ``k = 0`` is the unlooped model).

    A bare kind name (``plan: lol``) takes the kind's defaults. The built-in kinds keep
    their options in flat fields below (``num_blocks``, ``foil_layers``, ...); writing those
    at the top of ``model`` is the deprecated spelling, read with a deprecation warning, as
    is the older one (``num_blocks`` / ``routed_depth`` for every plan, Foil as ``plan:
    looped`` with MoE blocks). ``to_dict`` writes the section.
    """

    plan: Any = "lol"  # the kind's name once read; a mapping {kind: ..., ...} as written
    # options of a plan kind registered from outside the package (written inside model.plan)
    plan_options: dict = field(default_factory=dict)
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # default: SwiGLU 8/3 * h rounded up to 64
    kv_channels: Optional[int] = None
    n_prelude: int = 1
    n_coda: int = 1
    num_blocks: Optional[int] = None  # lol: L, blocks stored in the library (default 4)
    routed_depth: Optional[int] = None  # lol: D, routed depths (default 4)
    core_layers: Optional[int] = None  # dense: layers of the core
    loop_layers: Optional[int] = None  # looped: layers of the recurrent block
    loop_count: Optional[int] = None  # looped: passes over it
    foil_experts: Optional[int] = None  # foil: E, experts per MoE layer of the looped block
    foil_layers: Optional[int] = None  # foil: D, layers of the looped block
    foil_loops: Optional[int] = None  # foil: L, passes over it
    loop_window: Optional[int] = None  # accordion: layers of the loopable window
    window_size: int = 32  # W
    window_shift: int = 16  # S: depth l is shifted by ((l-1)*S) mod W
    # dense-plan attention inside the core: full causal, sliding window W, or
    # LoL's shifted windows with a fixed block per depth ("strided")
    dense_attention: str = "full"
    vocab_size: Optional[int] = None  # default: the tokenizer's, padded
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = True
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 1.0  # linear position interpolation for context extension
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    # router (docs/model.md, "Router")
    router_tied: bool = True
    router_noise: bool = True
    router_noise_clamp: float = 10.0
    # what the router reads (docs/model.md, "Router"): "windows" = the past windows' states (LoL);
    # "depth" = only the depth vector e^(l), a learned route that ignores the input (the control run
    # that separates input adaptivity from the shared library, masks, FiLM and growth schedule)
    router_input: str = "windows"
    # router-only tokens (docs/model.md, "Router-only tokens"): these ids reach the router only (the mean
    # of their router embeddings, up to each window's first token, is added to the router's input); the
    # layers see router_only_filler in their place and their labels carry no loss (a strategy field)
    router_only_tokens: list = field(default_factory=list)
    router_only_filler: Optional[int] = None
    # balancing (docs/model.md, "Load balancing")
    balancing: str = "loss_free"
    bias_update_speed: float = 1e-3
    bias_clamp: float = 16.0
    bias_update_stop_fraction: float = 0.966
    per_depth_bias: bool = False
    seq_aux_loss_coeff: float = 1e-4
    aux_loss_coeff: float = 0.02
    # options (docs/model.md, "FiLM" and "Input injection")
    film: str = "off"
    input_injection: bool = False
    # how a LoL core's routed depths run (docs/gpu.md, "The routed depth on a GPU"): "reference" = per-block
    # calls on a layout measured on the device; "grouped" = the host-built layout, sync-free routing and all
    # blocks of a depth as one grouped computation (model/grouped_core.py); "auto" = grouped on CUDA where the
    # model supports it, the reference elsewhere (on CPU the reference with the CPU backend is faster)
    routed_core: str = "auto"
    # FFN mixture of experts (megatron-core MoE) in the fixed layers and/or blocks
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_layers: str = "none"  # none | fixed (prelude+coda) | all
    core_num_experts: Optional[int] = None  # experts per MoE layer of the core (Foil's E); default num_experts
    moe_shared_expert_intermediate_size: Optional[int] = None  # one always-on shared expert (Accordion)
    moe_aux_loss_coeff: float = 0.01  # Switch load-balancing loss (megatron-core "aux_loss")
    moe_z_loss_coeff: Optional[float] = None  # router z-loss (Foil: 1e-3)
    # megatron-core's router score (Megatron-LM's --moe-router-score-function): softmax over the top-k logits,
    # or sigmoid scores normalised over the chosen k
    moe_router_score_function: str = "softmax"
    # megatron-core's auxiliary-loss-free balancing (--moe-router-enable-expert-bias, sigmoid scores only): a
    # per-expert bias added to the scores for the top-k choice only, moved after every optimizer step by
    # moe_router_bias_update_rate toward equal loads (the global batch's token counts)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Foil: average the two losses over all MoE layer executions (every layer on every pass)
    # instead of megatron-core's sum over layers
    moe_loss_average_over_executions: bool = False
    # looped plans: one attention (and its input norm) per (block, pass); MLP/experts stay shared
    # (default: true for foil, false for looped)
    untie_attention: Optional[bool] = None
    # accordion: budgets k (second-pass executions of the window's first k layers)
    loop_budgets: list = field(default_factory=lambda: [0])
    loop_budget: Optional[int] = None  # fixed budget for training/eval/inference; None: sample in training
    second_pass_router: str = "shared"  # shared | separate (one extra MoE router per loopable layer)
    loop_gates: bool = True  # per-channel gates on the second pass's attention and MLP writes
    # auto | fp32 | bf16 (BF16 weights, FP32 main grads and master weights: docs/gpu.md); auto: bf16 where
    # CUDA is present, fp32 on CPUs, resolved by validation (run_config.yaml records the result)
    params_dtype: str = "auto"
    use_transformer_engine: Optional[bool] = None  # None: when TE imports and CUDA is present
    # FP8 through Transformer Engine, Megatron-LM's flags (--fp8-format, --fp8-recipe, --fp8-margin,
    # --fp8-amax-history-len, --fp8-amax-compute-algo); the layers' GEMMs only, see model/precision.py
    fp8: Optional[str] = None  # e4m3 | hybrid
    # delayed | tensorwise (current scaling) | mxfp8 | blockwise; default (resolved by validation): delayed for
    # plans that run each layer once per forward, tensorwise for the others (see fp8_recipe_default)
    fp8_recipe: Optional[str] = None
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # most_recent | max

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def __post_init__(self) -> None:
        self.normalize()

    def normalize(self) -> "ModelConfig":
        """Read a ``plan`` section into the kind and its options, the deprecated shape keys into the
        plan's own (deprecation warning), and fill LoL's defaults; idempotent, so it also runs after
        ``--set`` overrides."""
        from megatron_lol.plan.legacy import migrate_model_keys

        if isinstance(self.plan, dict):
            self.read_plan_section(self.plan)
        migrate_model_keys(self)
        return self

    # ------------------------------------------------------------- plan section
    def read_plan_section(self, section: dict, source: str = "model.plan") -> None:
        """Take ``plan: {kind: NAME, key: value, ...}``: the kind, then each key as its option."""
        if "kind" not in section:
            raise ConfigError(f"{source}: a plan section needs kind: one of {', '.join(PLANS)}")
        cls = plan_kind(section["kind"], "model")
        # the section is the whole plan: options of other kinds go back to their defaults
        own = set(flat_keys(cls).values())
        defaults = {f.name: f for f in dataclasses.fields(self)}
        for flat in all_flat_keys():
            if flat not in own:
                f = defaults[flat]
                setattr(self, flat, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        self.plan_options = {}
        self.plan = cls.name
        for key, value in section.items():
            if key == "kind":
                continue
            flat = flat_keys(cls).get(key)
            if flat is not None:
                before, default = getattr(self, flat), defaults[flat].default
                if default is not dataclasses.MISSING and before != default and before != value:
                    raise ConfigError(
                        f"{source}: model.{flat}={before!r} given together with model.plan.{key}={value!r}; "
                        f"remove model.{flat}"
                    )
            self.set_plan_option(key, value, source)

    def set_plan_option(self, key: str, value: Any, source: str = "model.plan") -> None:
        """Set option ``key`` of the current plan kind (``--set model.plan.KEY=VALUE``)."""
        from megatron_lol.config.loader import coerce_value

        cls = plan_kind(self.plan, "model")
        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        if key not in fields:
            known = ", ".join(fields) or "none"
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"{source}: model.plan.{key} is not an option of plan {cls.name}{hint} (its options: {known})"
            )
        hint = typing_hints(cls.Options)[key]
        coerced = coerce_value(hint, value, source, f"model.plan.{key}")
        flat = fields[key].metadata.get("flat")
        if flat:
            setattr(self, flat, coerced)
        else:
            self.plan_options[key] = coerced

    def plan_section(self) -> dict:
        """The current kind's options ``{key: value}`` (defaults filled in)."""
        cls = plan_kind(self.plan, "model")
        out = {}
        for f in dataclasses.fields(cls.Options):
            flat = f.metadata.get("flat")
            if flat:
                out[f.name] = getattr(self, flat)
            elif f.name in self.plan_options:
                out[f.name] = self.plan_options[f.name]
            elif f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    def to_dict(self) -> dict:
        """Plain data with the plan as its tagged section (no flat plan keys): what run_config.yaml holds."""
        out = asdict(self)
        for flat in all_flat_keys():
            out.pop(flat, None)
        out.pop("plan_options", None)
        out["plan"] = {"kind": self.plan, **self.plan_section()}
        return out

    def execution_plan(self, prefix: str = "model") -> ExecutionPlan:
        """The plan's steps for this config (one-line ConfigError on bad shape keys)."""
        return build_plan(self, prefix)

    @property
    def core_depth(self) -> int:
        """Steps of the full core (Accordion: at its largest budget)."""
        return self.execution_plan().depth

    def uses_transformer_engine(self) -> bool:
        """The layer spec: ``use_transformer_engine``, or (unset) whether TE imports with CUDA."""
        if self.use_transformer_engine is not None:
            return bool(self.use_transformer_engine)
        from megatron_lol.platform import has_transformer_engine

        return has_transformer_engine()

    @property
    def core_experts(self) -> Optional[int]:
        """Experts per MoE layer of the core's blocks (None: the core has dense MLPs)."""
        return self.execution_plan().core_experts

    def _validate_router_only(self, prefix: str) -> None:
        ids = self.router_only_tokens
        if not ids:
            if self.router_only_filler is not None:
                raise ConfigError(f"{prefix}.router_only_filler: set without {prefix}.router_only_tokens")
            return
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids) or len(set(ids)) < len(ids):
            raise ConfigError(f"{prefix}.router_only_tokens: must be distinct token ids >= 0 (got {ids})")
        if not self.execution_plan().routed:
            raise ConfigError(f"{prefix}.router_only_tokens: only a routed plan has a window router (plan {self.plan})")
        if self.router_input != "windows":
            raise ConfigError(f"{prefix}.router_only_tokens: needs router_input: windows (got {self.router_input})")
        filler = self.router_only_filler
        if not isinstance(filler, int) or filler < 0 or filler in ids:
            raise ConfigError(
                f"{prefix}.router_only_filler: the token id the layers see in place of a router-only token, "
                f"not one of router_only_tokens (got {filler})"
            )

    def validate(self, prefix: str = "model") -> None:
        self.normalize()
        choice(f"{prefix}.plan", self.plan, tuple(PLANS))
        choice(f"{prefix}.balancing", self.balancing, BALANCING)
        choice(f"{prefix}.film", self.film, FILM_MODES)
        choice(f"{prefix}.router_input", self.router_input, ROUTER_INPUTS)
        self._validate_router_only(prefix)
        choice(f"{prefix}.routed_core", self.routed_core, ROUTED_CORES)
        choice(f"{prefix}.dense_attention", self.dense_attention, DENSE_ATTENTION)
        if self.params_dtype == "fp16":
            raise ConfigError(f"{prefix}.params_dtype: fp16 is not offered (it needs loss scaling); use bf16")
        choice(f"{prefix}.params_dtype", self.params_dtype, PARAMS_DTYPES)
        self.params_dtype = resolve_params_dtype(self.params_dtype)
        positive(f"{prefix}.hidden_size", self.hidden_size)
        positive(f"{prefix}.num_attention_heads", self.num_attention_heads)
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ConfigError(
                f"{prefix}.num_attention_heads: {self.num_attention_heads} does not divide "
                f"{prefix}.hidden_size={self.hidden_size}"
            )
        if self.num_query_groups is not None:
            positive(f"{prefix}.num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError(
                    f"{prefix}.num_query_groups: {self.num_query_groups} does not divide "
                    f"num_attention_heads={self.num_attention_heads}"
                )
        if self.ffn_hidden_size is not None:
            positive(f"{prefix}.ffn_hidden_size", self.ffn_hidden_size)
        nonnegative(f"{prefix}.n_prelude", self.n_prelude)
        nonnegative(f"{prefix}.n_coda", self.n_coda)
        positive(f"{prefix}.window_size", self.window_size)
        if not 0 <= self.window_shift < self.window_size:
            raise ConfigError(
                f"{prefix}.window_shift: must be in [0, window_size={self.window_size}) (got {self.window_shift})"
            )
        self.execution_plan(prefix)  # the plan's own shape keys and options
        if self.vocab_size is not None:
            positive(f"{prefix}.vocab_size", self.vocab_size)
        positive(f"{prefix}.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        positive(f"{prefix}.rotary_base", self.rotary_base)
        positive(f"{prefix}.rotary_scaling_factor", self.rotary_scaling_factor)
        positive(f"{prefix}.init_method_std", self.init_method_std)
        nonnegative(f"{prefix}.bias_update_speed", self.bias_update_speed)
        positive(f"{prefix}.bias_clamp", self.bias_clamp)
        if not 0 <= self.bias_update_stop_fraction <= 1:
            raise ConfigError(
                f"{prefix}.bias_update_stop_fraction: must be in [0, 1] (got {self.bias_update_stop_fraction})"
            )
        nonnegative(f"{prefix}.seq_aux_loss_coeff", self.seq_aux_loss_coeff)
        nonnegative(f"{prefix}.aux_loss_coeff", self.aux_loss_coeff)
        positive(f"{prefix}.router_noise_clamp", self.router_noise_clamp)
        choice(f"{prefix}.moe_layers", self.moe_layers, ("none", "fixed", "all"))
        if self.fp8 is not None:
            self._validate_fp8(prefix)
        if self.use_transformer_engine:
            from megatron_lol.platform import has_transformer_engine

            if not has_transformer_engine():
                raise ConfigError(
                    f"{prefix}.use_transformer_engine: true, but Transformer Engine with CUDA "
                    f"is not available on this machine"
                )
        if self.params_dtype == "fp32" and self.uses_transformer_engine():
            # TE 2.9/2.10 get_attention_backend: FlashAttention and FusedAttention take fp16/bf16 only and
            # UnfusedDotProductAttention no THD, the packed layout of this spec (docs/gpu.md, "Precision")
            raise ConfigError(
                f"{prefix}.params_dtype: fp32 under the Transformer Engine spec has no attention "
                f"backend (TE's fused attention needs bf16, its unfused one does not take the packed "
                f"THD layout); use bf16 (or auto), or model.use_transformer_engine: false"
            )
        if self.moe_layers != "none":
            if self.num_experts is None or self.num_experts < 1:
                raise ConfigError(f"{prefix}.num_experts: moe_layers={self.moe_layers} needs num_experts >= 1")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ConfigError(
                    f"{prefix}.moe_router_topk: must be in [1, num_experts={self.num_experts}] "
                    f"(got {self.moe_router_topk})"
                )
            if self.core_num_experts is not None:
                if self.moe_layers != "all":
                    raise ConfigError(f"{prefix}.core_num_experts: needs moe_layers: all (got {self.moe_layers})")
                if not self.moe_router_topk <= self.core_num_experts:
                    raise ConfigError(
                        f"{prefix}.core_num_experts: must be >= moe_router_topk="
                        f"{self.moe_router_topk} (got {self.core_num_experts})"
                    )
            if self.moe_shared_expert_intermediate_size is not None:
                positive(f"{prefix}.moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
            nonnegative(f"{prefix}.moe_aux_loss_coeff", self.moe_aux_loss_coeff)
            if self.moe_z_loss_coeff is not None:
                nonnegative(f"{prefix}.moe_z_loss_coeff", self.moe_z_loss_coeff)
            choice(f"{prefix}.moe_router_score_function", self.moe_router_score_function, MOE_SCORE_FUNCTIONS)
            nonnegative(f"{prefix}.moe_router_bias_update_rate", self.moe_router_bias_update_rate)
            if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
                # megatron-core's TransformerConfig refuses it too: the bias is added to sigmoid scores
                raise ConfigError(
                    f"{prefix}.moe_router_enable_expert_bias: needs moe_router_score_function: "
                    f"sigmoid (megatron-core adds the expert bias to sigmoid scores only; got "
                    f"{self.moe_router_score_function})"
                )
        else:
            for key in ("core_num_experts", "moe_shared_expert_intermediate_size", "moe_z_loss_coeff"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"{prefix}.{key}: needs MoE layers (moe_layers is none)")
            if self.moe_router_enable_expert_bias:
                raise ConfigError(f"{prefix}.moe_router_enable_expert_bias: needs MoE layers (moe_layers is none)")

    def _validate_fp8(self, prefix: str) -> None:
        """FP8 needs TE on CUDA (and Blackwell for MXFP8); the block GEMMs it runs need rows in
        multiples of 16 (checked with the batch shape in :meth:`ExperimentConfig.validate`)."""
        from megatron_lol.platform import cuda_available, has_transformer_engine

        choice(f"{prefix}.fp8", self.fp8, ("e4m3", "hybrid"))
        if self.fp8_recipe is None:
            self.fp8_recipe = fp8_recipe_default(self.execution_plan(prefix))
        choice(f"{prefix}.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        choice(f"{prefix}.fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("most_recent", "max"))
        positive(f"{prefix}.fp8_amax_history_len", self.fp8_amax_history_len)
        nonnegative(f"{prefix}.fp8_margin", self.fp8_margin)
        if self.use_transformer_engine is False or not has_transformer_engine():
            why = (
                "disabled by use_transformer_engine: false"
                if self.use_transformer_engine is False
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
        plan = self.execution_plan(prefix)
        if self.fp8_recipe == "delayed" and runs_layers_repeatedly(plan):
            # TE's autocast: with reduce_amax a module must not run more than once per region, and every
            # rank must register the same modules in the same order for the amax all-reduce
            raise ConfigError(
                f"{prefix}.fp8_recipe: delayed scaling needs every FP8 layer to run once per forward "
                f"on every rank, but plan {plan.name} runs its blocks "
                f"{'where windows are routed' if plan.routed else 'several times'}; "
                f"use tensorwise (current scaling, the default for this plan)"
            )
        if plan.routed and self.moe_layers == "all":
            raise ConfigError(
                f"{prefix}.fp8: routed MoE blocks would route the zero rows that pad each block's "
                f"windows to FP8's row multiple to experts; use moe_layers: fixed or no fp8"
            )


@dataclass
class CurriculumConfig:
    """Growing depth and truncated backprop through depth (docs/model.md, "Growing depth")."""

    initial_depth: Optional[int] = None  # D0; None = no growing, full depth from step 0
    growth_fraction: float = 0.75  # growth period T = growth_fraction * train_iters
    backprop_depth: Optional[int] = None  # k: only the last k routed depths get gradients
    first_window_full_backprop: bool = True

    def validate(self, model: ModelConfig, prefix: str = "curriculum") -> None:
        if self.initial_depth is not None:
            if not 1 <= self.initial_depth <= model.core_depth:
                raise ConfigError(
                    f"{prefix}.initial_depth: must be in [1, {model.core_depth}] (got {self.initial_depth})"
                )
        if not 0 < self.growth_fraction <= 1:
            raise ConfigError(f"{prefix}.growth_fraction: must be in (0, 1] (got {self.growth_fraction})")
        if self.backprop_depth is not None:
            positive(f"{prefix}.backprop_depth", self.backprop_depth)
        plan = model.execution_plan()
        if not plan.growable and (self.initial_depth is not None or self.backprop_depth is not None):
            key = "initial_depth" if self.initial_depth is not None else "backprop_depth"
            raise ConfigError(f"{prefix}.{key}: plan {plan.name} sets its depth by the budget (model.loop_budgets)")


@dataclass
class ParallelConfig:
    """Parallel layout; data parallel size is the rest of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None  # None | full | selective
    # Megatron-LM's --recompute-method: full recomputation checkpoints every layer execution on its own,
    # which is its "uniform" method with one layer per group (the only one offered)
    recompute_method: Optional[str] = None
    # megatron-core DDP's overlap of the data-parallel gradient reduction with backward (Megatron-LM's
    # --overlap-grad-reduce); the core's buckets start when backward leaves the core (parallel/grad_ready.py)
    overlap_grad_reduce: bool = False

    def validate(self, model: ModelConfig, prefix: str = "parallel") -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            positive(f"{prefix}.{name}", getattr(self, name))
        tp = self.tensor_model_parallel_size
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"{prefix}.tensor_model_parallel_size: {tp} does not divide "
                f"model.num_attention_heads={model.num_attention_heads}"
            )
        plan = model.execution_plan()
        ep = self.expert_model_parallel_size
        if plan.shards_library and plan.num_stored_blocks % ep:
            raise ConfigError(
                f"{prefix}.expert_model_parallel_size: {ep} does not divide the {plan.num_stored_blocks} "
                f"stored blocks of plan {plan.name}"
            )
        if not plan.shards_library and model.moe_layers != "none":
            for key, n in (("num_experts", model.num_experts), ("core experts", plan.core_experts)):
                if n is not None and n % ep:
                    raise ConfigError(f"{prefix}.expert_model_parallel_size: {ep} does not divide model.{key}={n}")
        if plan.shards_library and model.moe_layers == "all" and ep > 1:
            # EP would shard the block library and every block's experts over the same ranks,
            # leaving some (block, expert) pairs on no rank
            raise ConfigError(
                f"{prefix}.expert_model_parallel_size: plan {plan.name} shards its block library "
                f"over EP={ep}; its blocks cannot also be MoE layers (moe_layers: all); use "
                f"moe_layers: fixed or expert_model_parallel_size: 1"
            )
        if model.moe_layers != "none" and tp > 1:
            # megatron-core refuses to train MoE layers under TP without SP
            if not self.sequence_parallel:
                raise ConfigError(
                    f"{prefix}.sequence_parallel: megatron-core MoE layers with "
                    f"tensor_model_parallel_size={tp} need sequence_parallel: true"
                )
            if model.moe_layers == "all" and plan.gathers_sequence:
                raise ConfigError(
                    f"{prefix}.tensor_model_parallel_size: MoE blocks in a core that gathers the "
                    f"sequence (routed or strided attention) cannot use TP={tp}; use "
                    f"expert_model_parallel_size instead"
                )
        if self.sequence_parallel and tp == 1:
            raise ConfigError(f"{prefix}.sequence_parallel: needs tensor_model_parallel_size > 1")
        if self.overlap_grad_reduce and self.pipeline_model_parallel_size > 1:
            raise ConfigError(
                f"{prefix}.overlap_grad_reduce: not with pipeline_model_parallel_size="
                f"{self.pipeline_model_parallel_size}: the library's copies on several stages are "
                f"summed before the data-parallel reduction (parallel/library_sync.py)"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"{prefix}.recompute_granularity: must be full or selective (got {self.recompute_granularity!r})"
            )
        if self.recompute_method is not None:
            if self.recompute_method == "block":
                raise ConfigError(
                    f"{prefix}.recompute_method: block is not offered: full recomputation "
                    f"checkpoints every layer execution on its own (uniform)"
                )
            choice(f"{prefix}.recompute_method", self.recompute_method, ("uniform",))
            if self.recompute_granularity != "full":
                raise ConfigError(
                    f"{prefix}.recompute_method: {self.recompute_method} needs "
                    f"recompute_granularity: full (got {self.recompute_granularity})"
                )

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by "
                f"tensor_model_parallel_size x pipeline_model_parallel_size = {model_parallel}"
            )
        dp = world_size // model_parallel
        if (dp * self.tensor_model_parallel_size) % self.expert_model_parallel_size:
            raise ConfigError(
                f"parallel.expert_model_parallel_size: {self.expert_model_parallel_size} does not "
                f"divide data_parallel x tensor_parallel = {dp * self.tensor_model_parallel_size}"
            )
        return dp


@dataclass
class DataConfig:
    """Where tokens come from (Megatron indexed datasets) and how to read them."""

    paths: list = field(default_factory=list)  # [prefix] or [w1, prefix1, w2, prefix2, ...]
    split: str = "98,1,1"
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    cache_dir: Optional[str] = None

    def tokenizer_on_hub(self) -> bool:
        """``tokenizer_model`` names a HuggingFace Hub repository (``tokenizer_type: HuggingFaceTokenizer``,
        ``namespace/name``, no such local path): read from the Hub cache when the tokenizer is built, so it is
        not a file that validation can check."""
        from megatron_lol.data.tokenizers import is_hub_name

        return self.tokenizer_type == "HuggingFaceTokenizer" and is_hub_name(self.tokenizer_model)

    def validate(self, prefix: str = "data", check_files: bool = True) -> None:
        import os

        if not self.paths:
            raise ConfigError(f"{prefix}.paths: no data path given (set data.paths or --data-path)")
        prefixes = self.paths[1::2] if len(self.paths) > 1 else self.paths
        if len(self.paths) > 1:
            if len(self.paths) % 2:
                raise ConfigError(f"{prefix}.paths: a blend needs weight/prefix pairs (got {len(self.paths)} items)")
            for w in self.paths[0::2]:
                try:
                    weight = float(w)
                except (TypeError, ValueError):
                    raise ConfigError(f"{prefix}.paths: weight {w!r} is not a number") from None
                if not math.isfinite(weight) or weight < 0:
                    raise ConfigError(f"{prefix}.paths: weight {w!r} must be a finite number >= 0")
            if sum(float(w) for w in self.paths[0::2]) <= 0:
                raise ConfigError(f"{prefix}.paths: the blend weights sum to zero")
        if check_files:
            from megatron_lol.data.indexed import IndexHeader

            for p in prefixes:
                for ext in (".bin", ".idx"):
                    if not os.path.exists(f"{p}{ext}"):
                        raise ConfigError(f"{prefix}.paths: {p}{ext} does not exist")
                try:  # the header only (34 bytes): an empty dataset stops here, not after the start-up
                    header = IndexHeader(f"{p}.idx")
                except (ValueError, OSError) as err:
                    raise ConfigError(f"{prefix}.paths: {err}") from None
                if header.sequence_count == 0 or header.document_count <= 1:
                    raise ConfigError(f"{prefix}.paths: {p}.idx holds no documents (an empty corpus?)")
            if self.tokenizer_model and not os.path.exists(self.tokenizer_model) and not self.tokenizer_on_hub():
                raise ConfigError(f"{prefix}.tokenizer_model: {self.tokenizer_model} does not exist")
        parts = self.split.replace("/", ",").split(",")
        try:
            vals = [float(x) for x in parts]
        except ValueError:
            raise ConfigError(f"{prefix}.split: {self.split!r} is not like '98,1,1'") from None
        if len(vals) != 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
            raise ConfigError(f"{prefix}.split: {self.split!r} is not like '98,1,1'")


OPTIMIZERS = ("adam", "muon")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_FP32_MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass
class OptimizerConfig:
    """The optimizer and the learning-rate schedule (megatron-core's ``OptimizerConfig`` names).

    ``name``: ``adam`` (AdamW everywhere) or ``muon`` (megatron-core's Muon for
    the attention/MLP matrices, AdamW for the rest; see
    :mod:`megatron_lol.training.optimizer`). The ``muon_*`` fields are read only
    with ``muon``; their defaults are megatron-core's. ``muon_adam_lr`` /
    ``muon_adam_min_lr``: the AdamW part's learning rates under Muon (default:
    ``lr`` / ``min_lr`` scaled alike).
    """

    name: str = "adam"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_decay_style: str = "cosine"  # cosine | WSD | linear | constant
    lr_warmup_iters: int = 0
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_style: str = "linear"
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True  # orthogonalise Q, K and V of a fused linear_qkv separately
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"  # spectral | unit_rms_norm | shape_scaling
    muon_fp32_matmul_prec: str = "medium"  # Newton-Schulz matmuls: medium = bf16
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"  # duplicated (layout-independent) | blockwise | distributed
    muon_extra_scale_factor: float = 1.0
    muon_adam_lr: Optional[float] = None
    muon_adam_min_lr: Optional[float] = None

    def validate(self, prefix: str = "optimizer") -> None:
        choice(f"{prefix}.name", self.name, OPTIMIZERS)
        positive(f"{prefix}.lr", self.lr)
        nonnegative(f"{prefix}.min_lr", self.min_lr)
        if self.min_lr > self.lr:
            raise ConfigError(f"{prefix}.min_lr: {self.min_lr} is above lr={self.lr}")
        nonnegative(f"{prefix}.weight_decay", self.weight_decay)
        nonnegative(f"{prefix}.clip_grad", self.clip_grad)
        nonnegative(f"{prefix}.lr_warmup_iters", self.lr_warmup_iters)
        choice(f"{prefix}.lr_decay_style", self.lr_decay_style, ("cosine", "WSD", "linear", "constant"))
        choice(
            f"{prefix}.lr_wsd_decay_style", self.lr_wsd_decay_style, ("linear", "cosine", "exponential", "minus_sqrt")
        )
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"{prefix}.adam_beta1/adam_beta2: must be in [0, 1)")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"{prefix}.muon_momentum: must be in [0, 1) (got {self.muon_momentum!r})")
        choice(f"{prefix}.muon_scale_mode", self.muon_scale_mode, MUON_SCALE_MODES)
        choice(f"{prefix}.muon_tp_mode", self.muon_tp_mode, MUON_TP_MODES)
        choice(f"{prefix}.muon_fp32_matmul_prec", self.muon_fp32_matmul_prec, MUON_FP32_MATMUL_PRECISIONS)
        if not isinstance(self.muon_num_ns_steps, int) or self.muon_num_ns_steps < 1:
            # megatron-core's TensorParallelMuon refuses fewer than one step
            raise ConfigError(f"{prefix}.muon_num_ns_steps: must be >= 1 (got {self.muon_num_ns_steps!r})")
        positive(f"{prefix}.muon_extra_scale_factor", self.muon_extra_scale_factor)
        if self.muon_adam_lr is not None:
            positive(f"{prefix}.muon_adam_lr", self.muon_adam_lr)
        if self.muon_adam_min_lr is not None:
            nonnegative(f"{prefix}.muon_adam_min_lr", self.muon_adam_min_lr)
            peak = self.lr if self.muon_adam_lr is None else self.muon_adam_lr
            if self.muon_adam_min_lr > peak:
                raise ConfigError(
                    f"{prefix}.muon_adam_min_lr: {self.muon_adam_min_lr} is above the AdamW peak learning rate {peak}"
                )


@dataclass
class TrainingConfig:
    """Loop, batch sizes, checkpoints and logging (Megatron-LM names)."""

    # optimizer steps; default 100 when neither this nor train_flops is given
    train_iters: Optional[int] = None
    # a training budget in FLOPs (e.g. 9.0e19) instead of train_iters: the trainer derives the iterations from
    # the FLOP model, growing depth included (perf/budget.py), and logs them; needs global_batch_size
    train_flops: Optional[float] = None
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default: micro_batch_size x data parallel size
    seq_length: int = 256
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 10
    eval_at_start: bool = False  # also evaluate the initial model (step 0), e.g. for a learning curve
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    keep_last: Optional[int] = None
    async_save: bool = False
    resume: bool = True
    exit_duration_in_mins: Optional[float] = None
    skip_nonfinite_steps: int = 0  # how many NaN/Inf steps may be skipped before stopping
    # stage changes (e.g. context extension) loading ``load`` when ``save`` has no checkpoint yet:
    load_iteration: Optional[int] = None  # which iteration of ``load`` (default: its tracker's)
    reset_optimizer: bool = False  # fresh optimizer state (Adam moments) instead of the loaded one
    reset_schedule: bool = False  # iteration, LR schedule and data position restart at 0
    metrics_file: Optional[str] = None  # default: <save>/metrics.jsonl
    # metric sinks beside metrics.jsonl (Megatron-LM's flags; megatron_lol/training/console.py)
    tensorboard_dir: Optional[str] = None  # TensorBoard event files go here
    tensorboard_log_interval: int = 1  # iterations between TensorBoard / W&B points
    wandb_project: Optional[str] = None  # W&B logging on when set (WANDB_MODE=offline: no network)
    wandb_exp_name: Optional[str] = None  # the W&B run name
    wandb_save_dir: Optional[str] = None  # default: <save>/wandb, else ./wandb
    verify_checksums: bool = True  # check checkpoint files against their checksums.json on load
    exit_interval: Optional[int] = None  # save and stop (status 0) at the first iteration divisible by it
    # on resume, a learning-rate / growth schedule that differs from the checkpoint's stops the run
    # unless one of these says which wins (Megatron-LM's flags)
    override_opt_param_scheduler: bool = False  # this run's schedule
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint's schedule
    # Megatron-LM's --profile: iterations [profile_step_start, profile_step_end) (0-based) of the
    # ranks in profile_ranks; torch.profiler trace with use_pytorch_profiler (or without CUDA),
    # else an nsys capture range; NVTX ranges on CUDA (megatron_lol/training/tracing.py)
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    profile_dir: Optional[str] = None  # default: tensorboard_dir, else <save>/profile, else ./profile
    # compare the routing decisions across the tensor-parallel group every N iterations, before each routed
    # depth's blocks run (parallel/routing_agreement.py); None: every log_interval; 0: never
    check_routing_agreement: Optional[int] = None
    # Megatron-LM's --distributed-timeout-minutes: how long a collective waits for a rank that stopped
    # answering before the job stops (torch's own default is also 10 minutes; rank 0's dataset build
    # and a first save run under it, so a cluster with a slow file system raises it)
    distributed_timeout_minutes: int = 10
    # a rank that stops answering (SIGSTOP, a hung mount) ends the job after heartbeat_timeout seconds
    # (default: distributed_timeout_minutes), named in one line on every rank (training/heartbeat.py);
    # each rank beats every heartbeat_interval seconds through the rendezvous store (0: no heartbeat)
    heartbeat_interval: float = 5.0
    heartbeat_timeout: Optional[float] = None
    # a save that failed on any rank (disk full, an I/O error): stop with status 2, or continue training to the
    # next save; either way no rank moves the tracker and the previous checkpoint stays the latest
    on_save_failure: str = "stop"

    def validate(self, prefix: str = "training") -> None:
        if self.train_flops is not None:
            # one budget, as Megatron-LM takes --train-iters or --train-samples but not both: a run cannot be
            # held to a step count and a FLOP count at once
            positive(f"{prefix}.train_flops", self.train_flops)
            if self.train_iters is not None:
                raise ConfigError(
                    f"{prefix}.train_iters: {self.train_iters} cannot be combined with "
                    f"{prefix}.train_flops={self.train_flops:g} (the iterations are derived from "
                    f"the FLOP budget); drop one, e.g. --set {prefix}.train_flops=null"
                )
            if self.global_batch_size is None:
                raise ConfigError(
                    f"{prefix}.train_flops: needs {prefix}.global_batch_size (the iterations a "
                    f"FLOP budget buys would otherwise depend on the data-parallel size)"
                )
        elif self.train_iters is None:
            self.train_iters = 100
        if self.train_iters is not None:
            positive(f"{prefix}.train_iters", self.train_iters)
        positive(f"{prefix}.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            positive(f"{prefix}.global_batch_size", self.global_batch_size)
            if self.global_batch_size % self.micro_batch_size:
                raise ConfigError(
                    f"{prefix}.global_batch_size: {self.global_batch_size} is not a multiple of "
                    f"micro_batch_size={self.micro_batch_size}"
                )
        positive(f"{prefix}.seq_length", self.seq_length)
        positive(f"{prefix}.log_interval", self.log_interval)
        positive(f"{prefix}.tensorboard_log_interval", self.tensorboard_log_interval)
        positive(f"{prefix}.eval_interval", self.eval_interval)
        nonnegative(f"{prefix}.eval_iters", self.eval_iters)
        if self.save_interval is not None:
            positive(f"{prefix}.save_interval", self.save_interval)
        if self.keep_last is not None:
            positive(f"{prefix}.keep_last", self.keep_last)
        nonnegative(f"{prefix}.skip_nonfinite_steps", self.skip_nonfinite_steps)
        if self.load_iteration is not None:
            nonnegative(f"{prefix}.load_iteration", self.load_iteration)
        if self.exit_interval is not None:
            positive(f"{prefix}.exit_interval", self.exit_interval)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                f"{prefix}.override_opt_param_scheduler: cannot be combined with "
                f"use_checkpoint_opt_param_scheduler (pick which schedule wins)"
            )
        nonnegative(f"{prefix}.profile_step_start", self.profile_step_start)
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"{prefix}.profile_step_end: {self.profile_step_end} must be larger than "
                f"profile_step_start={self.profile_step_start}"
            )
        if not self.profile_ranks or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.profile_ranks
        ):
            raise ConfigError(f"{prefix}.profile_ranks: must be a list of ranks >= 0 (got {self.profile_ranks!r})")
        if self.check_routing_agreement is not None:
            nonnegative(f"{prefix}.check_routing_agreement", self.check_routing_agreement)
        positive(f"{prefix}.distributed_timeout_minutes", self.distributed_timeout_minutes)
        nonnegative(f"{prefix}.heartbeat_interval", self.heartbeat_interval)
        if self.heartbeat_timeout is not None:
            positive(f"{prefix}.heartbeat_timeout", self.heartbeat_timeout)
        if self.heartbeat_interval and self.stall_timeout_seconds < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"{prefix}.heartbeat_timeout: {self.stall_timeout_seconds:g} s must be at least twice "
                f"heartbeat_interval={self.heartbeat_interval:g} s (a rank misses beats while busy)"
            )
        choice(f"{prefix}.on_save_failure", self.on_save_failure, ("stop", "continue"))

    @property
    def stall_timeout_seconds(self) -> float:
        """Seconds without a rank's heartbeat before the job stops (heartbeat_timeout, else the
        collective timeout)."""
        return self.heartbeat_timeout if self.heartbeat_timeout is not None else 60.0 * self.distributed_timeout_minutes

    @property
    def routing_agreement_interval(self) -> int:
        """Iterations between routing-agreement checks (0: none)."""
        return self.log_interval if self.check_routing_agreement is None else self.check_routing_agreement


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def validate(self, check_data: bool = True) -> "ExperimentConfig":
        self.model.validate()
        self.curriculum.validate(self.model)
        self.parallel.validate(self.model)
        par, plan = self.parallel, self.model.execution_plan()
        check_pipeline_layout(
            self.model,
            plan.depth,
            par.pipeline_model_parallel_size,
            par.virtual_pipeline_model_parallel_size,
            plan.name,
            plan.pipeline_ok,
        )
        self.optimizer.validate()
        self.training.validate()
        m = self.model
        windowed = any(step.attention != "full" for step in plan.steps())  # window, strided or sliding
        if windowed and m.window_size > self.training.seq_length:
            raise ConfigError(
                f"model.window_size: {m.window_size} is larger than training.seq_length="
                f"{self.training.seq_length} (a window must fit in a sequence)"
            )
        # a warm-up longer than the run is allowed (a smoke run of a long config): the run ends inside
        # it, and the trainer says so (training/optimizer.py, build_scheduler)
        tr = self.training
        multiple = fp8_row_multiple(self.model.fp8_recipe)
        if self.model.fp8 is not None and (tr.micro_batch_size * tr.seq_length) % multiple:
            raise ConfigError(
                f"training.seq_length: FP8 GEMMs ({self.model.fp8_recipe}) need micro_batch_size x "
                f"seq_length = {tr.micro_batch_size * tr.seq_length} tokens in multiples of {multiple}"
            )
        if check_data:
            self.data.validate()
        return self

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out


def typing_hints(cls) -> dict:
    import typing

    return typing.get_type_hints(cls)


def deprecated_flat_keys(model: dict) -> list:
    """``(flat key, kind, section key)`` of the current kind's options written at the top of a raw
    ``model`` mapping (keys of other kinds are the older spelling or a mistake: the plan judges them)."""
    plan = model.get("plan", "lol")
    cls = PLANS.get(plan.get("kind") if isinstance(plan, dict) else plan)
    if cls is None:
        return []
    own = {flat: key for key, flat in flat_keys(cls).items()}
    return [(key, cls.name, own[key]) for key in model if key in own]


def warn_flat_plan_keys(model: dict, source: str) -> None:
    """The deprecation warning for plan options written at the top of ``model``."""
    for key, kind, section_key in deprecated_flat_keys(model):
        warnings.warn(
            f"config: {source}: model.{key} is deprecated; write it in the plan's section "
            f"(model.plan: {{kind: {kind}, {section_key}: ...}})",
            ConfigDeprecationWarning,
            stacklevel=3,
        )


def bias_updates_allowed(step: int, train_iters: int, stop_fraction: float) -> bool:
    """The bias update after 0-based step ``t`` happens iff ``t < f * train_iters`` (docs/model.md,
    "Load balancing").

    Compared in exact rational arithmetic so that e.g. ``f = 0.966`` is the
    decimal the user wrote, not its binary approximation.
    """
    return Fraction(step) < Fraction(str(stop_fraction)) * train_iters
