"""The ``model`` section: what the network computes (:class:`ModelConfig`), with its validation.

The plan kind's options live in its section (``model.plan: {kind: ..., ...}``,
:mod:`megatron_lol.plan`); the rest of the model (sizes, windows, router,
balancing, FiLM, injection, MoE, precision) is here. :mod:`.schema` holds the
other sections of a run and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_lol.config.checks import asdict, choice, nonnegative, positive
from megatron_lol.config.migration import FLAT_KEYS, MOVED_KEYS, migrate_model
from megatron_lol.config.sections import (  # noqa: F401 - re-exported
    FP8_RECIPES,
    MOE_SCORE_FUNCTIONS,
    PARAMS_DTYPES,
    MoEConfig,
    PrecisionConfig,
    fp8_row_multiple,
    resolve_params_dtype,
)
from megatron_lol.errors import ConfigError
from megatron_lol.plan import ExecutionPlan, build_plan, plan_kind
from megatron_lol.plan.execution import DENSE_ATTENTION, plan_section, section_dict

BALANCING = ("loss_free", "aux_loss", "none")
FILM_MODES = ("off", "depth", "depth_block")
ROUTED_CORES = ("auto", "reference", "grouped")
ROUTER_INPUTS = ("windows", "depth")


def runs_layers_repeatedly(plan: ExecutionPlan) -> bool:
    """Whether a forward may call one layer more than once, or a layer on some ranks only: routed plans
    (a block runs at every depth that routes windows to it) and plans whose steps reuse a block."""
    blocks = [step.block for step in plan.steps()]
    return plan.routed or len(set(blocks)) < len(blocks)


def fp8_recipe_default(plan: ExecutionPlan) -> str:
    """Megatron-LM's ``delayed`` where every layer runs once per forward; current (``tensorwise``)
    scaling for plans that run layers repeatedly or data-dependently (delayed scaling is refused there)."""
    return "tensorwise" if runs_layers_repeatedly(plan) else "delayed"


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

    A bare kind name (``plan: lol``) takes the kind's defaults. Once read, ``plan`` is the
    section object (:func:`megatron_lol.plan.execution.plan_section`): ``plan.kind`` and the
    kind's options as attributes (``plan.window``), the only place they are kept.
    ``to_dict`` writes the section; earlier spellings (the options as flat ``model`` keys,
    ``num_blocks`` / ``routed_depth`` for every kind) are rewritten by
    :mod:`megatron_lol.config.migration`.
    """

    plan: Any = "lol"  # the kind's section object once read; a name or {kind: ..., ...} as written
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # default: SwiGLU 8/3 * h rounded up to 64
    kv_channels: Optional[int] = None
    n_prelude: int = 1
    n_coda: int = 1
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
    # how a LoL core's routed depths run their blocks, chosen when the model is built (docs/gpu.md, "The routed
    # depth on a GPU"; routing is the same either way): "reference" = one call per block (model/executors.py
    # PerBlockCalls); "grouped" = all blocks of a depth as one grouped computation (GroupedGEMMs); "auto" =
    # grouped on CUDA where the model supports it, per block elsewhere (on CPU, with the CPU backend, faster)
    routed_core: str = "auto"
    # FFN mixtures of experts (megatron-core MoE) in the fixed layers and/or blocks (config/sections.py)
    moe: MoEConfig = field(default_factory=MoEConfig)
    # the weights' dtype, the layer implementation (TE or local) and FP8 (config/sections.py)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def __post_init__(self) -> None:
        self.normalize()

    def normalize(self) -> "ModelConfig":
        """Read ``plan`` (a kind's name or a section mapping) into the kind's section object; idempotent,
        so it also runs after ``--set`` overrides; ``moe`` / ``precision`` given as mappings become
        their sections."""
        for name, cls in (("moe", MoEConfig), ("precision", PrecisionConfig)):
            value = getattr(self, name)
            if isinstance(value, dict) or value is None:
                from megatron_lol.config.loader import build_dataclass

                object.__setattr__(self, name, build_dataclass(cls, value or {}, f"model.{name}", f"model.{name}."))
        if isinstance(self.plan, str):
            self.plan = plan_section(self.plan)
        elif isinstance(self.plan, dict):
            self.read_plan_section(self.plan)
        elif not hasattr(self.plan, "kind"):
            raise ConfigError(f"model.plan: must be a kind's name or a section {{kind: ..., ...}} (got {self.plan!r})")
        return self

    # ------------------------------------------------------------- plan section
    def read_plan_section(self, section: dict, source: str = "model.plan") -> None:
        """Take ``plan: {kind: NAME, key: value, ...}``: the kind, then each key as its option (the
        section is the whole plan: options it leaves out take the kind's defaults)."""
        if "kind" not in section:
            from megatron_lol.plan import PLANS

            raise ConfigError(f"{source}: a plan section needs kind: one of {', '.join(PLANS)}")
        cls = plan_kind(section["kind"], "model")
        values = {key: self._option_value(cls, key, value, source) for key, value in section.items() if key != "kind"}
        self.plan = plan_section(cls.name, values)

    def set_plan_option(self, key: str, value: Any, source: str = "model.plan") -> None:
        """Set option ``key`` of the current plan kind (``--set model.plan.KEY=VALUE``)."""
        self.normalize()
        cls = plan_kind(self.plan.kind, "model")
        self.plan = dataclasses.replace(self.plan, **{key: self._option_value(cls, key, value, source)})

    @staticmethod
    def _option_value(cls, key: str, value: Any, source: str) -> Any:
        """``value`` coerced to option ``key``'s type of kind ``cls``; did-you-mean over its options."""
        from megatron_lol.config.loader import coerce_value

        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        if key not in fields:
            known = ", ".join(fields) or "none"
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"{source}: model.plan.{key} is not an option of plan {cls.name}{hint} (its options: {known})"
            )
        return coerce_value(typing_hints(cls.Options)[key], value, source, f"model.plan.{key}")

    def to_dict(self) -> dict:
        """Plain data with the plan as its tagged section: what run_config.yaml holds."""
        self.normalize()
        out = asdict(self)
        out["plan"] = section_dict(self.plan)
        return out

    def execution_plan(self, prefix: str = "model") -> ExecutionPlan:
        """The plan's steps for this config (one-line ConfigError on bad shape keys)."""
        if not hasattr(self.plan, "kind"):  # a name or a mapping assigned since the last read
            self.normalize()
        return build_plan(self, prefix)

    @property
    def core_depth(self) -> int:
        """Steps of the full core (Accordion: at its largest budget)."""
        return self.execution_plan().depth

    def uses_transformer_engine(self) -> bool:
        """The layer spec: ``precision.transformer_engine``, or (unset) whether TE imports with CUDA."""
        return self.precision.uses_transformer_engine()

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
            raise ConfigError(
                f"{prefix}.router_only_tokens: only a routed plan has a window router (plan {self.plan.kind})"
            )
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
        choice(f"{prefix}.balancing", self.balancing, BALANCING)
        choice(f"{prefix}.film", self.film, FILM_MODES)
        choice(f"{prefix}.router_input", self.router_input, ROUTER_INPUTS)
        self._validate_router_only(prefix)
        choice(f"{prefix}.routed_core", self.routed_core, ROUTED_CORES)
        choice(f"{prefix}.dense_attention", self.dense_attention, DENSE_ATTENTION)
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
        self.moe.validate(f"{prefix}.moe")
        self.precision.validate(self, f"{prefix}.precision")


