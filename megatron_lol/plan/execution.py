"""Execution plans: which stored block runs at each step of the core, on which tokens.

Every model this stack trains is a set of stored blocks and a plan (see
docs/model.md, "Execution plans"):

==========  ==================================================================
plan        steps of the core
==========  ==================================================================
dense       step ``i`` runs block ``i`` on every token
looped      steps cycle ``loops`` times through ``layers`` blocks
foil        looped over a block of MoE layers, shape ``(E, D, L)`` =
            (``experts``, ``layers``, ``loops``); attention untied per
            (layer, pass) unless ``untie_attention: false``
lol         each window, at each of ``routed_depth`` depths, runs the block of
            ``num_blocks`` that its router chose
accordion   the ``window`` layers once, then the first ``k`` of them
            again, ``k`` the loop budget
==========  ==================================================================

A forward runs a *prefix* of the plan's steps: the growing-depth curriculum
shortens it in training, Accordion's budget ``k`` sets it to ``window +
k``. Everything that needs the schedule (the core, parameter counts, the FLOP
and memory model, the trainer, the HF export, analyses) reads it from here;
a new variant is one module: an :class:`ExecutionPlan` subclass with its
config section (:attr:`ExecutionPlan.Options`), registered with
:func:`register_plan` (the built-in kinds live in :mod:`megatron_lol.plan.kinds`).

A config names its plan as a tagged section, ``model.plan: {kind: foil,
experts: 8, layers: 8, loops: 2}``: ``kind`` picks the class, the other keys
are the fields of its ``Options``. Read, the section is ``ModelConfig.plan``:
an instance of the kind's ``Options`` that also carries ``kind``
(:func:`plan_section`), the one place the kind's options live.

This module is pure Python (no torch): the config validates against it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from megatron_lol.errors import ConfigError


@dataclass(frozen=True)
class Step:
    """One block execution of the core.

    ``depth``: 1-based position in the core (the routed depth ``l`` of a LoL
    model; window offsets are computed from it). ``block``: the stored block
    that runs, or None when a router picks it per window. ``pass_index``: how
    many earlier steps ran the same block. ``attention``: ``window`` (the
    shifted windows of this depth, routed plans), ``full`` / ``sliding``
    (causal inside the document, optionally the last ``plan.windows.size`` tokens),
    ``strided`` (the windows of this depth, a fixed block).
    ``untied_attention``: run the pass's own input norm and attention (Foil).
    ``separate_router``: the pass's own MoE router. ``parts``: the names of the
    per-pass parts the step applies besides the model-wide ones (e.g.
    ``loop_gates``, Accordion's second pass; registered parts,
    ``megatron_lol/convert/hf_modeling/parts_lol.py``).
    """

    depth: int
    block: Optional[int]
    pass_index: int = 0
    attention: str = "full"
    untied_attention: bool = False
    separate_router: bool = False
    parts: tuple = ()

    @property
    def routed(self) -> bool:
        return self.block is None

    @property
    def gated(self) -> bool:
        """Whether the step scales its two residual writes by the block's loop gates."""
        return "loop_gates" in self.parts

    @property
    def windowed(self) -> bool:
        """Whether the step's attention (and routing) use the shifted windows of its depth."""
        return self.attention in ("window", "strided")

    def to_dict(self) -> dict:
        return {
            "depth": self.depth,
            "block": self.block,
            "pass": self.pass_index,
            "attention": self.attention,
            "untied_attention": self.untied_attention,
            "separate_router": self.separate_router,
            "parts": list(self.parts),
        }


