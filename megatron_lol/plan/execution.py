"""Execution plans: which stored block runs at each step of the core, on which tokens.

Every model this stack trains is a set of stored blocks and a plan (see
docs/model.md, "Execution plans"):

==========  ==================================================================
plan        steps of the core
==========  ==================================================================
dense       step ``i`` runs block ``i`` on every token
looped      steps cycle ``loop_count`` times through ``loop_layers`` blocks
foil        looped over a block of MoE layers, shape ``(E, D, L)`` =
            (``foil_experts``, ``foil_layers``, ``foil_loops``); attention
            untied per (layer, pass) unless ``untie_attention: false``
lol         each window, at each of ``routed_depth`` depths, runs the block of
            ``num_blocks`` that its router chose
accordion   the ``loop_window`` layers once, then the first ``k`` of them
            again, ``k`` the loop budget
==========  ==================================================================

A forward runs a *prefix* of the plan's steps: the growing-depth curriculum
shortens it in training, Accordion's budget ``k`` sets it to ``loop_window +
k``. Everything that needs the schedule (the core, parameter counts, the FLOP
and memory model, the trainer, the HF export, analyses) reads it from here;
a new variant is a new :class:`ExecutionPlan` subclass registered in
:data:`PLANS`.

This module is pure Python (no torch): the config validates against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_lol.errors import ConfigError

DENSE_ATTENTION = ("full", "sliding", "strided")


@dataclass(frozen=True)
class Step:
    """One block execution of the core.

    ``depth``: 1-based position in the core (the routed depth ``l`` of a LoL
    model; window offsets are computed from it). ``block``: the stored block
    that runs, or None when a router picks it per window. ``pass_index``: how
    many earlier steps ran the same block. ``attention``: ``window`` (the
    shifted windows of this depth, routed plans), ``full`` / ``sliding``
    (causal inside the document, optionally the last ``window_size`` tokens),
    ``strided`` (the windows of this depth, a fixed block).
    ``untied_attention``: run the pass's own input norm and attention (Foil).
    ``gated``: scale the two residual writes by the block's loop gates
    (Accordion's second pass). ``separate_router``: the pass's own MoE router.
    """

    depth: int
    block: Optional[int]
    pass_index: int = 0
    attention: str = "full"
    untied_attention: bool = False
    gated: bool = False
    separate_router: bool = False

    @property
    def routed(self) -> bool:
        return self.block is None

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
            "gated": self.gated,
            "separate_router": self.separate_router,
        }


class ExecutionPlan:
    """The ordered steps of the core for one model config; subclasses are the plan kinds."""

    name: ClassVar[str] = ""
    #: whether the plan's depth may grow during training (``curriculum.initial_depth``)
    growable: ClassVar[bool] = True
    #: whether pipeline parallelism can cut this plan's core
    pipeline_ok: ClassVar[bool] = True

    def __init__(self, model, prefix: str = "model"):
        self.model = model
        self.prefix = prefix
        if model.untie_attention and not isinstance(self, LoopedPlan):
            raise ConfigError(
                f"{prefix}.untie_attention: only a looped plan (looped, foil) runs a block more "
                f"than once with its own attention (plan is {self.name})"
            )
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
    def core_experts(self) -> Optional[int]:
        """Experts per MoE layer of the core's blocks (None: dense MLPs)."""
        m = self.model
        if m.moe_layers != "all":
            return None
        return m.core_num_experts or m.num_experts

    def untied_attention_sets(self) -> list:
        """``(block, pass)`` of every pass that runs its own attention."""
        return sorted({(s.block, s.pass_index) for s in self._steps if s.untied_attention})

    def separate_router_blocks(self) -> list:
        return sorted({s.block for s in self._steps if s.separate_router})

    def gated_blocks(self) -> list:
        return sorted({s.block for s in self._steps if s.gated})

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
    def _require(self, key: str, value, minimum: int = 1) -> int:
        if value is None:
            raise ConfigError(f"{self.prefix}.{key}: plan {self.name} needs it")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.prefix}.{key}: must be an integer (got {value!r})")
        if value < minimum:
            raise ConfigError(f"{self.prefix}.{key}: must be > {minimum - 1} (got {value!r})")
        return value

    def _refuse(self, **fields) -> None:
        """Keys of other plans must not be set (a typo would otherwise be silently ignored)."""
        for key, value in fields.items():
            if value is not None:
                raise ConfigError(f"{self.prefix}.{key}: not used by plan {self.name}")

    def _fixed_attention(self) -> str:
        att = self.model.dense_attention
        if att not in DENSE_ATTENTION:
            raise ConfigError(
                f"{self.prefix}.dense_attention: must be one of {', '.join(DENSE_ATTENTION)} (got {att!r})"
            )
        return att


