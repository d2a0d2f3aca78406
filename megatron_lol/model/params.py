"""Analytic parameter counts of a model config (no torch, no megatron-core import).

``count_parameters(model_cfg, vocab_size)`` returns a :class:`ParamCounts` whose
``total`` equals ``sum(p.numel() for p in LoLGPTModel(...).parameters())`` at
tensor-parallel size 1 (tests check this for every plan and option the model
implements). FFN mixture-of-experts layers are counted analytically as
megatron-core builds them (router ``E*d``, no bias; ``E`` SwiGLU experts of
hidden ``moe_ffn_hidden_size``; an optional ``SharedExpertMLP`` of hidden
``moe_shared_expert_intermediate_size``, no gate).

What is counted, per layer (prelude, coda, every library block; all bias-free):

* attention: ``d*(nq*c) + 2*d*(nkv*c)`` (fused QKV) ``+ (nq*c)*d`` (output), ``c`` =
  ``kv_channels`` (default ``d / heads``), ``nkv`` = ``num_query_groups`` (GQA);
* MLP: SwiGLU ``3*d*f``; or, for an MoE layer, experts ``E*3*d*f_e`` plus router
  ``E*d`` plus the shared expert ``3*d*f_s`` when configured. ``E`` is
  ``num_experts`` in the prelude / coda and ``core_num_experts`` (default
  ``num_experts``) in the core's blocks (Foil's per-layer ``E``);
* norms: two RMSNorm gains of ``d`` (plus the final norm);

and once per model: input embedding ``V*d``, output layer ``V*d`` when untied;
LoL router ``d*L + L^2 + 2L`` per router (one if tied, ``D`` if untied), the
per-depth vectors ``D*d`` (always, for ``plan: lol``), FiLM ``gamma, beta`` of
shape ``(D, 2, d)`` (``film: depth``) or ``(D, L, 2, d)`` (``film: depth_block``),
and the injection logit ``d``. ``D`` is the core depth: ``routed_depth`` for
``lol``/``looped``, ``num_blocks`` for ``dense``, ``num_blocks + max(loop_budgets)``
for ``accordion``.

Plan-specific parameters:

* ``looped`` with ``untie_attention`` (Foil; docs/model.md, "Foil"): for every stored block
  and every pass ``p = 1..P-1`` (``P`` = ``loop_passes``; pass 0 uses the
  block's own attention) one more attention set, input RMSNorm gain ``d`` +
  QKV + output projection: ``L*(P-1)`` sets (``pass_attention``). Experts,
  MoE routers and pre-MLP norms stay shared across passes.
* ``accordion`` (docs/model.md, "Accordion"): ``loop_gates`` of shape ``(L, 2, d)`` (per-channel
  gates on the second pass's attention and MLP writes; ``loop_gates: true``)
  and, with ``second_pass_router: separate``, one more MoE router ``E*d`` per
  window layer (``second_pass_router``).

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

from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_lol.config.schema import ModelConfig


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
            if f not in ("prelude_layer", "coda_layer", "block", "loop_accounting", "budgets")
        }
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


def router_parameters(hidden_size: int, num_blocks: int) -> int:
    """One LoL router ``(W_r, b_r, W_n, b_n)``: ``d*L + L^2 + 2L`` (docs/model.md, "Router")."""
    d, L = hidden_size, num_blocks
    return d * L + L * L + 2 * L


def attention_parameters(model: ModelConfig) -> int:
    d = model.hidden_size
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    c = model.kv_channels if model.kv_channels is not None else d // heads
    q = heads * c
    kv = groups * c
    return d * (q + 2 * kv) + q * d


def layer_counts(model: ModelConfig, moe: bool, num_experts: Optional[int] = None) -> LayerCounts:
    """Parameters of one layer; ``moe``: its FFN is a mixture of ``num_experts`` (default ``model.num_experts``)."""
    d = model.hidden_size
    attn = attention_parameters(model)
    norms = 2 * d
    if not moe:
        return LayerCounts(
            attention=attn, mlp=3 * d * model.ffn_hidden, experts=0, experts_active=0, moe_router=0, norms=norms
        )
    E = num_experts if num_experts is not None else model.num_experts
    f = model.moe_ffn_hidden_size if model.moe_ffn_hidden_size is not None else model.ffn_hidden
    expert = 3 * d * f
    f_s = model.moe_shared_expert_intermediate_size
    return LayerCounts(
        attention=attn,
        mlp=0,
        experts=E * expert,
        experts_active=min(model.moe_router_topk, E) * expert,
        moe_router=E * d,
        norms=norms,
        shared_expert=3 * d * f_s if f_s else 0,
        num_experts=E,
    )


def loop_accounting(model: ModelConfig) -> Optional[dict]:
    """Foil's identities for a looped block of MoE layers (None for other plans / a dense core).

    ``E`` experts per core layer, ``D`` stored core layers, ``L`` passes, ``k`` = top-k.
    """
    plan = model.execution_plan()
    if plan.name not in ("looped", "foil") or plan.core_experts is None:
        return None
    E, D, L = plan.core_experts, plan.num_stored_blocks, plan.loop_passes
    k = min(model.moe_router_topk, E)
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
        "untie_attention": bool(model.untie_attention),
    }


def count_parameters(model: ModelConfig, vocab_size: int) -> ParamCounts:
    """Analytic counts for ``model`` with a ``vocab_size``-row embedding (TP size 1).

    ``vocab_size`` is the size the model is built with (already padded, as
    ``LoLGPTModel`` takes it).
    """
    if vocab_size is None or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer (got {vocab_size!r})")
    d = model.hidden_size
    plan = model.execution_plan()
    L, D = plan.num_stored_blocks, plan.depth
    n_fixed = model.n_prelude + model.n_coda
    fixed = layer_counts(model, moe=model.moe_layers in ("fixed", "all"))
    block = layer_counts(model, moe=model.moe_layers == "all", num_experts=plan.core_experts)

    embedding = vocab_size * d
    output = vocab_size * d if model.untie_embeddings_and_output_weights else 0

    routed = plan.routed
    num_routers = (1 if model.router_tied else D) if routed else 0
    router_each = router_parameters(d, L) if routed else 0
    router = num_routers * router_each
    depth_vectors = D * d if routed else 0
    if model.film == "depth":
        film = 2 * D * 2 * d
        film_active = film
    elif model.film == "depth_block":
        film = 2 * D * L * 2 * d
        film_active = 2 * D * 2 * d  # one (gamma, beta) set per executed (depth, block)
    else:
        film = film_active = 0
    injection = d if model.input_injection else 0
    extras = router + depth_vectors + injection
    final_norm = d

    # looped / Foil: untied attention, one extra (norm gain + attention) set per (block, pass >= 1)
    passes = plan.loop_passes
    sets = len(plan.untied_attention_sets())
    pass_attention_linear = sets * block.attention
    pass_attention = pass_attention_linear + sets * d
    # accordion: per-channel second-pass gates (one pair per stored block), optional separate routers
    accordion = plan.has_budgets
    gate_each = 2 * d if plan.gated_blocks() else 0
    loop_gates = L * gate_each
    second_pass_router = len(plan.separate_router_blocks()) * block.moe_router

    attention = n_fixed * fixed.attention + L * block.attention
    mlp = n_fixed * fixed.mlp + L * block.mlp
    experts = n_fixed * fixed.experts + L * block.experts
    shared_experts = n_fixed * fixed.shared_expert + L * block.shared_expert
    moe_router = n_fixed * fixed.moe_router + L * block.moe_router
    norms = n_fixed * fixed.norms + L * block.norms + final_norm
    total = (
        embedding
        + output
        + attention
        + pass_attention
        + mlp
        + experts
        + shared_experts
        + moe_router
        + second_pass_router
        + loop_gates
        + norms
        + extras
        + film
    )
    non_embedding = total - embedding - output

    active_blocks = min(L, D)
    fixed_active = n_fixed * fixed.active + final_norm + extras + film_active
    active = fixed_active + active_blocks * block.active + pass_attention
    active_compute = fixed_active + D * block.active
    linear_fixed = n_fixed * fixed.linear_active
    linear_active = linear_fixed + active_blocks * block.linear_active + pass_attention_linear
    linear_active_compute = linear_fixed + D * block.linear_active
    budgets = None
    if accordion:
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
                    "layer_executions": n_fixed + plan.depth_for(k),
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
        non_embedding=non_embedding,
        active_per_token=active,
        active_compute=active_compute,
        active_with_embedding=active + embedding + output,
        linear_total=n_fixed * fixed.linear + L * block.linear + pass_attention_linear,
        linear_active=linear_active,
        linear_active_compute=linear_active_compute,
        embedding=embedding,
        output=output,
        attention=attention,
        pass_attention=pass_attention,
        mlp=mlp,
        experts=experts,
        shared_experts=shared_experts,
        moe_router=moe_router,
        second_pass_router=second_pass_router,
        loop_gates=loop_gates,
        norms=norms,
        router=router,
        depth_vectors=depth_vectors,
        film=film,
        injection=injection,
        num_layers_fixed=n_fixed,
        num_blocks=L,
        core_depth=D,
        active_blocks=active_blocks,
        num_routers=num_routers,
        router_each=router_each,
        loop_passes=passes,
        pass_attention_sets=sets,
        prelude_layer=fixed,
        coda_layer=fixed,
        block=block,
        loop_accounting=loop_accounting(model),
        budgets=budgets,
    )
