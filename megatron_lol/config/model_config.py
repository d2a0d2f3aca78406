"""The ``model`` section: what the network computes (:class:`ModelConfig`), with its validation.

The plan kind's options live in its section (``model.plan: {kind: ..., ...}``,
:mod:`megatron_lol.plan`; the router and its balancing are its ``routing``
sub-section, :mod:`megatron_lol.plan.routing`; the windows its ``windows``
sub-section, :mod:`megatron_lol.plan.windows`); MoE and precision are the
``model.moe`` / ``model.precision`` sub-sections (:mod:`.sections`); what every
kind shares (sizes, embeddings, rotary) is here. :mod:`.schema` holds the
other sections of a run and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_lol.checks import asdict, nonnegative, positive
from megatron_lol.config.migration import (
    FLAT_KEYS,
    MOVED_KEYS,
    OPTION_KEYS,
    ROUTING_KEYS,
    RUNTIME_KEYS,
    migrate_model,
    refuse_runtime_key,
)
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
from megatron_lol.plan.execution import plan_section, section_dict
from megatron_lol.plan.pass_parts import FILM_MODES  # noqa: F401 - re-exported
from megatron_lol.plan.routing import BALANCING, ROUTER_INPUTS, RoutingOptions  # noqa: F401 - re-exported
from megatron_lol.plan.windows import FIXED_ATTENTION, WindowOptions  # noqa: F401 - re-exported


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
      routed depths, windows of ``windows.size`` (W) tokens shifted by ``windows.shift`` (S);
    * ``dense``: ``layers`` distinct layers in order;
    * ``looped``: ``layers`` layers looped ``loops`` times (Huginn);
    * ``foil``: a looped block of ``layers`` MoE layers with ``experts`` experts,
      looped ``loops`` times, attention untied per pass;
    * ``accordion``: the ``window`` layers once, then the first ``k`` again
      (``budgets``; ``k = 0`` is the unlooped model).

    A bare kind name (``plan: lol``) takes the kind's defaults. Once read, ``plan`` is the
    section object (:func:`megatron_lol.plan.execution.plan_section`): ``plan.kind`` and the
    kind's options as attributes (``plan.window``), the only place they are kept.

    The sections, drawn by what a reader asks of each (docs/model.md, "Execution plans"):

    * ``plan``: what the kind executes; a kind whose router picks blocks per window has the
      ``routing`` sub-section (``plan.routing.balancing``), one definition
      (:class:`~megatron_lol.plan.routing.RoutingOptions`) that every routed kind includes; the
      window geometry is the ``windows`` sub-section (``plan.windows.size`` W, ``.shift`` S), of lol
      and of the fixed kinds whose ``plan.attention`` may be ``sliding`` / ``strided`` (dense,
      looped, foil); ``plan.film`` and ``plan.input_injection`` are options of lol, dense, looped
      and foil (one definition, :class:`~megatron_lol.plan.pass_parts.PassParts`); accordion has
      none of them. Code that runs for every kind reads them with ``windows_of(model)`` /
      ``pass_parts_of(model)`` (the defaults for a kind without them);
    * the fields below: what every kind shares (sizes, embeddings, rotary, initialisation);
    * ``moe`` and ``precision``: settings of their own (:mod:`.sections`), typed, checked with
      their keys' full paths.

    How the model runs rather than what it computes is not here: the routed depths' executor is
    ``parallel.routed_core``, beside recomputation (:class:`~megatron_lol.config.schema.ParallelConfig`).

    ``to_dict`` writes the sections; earlier spellings (the options, router, MoE and precision
    keys as flat ``model`` keys; ``num_blocks`` / ``routed_depth`` for every kind) are rewritten by
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
    vocab_size: Optional[int] = None  # default: the tokenizer's, padded
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = True
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 1.0  # linear position interpolation for context extension
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
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

    def set_plan_option(self, key: str, value: Any, source: str = "model.plan", sub: Optional[str] = None) -> None:
        """Set option ``key`` of the current plan kind (``--set model.plan.KEY=VALUE``), or ``sub``'s
        key ``key`` of its sub-section option ``sub`` (``--set model.plan.routing.balancing=none``)."""
        self.normalize()
        cls = plan_kind(self.plan.kind, "model")
        if sub is not None:
            section = getattr(self.plan, self._option_name(cls, sub, source))
            if not dataclasses.is_dataclass(section):
                raise ConfigError(f"{source}: model.plan.{sub} is an option of plan {cls.name}, not a section")
            key_of = f"model.plan.{sub}."
            from megatron_lol.config.loader import build_dataclass

            updated = build_dataclass(type(section), {**asdict(section), key: value}, source, key_of)
            self.plan = dataclasses.replace(self.plan, **{sub: updated})
            return
        self.plan = dataclasses.replace(self.plan, **{key: self._option_value(cls, key, value, source)})

    @staticmethod
    def _option_name(cls, key: str, source: str) -> str:
        """``key`` if it is an option of kind ``cls``, else a one-line ConfigError with a did-you-mean."""
        fields = [f.name for f in dataclasses.fields(cls.Options)]
        if key not in fields:
            known = ", ".join(fields) or "none"
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"{source}: model.plan.{key} is not an option of plan {cls.name}{hint} (its options: {known})"
            )
        return key

    @staticmethod
    def _option_value(cls, key: str, value: Any, source: str) -> Any:
        """``value`` coerced to option ``key``'s type of kind ``cls``; did-you-mean over its options."""
        from megatron_lol.config.loader import coerce_value

        ModelConfig._option_name(cls, key, source)
        hint = typing_hints(cls.Options)[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):  # a sub-section already read
            return value
        return coerce_value(hint, value, source, f"model.plan.{key}")

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

    def validate(self, prefix: str = "model") -> None:
        self.normalize()
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
        self.execution_plan(prefix)  # the plan's own shape keys and options
        if self.vocab_size is not None:
            positive(f"{prefix}.vocab_size", self.vocab_size)
        positive(f"{prefix}.make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        positive(f"{prefix}.rotary_base", self.rotary_base)
        positive(f"{prefix}.rotary_scaling_factor", self.rotary_scaling_factor)
        positive(f"{prefix}.init_method_std", self.init_method_std)
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
    for key in RUNTIME_KEYS.keys() & kwargs.keys():
        refuse_runtime_key(key, "ModelConfig")
    flat = {
        key: kwargs.pop(key)
        for key in list(kwargs)
        if key in FLAT_KEYS or key in MOVED_KEYS or key in ROUTING_KEYS or key in OPTION_KEYS
    }
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
    if name in ROUTING_KEYS:
        raise AttributeError(f"ModelConfig.{name}: a router option; it lives in model.plan.routing.{name}")
    if name in OPTION_KEYS:
        raise AttributeError(
            f"ModelConfig.{name}: an option of the plan kinds that use it; "
            f"it lives in model.plan.{OPTION_KEYS[name][0]}"
        )
    if name in RUNTIME_KEYS:
        section, key = RUNTIME_KEYS[name]
        raise AttributeError(f"ModelConfig.{name}: how the model runs; it lives in {section}.{key}")
    if name in MOVED_KEYS:
        section, key = MOVED_KEYS[name]
        raise AttributeError(f"ModelConfig.{name}: it lives in model.{section}.{key}")
    object.__setattr__(self, name, value)


ModelConfig.__init__ = _init
ModelConfig.__setattr__ = _setattr