def typing_hints(cls) -> dict:
    import typing

    return typing.get_type_hints(cls)


_dataclass_init = ModelConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs) -> None:
    """The dataclass's ``__init__``, taking the deprecated flat keys too (``ModelConfig(<flat key>=...)``,
    ``dataclasses.replace(model, ...)``): rewritten into the plan's section and the ``moe`` /
    ``precision`` sub-sections by the migration tables."""
    flat = {key: kwargs.pop(key) for key in list(kwargs) if key in FLAT_KEYS or key in MOVED_KEYS}
    if flat:
        plan = kwargs.get("plan", "lol")
        raw = {"plan": plan, **{k: kwargs[k] for k in ("moe", "precision") if kwargs.get(k) is not None}, **flat}
        moved = migrate_model(raw, "ModelConfig", override=not isinstance(plan, (str, dict)))
        kwargs["plan"] = moved["plan"]
        kwargs.update({k: moved[k] for k in ("moe", "precision") if k in moved})
    _dataclass_init(self, *args, **kwargs)


def _setattr(self, name: str, value: Any) -> None:
    """A deprecated flat key is refused, not stored beside the section where nothing reads it."""
    if name in FLAT_KEYS:
        raise AttributeError(f"ModelConfig.{name}: a plan option; it lives in model.plan.{FLAT_KEYS[name][1]}")
    if name in MOVED_KEYS:
        section, key = MOVED_KEYS[name]
        raise AttributeError(f"ModelConfig.{name}: it lives in model.{section}.{key}")
    object.__setattr__(self, name, value)


ModelConfig.__init__ = _init
ModelConfig.__setattr__ = _setattr
