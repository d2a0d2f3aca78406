"""Analytic matmul FLOP and memory model for every plan (dense, looped, LoL, accordion, MoE parts).

No torch, no megatron-core import: a function of the config, the vocabulary,
the micro-batch shape and the step's depth.

What is counted (one multiply-add = 2 FLOPs, forward):

* attention projections: ``2 T d (nq c + 2 nkv c)`` (QKV) + ``2 T (nq c) d`` (output);
* attention scores: ``2 P nq c`` for ``Q K^T`` plus ``2 P nq c`` for ``A V``, where
  ``P`` is a number of (query, key) pairs per sequence (see below);
* MLP: SwiGLU ``6 T d f``; an MoE layer: router ``2 T d E`` + ``k`` experts ``6 T d f_e``
  (+ the shared expert ``6 T d f_s`` when ``moe_shared_expert_intermediate_size`` is
  set); ``E`` is ``num_experts`` in the prelude / coda and the core's own count
  (``core_num_experts``, Foil's ``E``) in the core's blocks;
* LoL router per routed depth: ``2 N d L`` (logits) + ``2 N L^2`` (noise scale,
  training with noise only), ``N`` = windows of the depth (clipped windows count);
* LM head: ``2 T d V``.

Norms, softmax, RoPE, embeddings, window means, residual updates and Accordion's
loop gates are not matmuls and are not counted (under 1% at every size we use).

Core executions: the first ``depth`` steps of the config's execution plan
(:mod:`megatron_lol.plan`; default the plan's full depth, for Accordion
``window + k`` at its fixed budget, else the largest); each step is one
block execution with its attention kind. Foil's untied attention (one
attention per pass) has exactly the FLOPs of the tied attention it replaces; a
separate second-pass router those of the shared one.

Attention pairs, two conventions (``attention_pairs=``):

``"allowed"`` (default; model FLOPs, used for MFU)
    the (query, key) pairs the model allows (docs/model.md): ``n(n+1)/2`` for full
    causal attention of a sequence of ``n``; in the routed core, and for the
    ``strided`` dense baseline, ``sum_k |I_{l,k}| (|I_{l,k}| + 1) / 2`` over the
    clipped windows of depth ``l`` (so a shifted depth has fewer pairs than an
    aligned one: 61,952 vs 66,048 at ``n=1024, W=128, S=64``); ``sliding``:
    ``sum_i min(i + 1, W)``. Each row is taken to be one document (EOD-packed
    rows allow fewer pairs; the figure is an upper bound for them).
``"executed"``
    the score entries this code base's local (CPU / non-TE) attention
    actually computes, masked ones included: ``s^2`` per row for the dense
    algorithm (prelude, coda, full / sliding dense cores and megatron-core's
    ``DotProductAttention``); ``ceil(T_m / W) * W * 2W`` for the chunked
    windowed algorithm on a packed stream of ``T_m`` tokens (``T_m`` = all
    ``b*s`` tokens of the micro-batch for a fixed plan or a single-block path;
    with ``streams_per_depth = m`` streams (a routed depth using ``m`` blocks)
    each is padded separately, counted as ``(m - 1) / 2`` chunks more on
    average). This is what
    ``torch.utils.flop_counter`` measures; TE's fused THD attention on GPUs
    executes close to the ``allowed`` count instead.

Backward is twice the forward for every matmul that receives gradients
(input gradient + weight gradient; ``dQ, dK`` and ``dP, dV`` for attention).
Growing depth: pass the step's ``depth``. Truncated backprop (``backprop_depth
= k``): routed depths ``l <= depth - k`` have no backward, except that, with
``first_window_full_backprop``, the tokens of window ordinal 0 of each
document keep theirs (``min(n, W - delta_l)`` tokens per row); fixed plans
(``dense``/``looped``) truncate whole depths. Truncated depths run their
first-window and other tokens as two packed streams (``executed`` mode counts
both).

Memory (:func:`memory_model`): weights, main gradients (fp32, megatron-core DDP
``grad_reduce_in_fp32``), Adam moments (+ fp32 master weights for bf16),
divided by the data-parallel size with the distributed optimizer, for the
parameters :func:`megatron_lol.model.params.count_parameters` counts (every
expert of every layer, shared experts, Foil's pass attention sets, Accordion's
gates and second-pass routers); and an estimate of the activations saved for
backward by the local implementation (one set per core execution).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.window_math import causal_pairs, window_lengths, window_offset, windowed_pairs  # noqa: F401
from megatron_lol.plan.windows import windows_of

PAIR_MODES = ("allowed", "executed")


# --------------------------------------------------------------------------- pairs
def sliding_pairs(n: int, window_size: int) -> int:
    """``sum_i min(i + 1, W)``."""
    w = min(n, window_size)
    return causal_pairs(w) + (n - w) * window_size


def chunked_pairs(tokens: int, window_size: int) -> int:
    """Score entries the chunked algorithm computes for a packed stream of ``tokens``."""
    return -(-tokens // window_size) * window_size * 2 * window_size if tokens > 0 else 0


def first_window_tokens(n: int, window_size: int, offset: int) -> int:
    """Tokens of window ordinal 0 of a document of ``n`` tokens."""
    return min(n, window_size - offset)


# ------------------------------------------------------------------------ counters
@dataclass
class Flops:
    """Matmul FLOPs by kind."""

    attention_proj: float = 0.0
    attention_scores: float = 0.0
    mlp: float = 0.0
    moe_router: float = 0.0
    router: float = 0.0  # LoL window routers
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return self.attention_proj + self.attention_scores + self.mlp + self.moe_router + self.router + self.lm_head

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(**{k: getattr(self, k) + getattr(other, k) for k in _FLOP_KEYS})

    def scaled(self, factor: float) -> "Flops":
        return Flops(**{k: getattr(self, k) * factor for k in _FLOP_KEYS})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


_FLOP_KEYS = ("attention_proj", "attention_scores", "mlp", "moe_router", "router", "lm_head")


@dataclass
class StepFlops:
    """FLOPs of one training (or forward-only) pass over ``batch x seq`` tokens."""

    forward: Flops
    backward: Flops
    parts: dict = field(default_factory=dict)  # part -> {"forward": Flops, "backward": Flops}
    tokens: int = 0
    depth: int = 0
    attention_pairs: str = "allowed"

    @property
    def total(self) -> float:
        return self.forward.total + self.backward.total

    def per_token(self) -> float:
        return self.total / max(1, self.tokens)

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict(),
            "per_token": self.per_token(),
            "tokens": self.tokens,
            "depth": self.depth,
            "attention_pairs": self.attention_pairs,
            "parts": {
                k: {"forward": v["forward"].total, "backward": v["backward"].total} for k, v in self.parts.items()
            },
        }


def _dims(model: ModelConfig):
    d = model.hidden_size
    nq = model.num_attention_heads
    nkv = model.num_query_groups or nq
    c = model.kv_channels if model.kv_channels is not None else d // nq
    return d, nq, nkv, c


def _is_moe(model: ModelConfig, where: str) -> bool:
    if model.moe.layers == "all":
        return True
    return model.moe.layers == "fixed" and where == "fixed"


def _num_experts(model: ModelConfig, where: str) -> int:
    """Routed experts of an MoE layer: the core's own count in the blocks (Foil), else ``num_experts``."""
    if where == "block" and model.core_experts is not None:
        return model.core_experts
    return model.moe.num_experts