_LOL_FIELDS = ("num_blocks", "routed_depth")
_DENSE_FIELDS = ("core_layers",)
_LOOPED_FIELDS = ("loop_layers", "loop_count")
_FOIL_FIELDS = ("foil_experts", "foil_layers", "foil_loops")
_ACCORDION_FIELDS = ("loop_window",)
_ALL_SHAPE_FIELDS = _LOL_FIELDS + _DENSE_FIELDS + _LOOPED_FIELDS + _FOIL_FIELDS + _ACCORDION_FIELDS


def _others(model, own: tuple) -> dict:
    return {k: getattr(model, k) for k in _ALL_SHAPE_FIELDS if k not in own}


class DensePlan(ExecutionPlan):
    """``core_layers`` distinct layers in order, every token through each."""

    name = "dense"

    def _stored_blocks(self) -> int:
        self._refuse(**_others(self.model, _DENSE_FIELDS))
        return self._require("core_layers", self.model.core_layers)

    def _build_steps(self) -> list:
        att = self._fixed_attention()
        return [Step(depth=i + 1, block=i, attention=att) for i in range(self.num_stored_blocks)]

    def describe(self) -> str:
        return f"{self.num_stored_blocks} core layers"


class LoopedPlan(ExecutionPlan):
    """A recurrent block of ``loop_layers`` layers applied ``loop_count`` times (Huginn-style)."""

    name = "looped"
    layers_key, loops_key = "loop_layers", "loop_count"

    @property
    def untie_attention(self) -> bool:
        return bool(self.model.untie_attention)

    @property
    def pipeline_ok(self) -> bool:  # type: ignore[override]
        return not self.untie_attention

    def _stored_blocks(self) -> int:
        self._refuse(**_others(self.model, (self.layers_key, self.loops_key) + self._own_extra()))
        self.loops = self._require(self.loops_key, getattr(self.model, self.loops_key))
        return self._require(self.layers_key, getattr(self.model, self.layers_key))

    def _own_extra(self) -> tuple:
        return ()

    def _build_steps(self) -> list:
        att = self._fixed_attention()
        n = self.num_stored_blocks
        return [
            Step(
                depth=d + 1,
                block=d % n,
                pass_index=d // n,
                attention=att,
                untied_attention=self.untie_attention and d >= n,
            )
            for d in range(n * self.loops)
        ]

    def describe(self) -> str:
        tie = ", attention untied per pass" if self.untie_attention else ""
        return f"{self.num_stored_blocks} layers x {self.loops} loops{tie}"


class FoilPlan(LoopedPlan):
    """Foil: a looped block of ``foil_layers`` MoE layers with ``foil_experts`` experts each,
    looped ``foil_loops`` times; experts and routers shared across passes, attention untied
    per (layer, pass) unless ``untie_attention: false`` (proto-Foil, Base-tied)."""

    name = "foil"
    layers_key, loops_key = "foil_layers", "foil_loops"

    @property
    def untie_attention(self) -> bool:
        return self.model.untie_attention is not False

    def _own_extra(self) -> tuple:
        return ("foil_experts",)

    def _stored_blocks(self) -> int:
        n = super()._stored_blocks()
        m = self.model
        if m.moe_layers != "all":
            raise ConfigError(
                f"{self.prefix}.moe_layers: plan foil loops a block of MoE layers: set moe_layers: all "
                f"(got {m.moe_layers})"
            )
        self._require("foil_experts", m.foil_experts)
        if m.core_num_experts is not None:
            raise ConfigError(f"{self.prefix}.core_num_experts: plan foil takes its core experts from foil_experts")
        return n

    @property
    def core_experts(self) -> Optional[int]:
        return self.model.foil_experts

    def describe(self) -> str:
        e, d, l = self.model.foil_experts, self.num_stored_blocks, self.loops
        tie = "untied" if self.untie_attention else "shared"
        return f"(E, D, L) = ({e}, {d}, {l}), attention {tie} across passes"


class LoLPlan(ExecutionPlan):
    """Library of Layers: at each of ``routed_depth`` depths every window runs the block of the
    ``num_blocks`` in the library that its causal router chose."""

    name = "lol"

    def _stored_blocks(self) -> int:
        self._refuse(**_others(self.model, _LOL_FIELDS))
        if self.model.dense_attention != "full":
            raise ConfigError(
                f"{self.prefix}.dense_attention: plan lol attends inside its windows (got {self.model.dense_attention})"
            )
        self._require("routed_depth", self.model.routed_depth)
        return self._require("num_blocks", self.model.num_blocks)

    def _build_steps(self) -> list:
        return [Step(depth=l, block=None, attention="window") for l in range(1, self.model.routed_depth + 1)]

    def describe(self) -> str:
        m = self.model
        return f"L={m.num_blocks} blocks, D={m.routed_depth} routed depths, W={m.window_size}, S={m.window_shift}"