def option(default: Any = None, *, help: str = "") -> Any:
    """A field of a plan kind's ``Options`` (its config section); ``help``: what the key means, for
    the reader of the kind's module."""
    if isinstance(default, list):
        value = list(default)
        return dataclasses.field(default_factory=lambda: list(value), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NoOptions:
    """The config section of a plan kind without keys of its own."""


class ExecutionPlan:
    """The ordered steps of the core for one model config; subclasses are the plan kinds.

    A kind defines ``name`` (its ``kind:`` tag), ``Options`` (a dataclass: its config section,
    fields made with :func:`option`), :meth:`_stored_blocks`, :meth:`_build_steps` and
    :meth:`describe`; the capability properties below (``routed``, ``has_budgets``,
    ``shards_library``, ...) follow from its steps unless it says otherwise.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: whether the plan's depth may grow during training (``curriculum.initial_depth``)
    growable: ClassVar[bool] = True
    #: whether pipeline parallelism can cut this plan's core
    pipeline_ok: ClassVar[bool] = True

    def __init__(self, model, prefix: str = "model"):
        self.model = model
        self.prefix = prefix
        self.options = model.plan
        self._validate_shared_options()
        self.num_stored_blocks = self._stored_blocks()
        self._steps = tuple(self._build_steps())

    # -------------------------------------------------------------- interface
    def _stored_blocks(self) -> int:
        raise NotImplementedError

    def _build_steps(self) -> list:
        raise NotImplementedError

    def describe(self) -> str:
        """The shape in the plan's own symbols (for ``params`` and logs)."""
        raise NotImplementedError

    # ------------------------------------------------------------ properties
    @property
    def routed(self) -> bool:
        """Whether a router picks blocks per window (LoL)."""
        return any(step.routed for step in self._steps)

    @property
    def routes(self) -> bool:
        """Whether a router picks blocks per window (the same as :attr:`routed`)."""
        return self.routed

    @property
    def depth(self) -> int:
        """Steps of the full core (Accordion: at its largest budget)."""
        return len(self._steps)

    @property
    def shards_library(self) -> bool:
        """Whether expert parallelism shards the stored blocks (a routed library runs each
        block on its windows only; fixed plans run every block on every token)."""
        return self.routed

    @property
    def gathers_sequence(self) -> bool:
        """Whether the core needs the whole sequence on every tensor-parallel rank under SP:
        routers read window means over the sequence and windows pack across rows."""
        return any(step.windowed for step in self._steps)

    @property
    def loop_passes(self) -> int:
        """How often the most-used stored block runs."""
        return 1 + max(step.pass_index for step in self._steps)

    @property
    def reruns_blocks(self) -> bool:
        """Whether a stored block can run more than once in one forward pass: a second pass of a
        loop, or a router that may pick the same block at two of its depths. Such a block's weight
        gradient is the sum of its calls', which Transformer Engine keeps only when its layers are
        not told about a first micro-batch (library.core_config; docs/gpu.md)."""
        return self.loop_passes > 1 or sum(1 for step in self._steps if step.routed) > 1

    @property
    def core_experts(self) -> Optional[int]:
        """Experts per MoE layer of the core's blocks (None: dense MLPs)."""
        m = self.model
        if m.moe.layers != "all":
            return None
        return m.moe.core_num_experts or m.moe.num_experts

    def untied_attention_sets(self) -> list:
        """``(block, pass)`` of every pass that runs its own attention."""
        return sorted({(s.block, s.pass_index) for s in self._steps if s.untied_attention})

    def separate_router_blocks(self) -> list:
        return sorted({s.block for s in self._steps if s.separate_router})

    def gated_blocks(self) -> list:
        return sorted({s.block for s in self._steps if s.gated})

    def step_part_names(self) -> list:
        """The parts the plan's steps name (model-wide parts aside), in first use order."""
        return list(dict.fromkeys(name for s in self._steps for name in s.parts))

    # ---------------------------------------------------------------- steps
    def steps(self, depth: Optional[int] = None) -> tuple:
        """The steps a forward runs: the first ``depth`` (default: all)."""
        if depth is None:
            return self._steps
        if not 0 <= depth <= len(self._steps):
            raise ValueError(f"depth {depth} is outside [0, {len(self._steps)}] for plan {self.name}")
        return self._steps[:depth]

    def step(self, depth: int) -> Step:
        return self._steps[depth - 1]

    # --------------------------------------------------------------- budgets
    @property
    def budgets(self) -> list:
        """Accordion's loop budgets; ``[None]`` for plans without one."""
        return [None]

    @property
    def has_budgets(self) -> bool:
        """Whether the depth of a call depends on a loop budget (Accordion): exports, FLOP and parameter
        counts and evaluation then report per budget."""
        return False

    def resolve_budget(self, budget: Optional[int]) -> Optional[int]:
        """The budget a call runs with (plans without budgets: None; a given one is refused)."""
        if budget is not None:
            raise ConfigError(f"budget: only plan accordion has a loop budget (this model's plan is {self.name})")
        return None

    def depth_for(self, budget: Optional[int] = None) -> int:
        """Core steps at ``budget`` (the full depth for plans without budgets)."""
        self.resolve_budget(budget)
        return self.depth

    def eval_budgets(self) -> list:
        """The budgets evaluation reports separately: ``[None]`` unless the plan has budgets."""
        return [None]

    def sample_budget(self, seed: int, iteration: int, microbatch: int) -> Optional[int]:
        """The budget of one training micro-batch (None for plans without budgets)."""
        return None

    # ----------------------------------------------------------- serialising
    def to_dict(self) -> dict:
        """The schedule as plain data (written into exported ``config.json``)."""
        out = {
            "name": self.name,
            "num_stored_blocks": self.num_stored_blocks,
            "steps": [s.to_dict() for s in self._steps],
        }
        if self.has_budgets:
            out["depth_for_budget"] = {str(k): self.depth_for(k) for k in self.budgets}
        return out

    # ------------------------------------------------------------ validation
    def key(self, name: str) -> str:
        """The config key of ``name`` as the user writes it: ``model.plan.<name>`` for an option of
        this kind's section, else ``model.<name>``. Errors name this."""
        own = {f.name for f in dataclasses.fields(self.Options)}
        if name in own:
            return f"{self.prefix}.plan.{name}"
        return f"{self.prefix}.{name}"

    def _require(self, key: str, value, minimum: int = 1) -> int:
        if value is None:
            raise ConfigError(f"{self.key(key)}: plan {self.name} needs it")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.key(key)}: must be an integer (got {value!r})")
        if value < minimum:
            raise ConfigError(f"{self.key(key)}: must be > {minimum - 1} (got {value!r})")
        return value

    def _validate_shared_options(self) -> None:
        """The checks of the option groups a kind includes (:mod:`.windows`, :mod:`.pass_parts`),
        whatever the kind, with the keys as the user writes them (``model.plan.windows.shift``)."""
        from megatron_lol.plan.pass_parts import PassParts
        from megatron_lol.plan.windows import FixedAttention

        o = self.options
        if isinstance(o, PassParts):
            o.validate_parts(f"{self.prefix}.plan")
        if isinstance(o, FixedAttention):
            o.validate_attention(f"{self.prefix}.plan")

    def _fixed_attention(self) -> str:
        """The attention of a fixed kind's steps: ``plan.attention`` where its ``Options`` inherit
        :class:`~megatron_lol.plan.windows.FixedAttention` (with the ``windows`` that ``sliding`` /
        ``strided`` use), else full causal attention."""
        return getattr(self.options, "attention", "full")