def layer_token_flops(model: ModelConfig, tokens: int, where: str = "fixed") -> Flops:
    """Forward matmul FLOPs of one layer's projections (attention + MLP) on ``tokens`` tokens.

    ``where``: ``"fixed"`` (prelude / coda) or ``"block"`` (a core block).
    """
    d, nq, nkv, c = _dims(model)
    proj = 2 * tokens * d * (nq * c + 2 * nkv * c) + 2 * tokens * (nq * c) * d
    if _is_moe(model, where):
        E = _num_experts(model, where)
        f = model.moe.ffn_hidden_size if model.moe.ffn_hidden_size is not None else model.ffn_hidden
        k = min(model.moe.router_topk, E)
        mlp = k * 6 * tokens * d * f
        if model.moe.shared_expert_intermediate_size:
            mlp += 6 * tokens * d * model.moe.shared_expert_intermediate_size
        return Flops(attention_proj=proj, mlp=mlp, moe_router=2 * tokens * d * E)
    return Flops(attention_proj=proj, mlp=6 * tokens * d * model.ffn_hidden)


def default_depth(model: ModelConfig) -> int:
    """The core steps a config runs when no depth is given (Accordion: its fixed budget, else the largest)."""
    return model.execution_plan().depth_for(None)


def score_flops(model: ModelConfig, pairs: int) -> Flops:
    """``Q K^T`` and ``A V`` for ``pairs`` (query, key) pairs, all heads."""
    _, nq, _, c = _dims(model)
    return Flops(attention_scores=4 * pairs * nq * c)