class AccordionPlan(ExecutionPlan):
    """Accordion: the ``loop_window`` layers once, then the first ``k`` of them once more."""

    name = "accordion"
    growable = False
    pipeline_ok = False

    def _stored_blocks(self) -> int:
        m = self.model
        self._refuse(**_others(m, _ACCORDION_FIELDS))
        n = self._require("loop_window", m.loop_window)
        budgets = m.loop_budgets
        key = f"{self.prefix}.loop_budgets"
        if (
            not isinstance(budgets, list)
            or not budgets
            or any(not isinstance(k, int) or isinstance(k, bool) for k in budgets)
        ):
            raise ConfigError(f"{key}: must be a non-empty list of integers (got {budgets!r})")
        if len(set(budgets)) != len(budgets) or budgets != sorted(budgets):
            raise ConfigError(f"{key}: must be increasing without repeats (got {budgets})")
        if budgets[0] < 0 or budgets[-1] > n:
            raise ConfigError(f"{key}: every budget must be in [0, loop_window={n}] (got {budgets})")
        if m.loop_budget is not None and m.loop_budget not in budgets:
            raise ConfigError(f"{self.prefix}.loop_budget: {m.loop_budget} is not one of loop_budgets {budgets}")
        if m.second_pass_router not in ("shared", "separate"):
            raise ConfigError(
                f"{self.prefix}.second_pass_router: must be one of shared, separate (got {m.second_pass_router!r})"
            )
        if m.second_pass_router == "separate" and m.moe_layers != "all":
            raise ConfigError(f"{self.prefix}.second_pass_router: separate needs MoE blocks (moe_layers: all)")
        if m.dense_attention != "full":
            raise ConfigError(
                f"{self.prefix}.dense_attention: accordion uses full causal attention (got {m.dense_attention})"
            )
        if m.film != "off" or m.input_injection:
            key = "film" if m.film != "off" else "input_injection"
            raise ConfigError(f"{self.prefix}.{key}: not defined for plan accordion")
        return n

    def _build_steps(self) -> list:
        m = self.model
        n, k_max = self.num_stored_blocks, max(m.loop_budgets)
        first = [Step(depth=i + 1, block=i) for i in range(n)]
        second = [
            Step(
                depth=n + i + 1,
                block=i,
                pass_index=1,
                gated=bool(m.loop_gates),
                separate_router=m.second_pass_router == "separate",
            )
            for i in range(k_max)
        ]
        return first + second

    @property
    def budgets(self) -> list:
        return list(self.model.loop_budgets)

    @property
    def has_budgets(self) -> bool:
        return True

    def resolve_budget(self, budget: Optional[int]) -> int:
        """The given budget, else the config's ``loop_budget``, else the largest."""
        m = self.model
        k = budget if budget is not None else m.loop_budget if m.loop_budget is not None else max(m.loop_budgets)
        if k not in m.loop_budgets:
            raise ConfigError(f"budget: {k} is not one of the model's loop_budgets {m.loop_budgets}")
        return k

    def depth_for(self, budget: Optional[int] = None) -> int:
        return self.num_stored_blocks + self.resolve_budget(budget)

    def eval_budgets(self) -> list:
        m = self.model
        return [m.loop_budget] if m.loop_budget is not None else list(m.loop_budgets)

    def sample_budget(self, seed: int, iteration: int, microbatch: int) -> int:
        """Uniform over ``loop_budgets`` from a generator seeded with (seed, iteration,
        micro-batch): every rank draws the same budget without communicating, and a resumed
        run draws what the uninterrupted one would have. A fixed ``loop_budget`` wins."""
        m = self.model
        if m.loop_budget is not None:
            return m.loop_budget
        import numpy as np

        rng = np.random.default_rng([seed, iteration, microbatch])
        return int(m.loop_budgets[int(rng.integers(len(m.loop_budgets)))])

    def describe(self) -> str:
        return f"loop window of {self.num_stored_blocks} layers, budgets {list(self.model.loop_budgets)}"


PLANS: dict = {cls.name: cls for cls in (DensePlan, LoopedPlan, FoilPlan, LoLPlan, AccordionPlan)}


def build_plan(model, prefix: str = "model") -> ExecutionPlan:
    """The execution plan of ``model`` (a ``ModelConfig``); one-line ConfigError on bad fields."""
    cls = PLANS.get(model.plan)
    if cls is None:
        raise ConfigError(f"{prefix}.plan: must be one of {', '.join(PLANS)} (got {model.plan!r})")
    return cls(model, prefix)
