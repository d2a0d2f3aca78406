"""Parameter counts of a model config, read off the built model.

``count_parameters(model_cfg, vocab_size)`` returns a :class:`ParamCounts`. Every
figure is a sum over the parameters of the model itself: :mod:`.inventory` builds
``LoLGPTModel`` on the ``meta`` device at tensor-parallel size 1 and walks its
``named_parameters()`` (as torchtitan counts), so nothing here restates a shape by
hand and a part a plan adds is counted as soon as the model builds it. The papers'
counting conventions are named filters over parameter names
(:data:`PAPER_CONVENTIONS`: which category a parameter belongs to, :func:`is_linear`,
:func:`expert_index`); the figures that count executions (active per token, per
budget) multiply the walk of one stored block by the plan's schedule (its depth,
budgets and untied pass sets).

Categories (``ParamCounts.breakdown``), all bias-free at TP 1 as megatron-core builds them:

* per layer (prelude, coda, every library block): attention (fused QKV and output
  projection), MLP (SwiGLU) or, for an MoE layer, experts, the MoE router and the shared
  expert; the two RMSNorm gains (plus the final norm);
* once per model: input embedding, output layer when untied, the LoL routers, the
  per-depth vectors, FiLM, the injection logit;
* per pass: Foil's untied attention sets (``pass_attention``: norm gain + attention of
  every block on every pass after the first), Accordion's ``loop_gates`` and
  separate second-pass MoE routers (``second_pass_router``).

A per-pass part's tensors (``megatron_lol/model/parts.py``) are in the category the part
names (``Part.category``: FiLM in ``film``, ...); a plug-in part with a category of its own
is counted under :attr:`ParamCounts.part_params`, in the totals and, like the routing
extras, fully in the active figures.

Active parameters: the convention
----------------------------------
The "active" figure (docs/model.md, "Parameter accounting") counts the parameters *stored once* that a token
touches, all embeddings excluded: every fixed layer (with ``top-k`` of its
experts, and its shared expert), and in the core the *distinct* blocks it can
execute, at most ``min(L, D)``. Each stored tensor counts once however often
it is applied (as Accordion's tables put it: "active shared weights are not
multiplied by recurrence count"). It reproduces both 308.3M figures of docs/model.md, "Golden facts":

* MoE baseline (24 layers, 3 experts of hidden 1408, top-2): per layer
  attention 4,194,304 + 2 experts 8,650,752 = 12,845,056; x 24 = 308.28M
  (stored: 24 x (4,194,304 + 3 x 4,325,376) = 412.09M);
* LoL vs MoE (4+4 such MoE layers, 24 blocks, D = 16): 8 x 12,845,056 +
  min(24, 16) x 12,845,056 = 308.28M (stored 8 x 17,170,432 + 24 x 12,845,056
  = 445.64M).

With ``L >= D`` this equals the per-execution count, since a token runs ``D``
blocks which can all be distinct; the two conventions part only when blocks
must repeat (``L < D``, looped plans), where ``active_per_token`` counts the
``L`` stored blocks once and ``active_compute`` counts all ``D`` executions
(proportional to matmul FLOPs per token). The expected number of *distinct*
blocks under uniform routing, ``E[U] = L(1-(1-1/L)^D)``, is lower still; the
stored-once count is its upper bound.

Foil (looped, untied attention): a token reads every pass's attention set,
so ``active_per_token`` adds all ``L*(P-1)`` extra sets to the ``L`` blocks
counted once (experts: top-k per block, once, as for any looped plan);
``active_compute`` counts ``D = L*P`` executions of a block-sized layer
(each pass's attention set has the block attention's size). Foil's own
accounting (the Foil paper, "How to Loop MoE: Flatten the Experts, Untie the
Attention", section 2.1) is reported separately
(:attr:`ParamCounts.loop_accounting`): ``E_real = E*D``, ``D_eff = D*L``,
``E_eq = E*D*L``, ``E_comp = k*D*L`` with the paper's symbols (``E`` experts per
core layer, ``D`` stored core layers, ``L`` passes).

Accordion: "active" is defined by the Accordion paper (Tables 5 and 19) as a single
*unlooped* forward pass (budget ``k = 0``), input embedding and output head
excluded: per layer attention + top-k routed experts + the shared expert +
the MoE router, over all ``n_prelude + num_blocks + n_coda`` layers (plus
norm gains). Loop gates and separate second-pass routers are not read at
``k = 0`` and are not active. ``active_compute`` is the largest budget
``k_max`` with every execution counted (``24 + k_max`` layers; the gates and
routers of the ``k_max`` re-run layers included); :attr:`ParamCounts.budgets`
gives it for every budget.

Routing extras (routers, depth vectors, FiLM, injection) are counted fully in
both active figures: a token reads every depth's router and vectors. MoE
routers of the fixed layers are active. ``active_with_embedding`` adds the input
embedding and the output layer (whole matrices, as usually reported).

The paper's figures (``linear_*``) count linear weight matrices only: attention
projections (Foil's pass attention sets included) and MLP / expert / shared
expert projections, no norms, no routers (LoL or MoE), no gates, no
embeddings. Everything else is in the breakdown.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Callable, Optional

from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.inventory import parameter_shapes
from megatron_lol.model.parts import part_of_parameter, part_parameters, step_parts


@dataclass
class LayerCounts:
    """One transformer layer (fixed layer or library block)."""

    attention: int
    mlp: int  # dense SwiGLU projections (0 for an MoE layer)
    experts: int  # all routed expert projections (0 for a dense layer)
    experts_active: int  # top-k experts' projections
    moe_router: int  # E*d (0 for a dense layer)
    norms: int
    shared_expert: int = 0  # megatron SharedExpertMLP projections (always active)
    num_experts: int = 0  # routed experts of this layer (0: dense)

    @property
    def linear(self) -> int:
        return self.attention + self.mlp + self.experts + self.shared_expert

    @property
    def linear_active(self) -> int:
        return self.attention + self.mlp + self.experts_active + self.shared_expert

    @property
    def total(self) -> int:
        return self.linear + self.moe_router + self.norms

    @property
    def active(self) -> int:
        return self.linear_active + self.moe_router + self.norms

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(linear=self.linear, linear_active=self.linear_active, total=self.total, active=self.active)
        return d


@dataclass
class ParamCounts:
    """Parameter counts of a model config (see the module docstring for conventions)."""

    plan: str
    vocab_size: int
    # headline figures
    total: int
    non_embedding: int  # total - input embedding - untied output layer
    # non-embedding, stored-once convention (docs/model.md, "Parameter accounting"); accordion: unlooped k=0
    active_per_token: int
    active_compute: int  # non-embedding, every core execution counted (L < D: > active_per_token)
    active_with_embedding: int  # active_per_token + input embedding + output layer
    linear_total: int  # paper convention: attention + MLP / expert projections, stored
    linear_active: int  # paper convention, active per token (stored once)
    linear_active_compute: int  # paper convention, every execution counted
    # breakdown of ``total``
    embedding: int
    output: int  # 0 when tied to the embedding
    attention: int  # the layers' own attention projections
    pass_attention: int  # looped + untie_attention: the extra per-pass sets (norm gain + projections)
    mlp: int
    experts: int
    shared_experts: int
    moe_router: int
    second_pass_router: int  # accordion, second_pass_router: separate
    loop_gates: int  # accordion
    norms: int  # block / layer norm gains + final norm
    router: int  # LoL routers (W_r, b_r, W_n, b_n), all of them
    depth_vectors: int
    film: int
    injection: int
    # structure
    num_layers_fixed: int  # n_prelude + n_coda
    num_blocks: int  # L, blocks stored
    core_depth: int  # D, block executions per token in the core
    active_blocks: int  # distinct blocks a token can touch: min(L, D)
    num_routers: int
    router_each: int  # d*L + L^2 + 2L for a routed plan, else 0
    loop_passes: int = 1  # looped plans: passes over the stored blocks
    pass_attention_sets: int = 0  # L*(passes-1) with untie_attention
    prelude_layer: LayerCounts = field(repr=False, default=None)
    coda_layer: LayerCounts = field(repr=False, default=None)
    block: LayerCounts = field(repr=False, default=None)  # one library block
    loop_accounting: Optional[dict] = field(repr=False, default=None)  # looped MoE core (Foil)
    budgets: Optional[list] = field(repr=False, default=None)  # accordion: one entry per budget
    part_params: dict = field(default_factory=dict)  # per-pass parts' own categories (plug-ins), in total

    @property
    def breakdown(self) -> dict:
        return {k: getattr(self, k) for k in BREAKDOWN_KEYS}

    @property
    def seed_columns(self) -> Optional[dict]:
        """The Foil paper's parameter-table (Table 3) columns: core experts incl. routers, core attention,
        head + tail, other (the JSON key keeps the name ``seed_columns``)."""
        if self.loop_accounting is None:
            return None
        return {
            "core_experts_and_routers": self.num_blocks * (self.block.experts + self.block.moe_router),
            "core_attention": self.num_blocks * self.block.attention + self.pass_attention,
            "head_and_tail": self.num_layers_fixed * self.prelude_layer.total,
            "other": self.embedding + self.output,
        }

    def to_dict(self) -> dict:
        d = {
            f: getattr(self, f)
            for f in self.__dataclass_fields__
            if f not in ("prelude_layer", "coda_layer", "block", "loop_accounting", "budgets", "part_params")
        }
        if self.part_params:
            d["part_params"] = dict(self.part_params)
        d["fixed_layer"] = self.prelude_layer.to_dict()
        d["block"] = self.block.to_dict()
        if self.loop_accounting is not None:
            d["loop_accounting"] = dict(self.loop_accounting)
            d["seed_columns"] = self.seed_columns
        if self.budgets is not None:
            d["budgets"] = [dict(b) for b in self.budgets]
        return d


BREAKDOWN_KEYS = (
    "embedding",
    "output",
    "attention",
    "pass_attention",
    "mlp",
    "experts",
    "shared_experts",
    "moe_router",
    "second_pass_router",
    "loop_gates",
    "norms",
    "router",
    "depth_vectors",
    "film",
    "injection",
)


# The papers' counting conventions as named filters over ``named_parameters()`` names: each parameter
# belongs to the first category whose filter takes it (model-level parts first, then a layer's parts).
PAPER_CONVENTIONS: dict[str, Callable[[str], bool]] = {
    "embedding": lambda n: n.startswith("embedding."),
    "output": lambda n: n.startswith("output_layer."),
    # LoL routers (W_r, b_r, W_n, b_n) and the router embeddings of router-only tokens
    "router": lambda n: n.startswith("core.routers.") or n == "core.router_only_embeddings",
    "depth_vectors": lambda n: n == "core.depth_vectors",
    # per-pass parts: the category their part names (megatron_lol/model/parts.py)
    "film": lambda n: _part_category(n) == "film",
    "injection": lambda n: _part_category(n) == "injection",
    "loop_gates": lambda n: _part_category(n) == "loop_gates",
    "pass_attention": lambda n: n.startswith("core.pass_attention."),  # norm gain + attention per set
    "second_pass_router": lambda n: n.startswith("core.second_pass_routers."),
    "norms": lambda n: _is_norm(n),
    "attention": lambda n: ".self_attention." in n,
    "moe_router": lambda n: ".mlp.router." in n,
    "shared_experts": lambda n: ".mlp.shared_experts." in n,
    "experts": lambda n: ".mlp.experts." in n,
    "mlp": lambda n: ".mlp." in n,
}
assert set(PAPER_CONVENTIONS) == set(BREAKDOWN_KEYS)  # every breakdown entry has its filter

# the papers' "linear" figures: attention and MLP / expert projections (Foil's pass attention sets too);
# no norms, routers, gates or embeddings
_LINEAR = ("attention", "mlp", "experts", "shared_experts")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_FIXED_LAYER = re.compile(r"^(prelude|coda)\.(\d+)\.")


def _is_norm(name: str) -> bool:
    return "layernorm" in name or "layer_norm" in name or name.startswith("final_norm.")


def _part_category(name: str) -> Optional[str]:
    """The category of a per-pass part's tensor ``core.<name>`` (None: not a part's)."""
    if not name.startswith("core."):
        return None
    part = part_of_parameter(name[len("core.") :])
    return None if part is None else part.category


def category(name: str) -> str:
    """The breakdown category of parameter ``name`` (:data:`PAPER_CONVENTIONS`; a per-pass part's
    tensor: its part's category, which may be one of the part's own)."""
    own = _part_category(name)
    if own is not None:
        return own
    for key, takes in PAPER_CONVENTIONS.items():
        if takes(name):
            return key
    raise ValueError(f"parameter {name}: no counting convention takes it (add one to PAPER_CONVENTIONS)")


def is_linear(name: str) -> bool:
    """A projection the papers' ``linear_*`` figures count (a pass attention set's norm gain is not)."""
    cat = category(name)
    return cat in _LINEAR or (cat == "pass_attention" and not _is_norm(name))


def expert_index(name: str) -> Optional[int]:
    """The routed expert a parameter belongs to (megatron-core's sequential experts), else None."""
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def _layer(shapes: dict, prefix: str, topk: int) -> LayerCounts:
    """The counts of the layer whose parameters start with ``prefix``; its ``topk`` lowest-numbered
    experts stand for the experts a token runs (all experts are the same size)."""
    sums: dict = defaultdict(int)
    per_expert: dict = defaultdict(int)
    for name, shape in shapes.items():
        if not name.startswith(prefix):
            continue
        sums[category(name)] += prod(shape)
        index = expert_index(name)
        if index is not None:
            per_expert[index] += prod(shape)
    k = min(topk, len(per_expert))
    return LayerCounts(
        attention=sums["attention"],
        mlp=sums["mlp"],
        experts=sums["experts"],
        experts_active=sum(per_expert[i] for i in sorted(per_expert)[:k]),
        moe_router=sums["moe_router"],
        norms=sums["norms"],
        shared_expert=sums["shared_experts"],
        num_experts=len(per_expert),
    )


def _modules(shapes: dict, prefix: str) -> dict:
    """``{child: parameters}`` of the children of ``prefix`` (``core.routers.`` -> one entry per router)."""
    out: dict = defaultdict(int)
    for name, shape in shapes.items():
        if name.startswith(prefix):
            out[name[len(prefix) :].split(".", 1)[0]] += prod(shape)
    return dict(out)


def loop_accounting(model: ModelConfig) -> Optional[dict]:
    """Foil's identities for a looped block of MoE layers (None for other plans / a dense core).

    ``E`` experts per core layer, ``D`` stored core layers, ``L`` passes, ``k`` = top-k.
    """
    plan = model.execution_plan()
    if plan.name not in ("looped", "foil") or plan.core_experts is None:
        return None
    E, D, L = plan.core_experts, plan.num_stored_blocks, plan.loop_passes
    k = min(model.moe.router_topk, E)
    return {
        "E": E,
        "D": D,
        "L": L,
        "k": k,
        "shape": f"({E},{D},{L})",
        "E_real": E * D,
        "D_eff": D * L,
        "E_eq": E * D * L,
        "E_comp": k * D * L,
        "untie_attention": bool(plan.untied_attention_sets()),
    }


_COUNTS: dict = {}


def count_parameters(model: ModelConfig, vocab_size: int) -> ParamCounts:
    """Counts for ``model`` with a ``vocab_size``-row embedding (TP size 1), from the built model's walk.

    ``vocab_size`` is the size the model is built with (already padded, as
    ``LoLGPTModel`` takes it). Cached per (model, vocabulary) like the walk
    itself: the layout planner estimates thousands of layouts of one model.
    """
    if vocab_size is None or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer (got {vocab_size!r})")
    key = (repr(model), vocab_size)
    if key not in _COUNTS:
        _COUNTS[key] = _count_parameters(model, vocab_size)
    return copy.deepcopy(_COUNTS[key])


def _part_params_per_reexecution(model: ModelConfig, plan) -> int:
    """Parameters one re-execution of a block (a step of pass >= 1) reads from the parts its step applies,
    by each part's own ``select`` on shape-only tensors: what the part picks for that step (Accordion's
    loop gates: the block's gate pair), whatever the part is called."""
    import torch

    again = [(step, parts) for step, parts in zip(plan.steps(), step_parts(model, plan)) if step.pass_index >= 1]
    if not again:
        return 0
    step, parts = again[0]
    tables = {name: torch.empty(shape, device="meta") for name, (_, shape, _) in part_parameters(model, plan).items()}
    picked = [t for cls in parts for t in cls.select(tables, step.depth, step.pass_index, step.block)]
    return sum(t.numel() for t in picked)


def _count_parameters(model: ModelConfig, vocab_size: int) -> ParamCounts:
    shapes = parameter_shapes(model, vocab_size)
    plan = model.execution_plan()
    topk = model.moe.router_topk

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    part_params: dict = {}
    linear_total = 0
    pass_attention_linear = 0
    film_active = 0  # one (gamma, beta) set per executed depth: a (D, L, 2, d) table counts its (D, 2, d) share
    for name, shape in shapes.items():
        n = prod(shape)
        cat = category(name)
        if cat in breakdown:
            breakdown[cat] += n
        else:
            part_params[cat] = part_params.get(cat, 0) + n
        if is_linear(name):
            linear_total += n
            if cat == "pass_attention":
                pass_attention_linear += n
        if cat == "film":
            film_active += n // shape[1] if len(shape) == 4 else n
    total = sum(breakdown.values()) + sum(part_params.values())
    embedding, output = breakdown["embedding"], breakdown["output"]

    fixed_layers = sorted({m.group(0) for m in map(_FIXED_LAYER.match, shapes) if m}, key=lambda p: p.split("."))
    fixed = [_layer(shapes, prefix, topk) for prefix in fixed_layers]
    empty = LayerCounts(0, 0, 0, 0, 0, 0)
    prelude = next((c for p, c in zip(fixed_layers, fixed) if p.startswith("prelude.")), None)
    coda = next((c for p, c in zip(fixed_layers, fixed) if p.startswith("coda.")), None)
    block = _layer(shapes, "core.blocks.0.", topk)

    L = len(_modules(shapes, "core.blocks."))
    D = plan.depth
    routers = _modules(shapes, "core.routers.")
    sets = len(_modules(shapes, "core.pass_attention."))
    gate_each = _part_params_per_reexecution(model, plan)  # Accordion: one (attention, MLP) gate pair
    final_norm = sum(prod(s) for name, s in shapes.items() if name.startswith("final_norm."))
    extras = breakdown["router"] + breakdown["depth_vectors"] + breakdown["injection"] + sum(part_params.values())

    # stored once: every fixed layer, the distinct blocks a token can reach, every pass set it reads;
    # per execution: the plan's schedule runs a block-sized layer D times
    active_blocks = min(L, D)
    fixed_active = sum(c.active for c in fixed) + final_norm + extras + film_active
    active = fixed_active + active_blocks * block.active + breakdown["pass_attention"]
    active_compute = fixed_active + D * block.active
    linear_fixed = sum(c.linear_active for c in fixed)
    linear_active = linear_fixed + active_blocks * block.linear_active + pass_attention_linear
    linear_active_compute = linear_fixed + D * block.linear_active
    budgets = None
    if plan.has_budgets:
        # extra executions at budget k: k window layers re-run with their gates (and separate routers,
        # which replace the shared one on that pass: no extra router per execution)
        def at_budget(k: int) -> tuple[int, int]:
            return (fixed_active + (L + k) * block.active + k * gate_each, linear_fixed + (L + k) * block.linear_active)

        budgets = []
        for k in plan.budgets:
            act, lin = at_budget(k)
            budgets.append(
                {
                    "k": k,
                    "layer_executions": len(fixed) + plan.depth_for(k),
                    "active_compute": act,
                    "linear_active_compute": lin,
                }
            )
        active_compute, linear_active_compute = at_budget(D - L)
        # the Accordion paper's "active": one unlooped (k = 0) forward pass
        active = fixed_active + L * block.active
        linear_active = linear_fixed + L * block.linear_active
    return ParamCounts(
        plan=plan.name,
        vocab_size=vocab_size,
        total=total,
        non_embedding=total - embedding - output,
        active_per_token=active,
        active_compute=active_compute,
        active_with_embedding=active + embedding + output,
        linear_total=linear_total,
        linear_active=linear_active,
        linear_active_compute=linear_active_compute,
        **breakdown,
        num_layers_fixed=len(fixed),
        num_blocks=L,
        core_depth=D,
        active_blocks=active_blocks,
        num_routers=len(routers),
        router_each=next(iter(routers.values()), 0),
        loop_passes=plan.loop_passes,
        pass_attention_sets=sets,
        prelude_layer=prelude or coda or empty,
        coda_layer=coda or prelude or empty,
        block=block,
        loop_accounting=loop_accounting(model),
        budgets=budgets,
        part_params=part_params,
    )