def forward_flops(
    model: ModelConfig,
    vocab_size: int,
    seq: int,
    batch: int = 1,
    depth: Optional[int] = None,
    attention_pairs: str = "allowed",
    training: bool = False,
    streams_per_depth: int = 1,
) -> StepFlops:
    """Forward FLOPs of a micro-batch ``[batch, seq]`` (no backward)."""
    return _flops(
        model,
        vocab_size,
        seq,
        batch,
        depth=depth,
        mode=attention_pairs,
        training=training,
        backward=False,
        backprop_depth=None,
        first_window_full_backprop=True,
        streams_per_depth=streams_per_depth,
    )


def training_flops(
    model: ModelConfig,
    vocab_size: int,
    seq: int,
    batch: int = 1,
    *,
    depth: Optional[int] = None,
    attention_pairs: str = "allowed",
    backprop_depth: Optional[int] = None,
    first_window_full_backprop: bool = True,
    streams_per_depth: int = 1,
) -> StepFlops:
    """Forward + backward FLOPs of ``batch`` sequences of ``seq`` tokens at core depth ``depth``."""
    return _flops(
        model,
        vocab_size,
        seq,
        batch,
        depth=depth,
        mode=attention_pairs,
        training=True,
        backward=True,
        backprop_depth=backprop_depth,
        first_window_full_backprop=first_window_full_backprop,
        streams_per_depth=streams_per_depth,
    )


def training_flops_per_step(
    cfg,
    depth: Optional[int],
    global_batch: int,
    seq: int,
    vocab_size: Optional[int] = None,
    attention_pairs: str = "allowed",
    budgets: Optional[list] = None,
) -> float:
    """Model FLOPs of one optimizer step of an :class:`ExperimentConfig` (all ranks together).

    What the trainer's log line divides by step time and device count for
    TFLOP/s per device (and by the device's peak for MFU). ``vocab_size``:
    the padded size the model is built with (default ``cfg.model.vocab_size``).

    Plan accordion samples one budget per micro-batch: ``budgets`` lists the
    budgets of the step's micro-batches (``global_batch / len(budgets)``
    sequences each; on one rank's view, the budget of each accumulation step
    is the same on every data-parallel rank), and the step's FLOPs are their
    sum. Without ``budgets`` and without ``depth``, a fixed ``model.plan.budget``
    is used, else the expectation under uniform sampling (the mean over
    ``model.plan.budgets``); an explicit ``depth`` counts every sequence at that depth.
    """
    vocab = vocab_size if vocab_size is not None else cfg.model.vocab_size
    if vocab is None:
        raise ValueError("training_flops_per_step: pass vocab_size (model.vocab_size is not set)")
    cur, m = cfg.curriculum, cfg.model

    def at(d: Optional[int], batch: float) -> float:
        return (
            training_flops(
                m,
                vocab,
                seq,
                1,
                depth=d,
                attention_pairs=attention_pairs,
                backprop_depth=cur.backprop_depth,
                first_window_full_backprop=cur.first_window_full_backprop,
            ).total
            * batch
        )

    plan = m.execution_plan()
    if plan.has_budgets and depth is None:
        if budgets:
            per = global_batch / len(budgets)
            return sum(at(plan.depth_for(k), per) for k in budgets)
        if m.plan.budget is None:
            return sum(at(plan.depth_for(k), global_batch) for k in plan.budgets) / len(plan.budgets)
    return training_flops(
        m,
        vocab,
        seq,
        global_batch,
        depth=depth,
        attention_pairs=attention_pairs,
        backprop_depth=cur.backprop_depth,
        first_window_full_backprop=cur.first_window_full_backprop,
    ).total