PLANS: dict = {}


def register_plan(cls: type) -> type:
    """Make plan kind ``cls`` available as ``model.plan: {kind: cls.name, ...}`` (a class decorator).

    Registering a second class under a taken name is refused (a plug-in cannot shadow a
    built-in kind by accident); :func:`unregister_plan` removes one.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a plan kind needs a name")
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"{cls.__name__}.Options must be a dataclass (the kind's config section)")
    if "kind" in {f.name for f in dataclasses.fields(cls.Options)}:
        raise TypeError(f"{cls.__name__}.Options: 'kind' names the kind, it cannot be an option")
    if cls.name in PLANS and PLANS[cls.name] is not cls:
        raise ValueError(f"plan kind {cls.name!r} is already registered ({PLANS[cls.name].__qualname__})")
    PLANS[cls.name] = cls
    return cls


def unregister_plan(name: str) -> None:
    PLANS.pop(name, None)


def plan_kind(name: str, prefix: str = "model") -> type:
    """The registered class of kind ``name``; one-line ConfigError naming the known kinds."""
    cls = PLANS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"{prefix}.plan: kind must be one of {', '.join(PLANS)} (got {name!r})")
    return cls


def plan_section(kind: str, values: Optional[dict] = None, prefix: str = "model") -> Any:
    """The section object of kind ``kind``: an instance of its ``Options`` (``values``, else the
    defaults) that also says ``kind``; what ``ModelConfig.plan`` holds."""
    cls = plan_kind(kind, prefix)
    values = dict(values or {})
    hints = None
    for f in dataclasses.fields(cls.Options):
        if isinstance(values.get(f.name), dict):  # a sub-section (``routing``) as a mapping
            import typing

            hints = hints or typing.get_type_hints(cls.Options)
            values[f.name] = hints[f.name](**values[f.name])
    return _section_class(cls)(**values)


_SECTIONS: dict = {}


def _section_class(cls: type) -> type:
    """``cls.Options`` with the kind's name attached (one class per registered kind and Options):
    the section knows its kind, so nothing else has to keep it, and it pickles by kind and values."""
    key = (cls.name, cls.Options)
    if key not in _SECTIONS:
        frozen = cls.Options.__dataclass_params__.frozen
        body = {"kind": cls.name, "__repr__": _section_repr, "__reduce__": _section_reduce}
        section = type(f"{cls.Options.__name__}", (cls.Options,), body)
        section.__qualname__ = f"{cls.Options.__qualname__}[{cls.name}]"
        _SECTIONS[key] = dataclasses.dataclass(frozen=frozen)(section)
    return _SECTIONS[key]


def section_dict(section: Any) -> dict:
    """``{kind: ..., option: value, ...}``: the section as a config writes it (sub-sections as mappings)."""
    return {"kind": section.kind, **{f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _section_repr(self) -> str:
    return f"{type(self).__qualname__}({section_dict(self)!r})"


def _section_reduce(self):
    values = section_dict(self)
    return plan_section, (values.pop("kind"), values)


def build_plan(model, prefix: str = "model") -> ExecutionPlan:
    """The execution plan of ``model`` (a ``ModelConfig``); one-line ConfigError on bad fields."""
    return plan_kind(model.plan.kind, prefix)(model, prefix)