def _flops(
    model: ModelConfig,
    vocab: int,
    seq: int,
    batch: int,
    *,
    depth: Optional[int],
    mode: str,
    training: bool,
    backward: bool,
    backprop_depth: Optional[int],
    first_window_full_backprop: bool,
    streams_per_depth: int,
) -> StepFlops:
    if mode not in PAIR_MODES:
        raise ValueError(f"attention_pairs must be one of {PAIR_MODES} (got {mode!r})")
    plan = model.execution_plan()
    full_depth = plan.depth
    depth = plan.depth_for(None) if depth is None else depth
    lowest = plan.depth_for(min(plan.budgets)) if plan.has_budgets else 0  # budget 0 runs the whole window
    if not lowest <= depth <= full_depth:
        raise ValueError(f"depth must be in [{lowest}, {full_depth}] (got {depth})")
    T = batch * seq
    W = windows_of(model).size
    d = model.hidden_size
    L = plan.num_stored_blocks

    def fixed_layer_scores() -> int:
        return batch * (seq * seq if mode == "executed" else causal_pairs(seq))

    parts: dict = {}
    # prelude / coda: full causal attention inside documents
    fixed_fwd = layer_token_flops(model, T, "fixed") + score_flops(model, fixed_layer_scores())
    parts["prelude"] = {
        "forward": fixed_fwd.scaled(model.n_prelude),
        "backward": fixed_fwd.scaled(2 * model.n_prelude if backward else 0),
    }
    parts["coda"] = {
        "forward": fixed_fwd.scaled(model.n_coda),
        "backward": fixed_fwd.scaled(2 * model.n_coda if backward else 0),
    }
    head = Flops(lm_head=2 * T * d * vocab)
    parts["head"] = {"forward": head, "backward": head.scaled(2 if backward else 0)}

    core_f, core_b = Flops(), Flops()
    for step in plan.steps(depth):
        l, routed, windowed = step.depth, step.routed, step.windowed
        delta = window_offset(l, W, windows_of(model).shift)
        truncated = backward and backprop_depth is not None and l <= depth - backprop_depth
        if windowed:
            allowed = batch * windowed_pairs(seq, W, delta)
        elif step.attention == "sliding":
            allowed = batch * sliding_pairs(seq, W)
        else:
            allowed = batch * causal_pairs(seq)
        proj = layer_token_flops(model, T, "block")
        # tokens (and their score pairs) that get a backward at this depth
        if not backward:
            grad_tokens, grad_allowed = 0, 0
        elif not truncated:
            grad_tokens, grad_allowed = T, allowed
        elif routed and first_window_full_backprop:
            t0 = first_window_tokens(seq, W, delta)
            grad_tokens, grad_allowed = batch * t0, batch * causal_pairs(t0)
        else:
            grad_tokens, grad_allowed = 0, 0
        if mode == "allowed":
            fwd_pairs, grad_pairs = allowed, grad_allowed
        elif windowed:
            streams = max(1, streams_per_depth) if routed else 1

            def executed(tokens: int) -> float:
                # each of ``streams`` packed streams is padded to a multiple of W:
                # on average half a chunk more per extra stream
                if tokens <= 0:
                    return 0
                extra = (min(streams, tokens) - 1) * W * W  # (streams - 1) / 2 chunks of W x 2W
                return chunked_pairs(tokens, W) + extra

            if truncated and routed and grad_tokens:
                fwd_pairs = executed(grad_tokens) + executed(T - grad_tokens)
            else:
                fwd_pairs = executed(T)
            grad_pairs = executed(grad_tokens) if grad_tokens else 0
        else:
            fwd_pairs = batch * seq * seq
            grad_pairs = fwd_pairs if grad_tokens else 0
        core_f = core_f + proj + score_flops(model, fwd_pairs)
        if grad_tokens:
            core_b = (
                core_b
                + layer_token_flops(model, grad_tokens, "block").scaled(2)
                + score_flops(model, grad_pairs).scaled(2)
            )
        if routed:
            n_windows = batch * len(window_lengths(seq, W, delta))
            r = 2 * n_windows * d * L
            if training and model.plan.routing.router_noise:
                r += 2 * n_windows * L * L
            core_f = core_f + Flops(router=r)
            if grad_tokens:
                grad_windows = n_windows if not truncated else batch
                core_b = core_b + Flops(router=2 * r * grad_windows / n_windows)
    parts["core"] = {"forward": core_f, "backward": core_b}
    fwd = parts["prelude"]["forward"] + core_f + parts["coda"]["forward"] + head
    bwd = parts["prelude"]["backward"] + core_b + parts["coda"]["backward"] + parts["head"]["backward"]
    return StepFlops(forward=fwd, backward=bwd, parts=parts, tokens=T, depth=depth, attention_pairs=mode)


def dense_equivalent(model: ModelConfig, depth: Optional[int] = None) -> ModelConfig:
    """A dense GPT with the same width and the same number of executed layers, full attention.

    MoE layers keep their experts (the core's count, e.g. Foil's ``E``, in the core); Foil's
    untied attention and Accordion's loop settings are dropped (neither changes the FLOPs).
    """
    import dataclasses

    plan = model.execution_plan()
    depth = plan.depth_for(None) if depth is None else depth
    over = dict(
        plan={"kind": "dense", "layers": depth},
        dense_attention="full",
        moe=dataclasses.replace(model.moe, core_num_experts=plan.core_experts if model.moe.layers == "all" else None),
    )
    return dataclasses.replace(model, **over)


# --------------------------------------------------------------------------- memory
@dataclass
class MemoryEstimate:
    """Bytes per device (estimate)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def memory_model(
    model: ModelConfig,
    vocab_size: int,
    seq: int,
    micro_batch: int,
    *,
    depth: Optional[int] = None,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    distributed_optimizer: bool = False,
    recompute: Optional[str] = None,
    backprop_depth: Optional[int] = None,
) -> MemoryEstimate:
    """Per-device bytes of a training step (TP divides weights and activations evenly; PP ignored).

    Activations are those the local implementation saves for backward, per
    layer execution and token: the residual input, both norm outputs, QKV, the
    attention output, the SwiGLU input / output (``d, d, d, (nq + 2 nkv) c,
    nq c, d, 2f, f`` elements; an MoE layer: ``f`` = the top-k experts' hidden plus the
    shared expert's) plus, per executed score entry and head, the
    fp32 softmax output, its cast copy and the boolean mask. A routed (LoL)
    depth's gated combine also keeps its input and the block outputs (``2 d``;
    the CPU backend's fused combine; the reference keeps about as much). Truncated depths save
    nothing (their update runs without autograd); ``recompute: full`` keeps one ``d``-vector per
    layer and token.
    """
    from megatron_lol.model.params import count_parameters

    counts = count_parameters(model, vocab_size)
    bf16 = model.precision.params_dtype == "bf16"
    pbytes = 2 if bf16 else 4
    params = counts.total / tensor_parallel
    weights = params * pbytes
    gradients = params * 4
    opt = params * (8 + (4 if bf16 else 0))
    if distributed_optimizer:
        opt /= data_parallel
    d, nq, nkv, c = _dims(model)
    f = model.ffn_hidden
    if _is_moe(model, "block") and model.moe.num_experts:
        f = (model.moe.ffn_hidden_size or f) * min(model.moe.router_topk, _num_experts(model, "block"))
        f += model.moe.shared_expert_intermediate_size or 0
    per_token = (4 * d + (nq + 2 * nkv) * c + nq * c + 3 * f) * pbytes / tensor_parallel
    T = micro_batch * seq
    depth = model.execution_plan().depth_for(None) if depth is None else depth
    exec_fixed = micro_batch * seq * seq
    W = windows_of(model).size
    plan = model.execution_plan()
    exec_core = chunked_pairs(T, W) if plan.gathers_sequence else micro_batch * seq * seq
    score_bytes = (4 + pbytes + 1) * nq / tensor_parallel
    n_fixed = model.n_prelude + model.n_coda
    grad_depths = depth if backprop_depth is None else min(depth, backprop_depth)
    if recompute == "full":
        acts = (n_fixed + grad_depths) * T * d * pbytes
    else:
        combine = 2 * d * pbytes / tensor_parallel if plan.routed else 0
        acts = n_fixed * (T * per_token + exec_fixed * score_bytes) + grad_depths * (
            T * (per_token + combine) + exec_core * score_bytes
        )
    logits = T * vocab_size / tensor_parallel * (pbytes + 4 + 4)  # logits, fp32 copy, softmax grad
    return MemoryEstimate(weights=weights, gradients=gradients, optimizer=opt, activations=acts, logits=logits)


def format_flops(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}FLOP"
    return f"{x:.0f} FLOP"


__all__ = [
    "Flops",
    "StepFlops",
    "MemoryEstimate",
    "PAIR_MODES",
    "causal_pairs",
    "windowed_pairs",
    "sliding_pairs",
    "chunked_pairs",
    "window_lengths",
    "window_offset",
    "first_window_tokens",
    "layer_token_flops",
    "score_flops",
    "default_depth",
    "forward_flops",
    "training_flops",
    "training_flops_per_step",
    "dense_equivalent",
    "memory_model",
    "format_flops",
]
