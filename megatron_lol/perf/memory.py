"""Per-rank memory of a training layout, before the run: parameters, gradients, optimizer state, activations.

``megatron-lol memory --config F [layout flags]`` (and the layout section of
``megatron-lol params``) answer "does this fit" without building anything:
nothing is allocated and megatron-core is not imported. For every pipeline
rank (the ranks of one pipeline stage hold the same) it counts:

* **parameters** of the stage (:func:`rank_parameters`): the prelude / coda
  layers and core steps :func:`~megatron_lol.plan.stages.stage_layout` puts on
  it (every virtual chunk), the embedding on the first stage, the final norm
  and head on the last (a tied head keeps its copy there under PP, as
  megatron-core does); linear weights and the vocabulary split over TP (experts
  over EP x TP, a routed library's blocks over EP), norms, routers, depth
  vectors and gates replicated;
* **weights** in ``model.precision.params_dtype``; **gradients**: megatron-core DDP's
  FP32 gradient buffer (``grad_reduce_in_fp32``), 4 bytes each;
* **optimizer state**: AdamW's two FP32 moments, Muon's one momentum for its
  matrices (:func:`~megatron_lol.training.optimizer.is_muon_matrix`'s
  choice: attention / MLP matrices), plus FP32 master weights with BF16;
  divided over data parallelism by ``--use-distributed-optimizer`` (Adam's
  distributed optimizer, Muon's layer-wise one);
* **activations** saved for the backward of one micro-batch, per layer
  execution and token (:func:`layer_activation_bytes`), times the micro-batches
  in flight at the stage's peak: 1 without PP, ``min(pp - rank, micro-batches)``
  under 1F1B (interleaved: megatron-core's warm-up count, in chunks); sequence
  parallelism divides the residual-stream terms of the prelude / coda by TP
  (the routed core runs on the gathered sequence); full recomputation keeps only
  each layer's input;
* **logits** of the last stage: the head's output beside the FP32 copy
  megatron-core's cross entropy turns into its softmax (:func:`logits_bytes`);
  on other stages the peak comes in the **backward** of a layer instead, whose
  activation gradients exist while its saved tensors are still held (counted
  as the largest layer's activations).

The estimate is compared with measured CPU peaks for several layouts in
docs/performance.md (``bench/memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_lol.config.schema import ExperimentConfig
from megatron_lol.perf.flops import _dims, _is_moe, _num_experts, chunked_pairs
from megatron_lol.plan.windows import windows_of


@dataclass
class Layout:
    """The parallel layout and batch shape an estimate is for."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: Optional[str] = None
    micro_batch: int = 1
    seq: int = 1
    num_microbatches: int = 1

    @classmethod
    def of(cls, cfg: ExperimentConfig, world_size: Optional[int] = None) -> "Layout":
        """The layout of ``cfg`` on ``world_size`` ranks (default: the smallest world the layout needs)."""
        par, tr = cfg.parallel, cfg.training
        mp = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        world = (
            world_size
            if world_size is not None
            else mp * max(1, math.ceil(par.expert_model_parallel_size / par.tensor_model_parallel_size))
        )
        dp = par.data_parallel_size(world)
        gbs = tr.global_batch_size or tr.micro_batch_size * dp
        if gbs % (tr.micro_batch_size * dp):
            from megatron_lol.errors import ConfigError

            raise ConfigError(
                f"training.global_batch_size: {gbs} is not a multiple of micro_batch_size x "
                f"data_parallel_size = {tr.micro_batch_size * dp} (world size {world})"
            )
        return cls(
            tp=par.tensor_model_parallel_size,
            pp=par.pipeline_model_parallel_size,
            vpp=par.virtual_pipeline_model_parallel_size,
            ep=par.expert_model_parallel_size,
            dp=dp,
            sequence_parallel=par.sequence_parallel,
            distributed_optimizer=par.use_distributed_optimizer,
            recompute=par.recompute_granularity,
            micro_batch=tr.micro_batch_size,
            seq=tr.seq_length,
            num_microbatches=max(1, gbs // (tr.micro_batch_size * dp)),
        )

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class RankParameters:
    """Parameters one rank holds, split by who trains them."""

    muon: float = 0.0  # attention / MLP matrices (Muon's with optimizer.name: muon)
    other: float = 0.0  # everything else (embedding, head, norms, routers, ...)

    @property
    def total(self) -> float:
        return self.muon + self.other


@dataclass
class RankMemory:
    """Bytes one rank of pipeline stage ``pp_rank`` holds at its peak (estimate)."""

    pp_rank: int
    params: float  # parameters held (count)
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    backward: float  # a stage without the head: the activation gradients of one layer's backward
    in_flight: int  # micro-batches (interleaved: chunk micro-batches) whose activations are held
    parts: dict = field(default_factory=dict)  # activations per micro-batch: prelude / core / coda

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.backward

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


# ------------------------------------------------------------------ parameters
def _stage_items(cfg: ExperimentConfig, layout: Layout, pp_rank: int) -> list:
    """The (virtual) stage layouts of physical pipeline rank ``pp_rank``."""
    from megatron_lol.plan.stages import stage_layout

    depth = cfg.model.execution_plan().depth
    vpp = layout.vpp if layout.pp > 1 else None
    return [
        stage_layout(cfg.model, depth, layout.pp, vpp, pp_rank, chunk if vpp else None) for chunk in range(vpp or 1)
    ]


def rank_parameters(cfg: ExperimentConfig, vocab_size: int, layout: Layout, pp_rank: int = 0) -> RankParameters:
    """Parameters (counts, fractional under TP) a rank of pipeline stage ``pp_rank`` holds."""
    from megatron_lol.model.params import count_parameters

    m = cfg.model
    counts = count_parameters(m, vocab_size)
    plan = m.execution_plan()
    tp, ep = layout.tp, layout.ep
    d = m.hidden_size
    out = RankParameters()

    def layer(lc, blocks: float = 1.0, expert_split: float = 1.0) -> None:
        out.muon += blocks * (lc.attention + lc.mlp + lc.shared_expert) / tp
        out.muon += blocks * lc.experts / (tp * expert_split)
        out.other += blocks * (lc.norms + lc.moe_router)

    stages = _stage_items(cfg, layout, pp_rank)
    fixed_ep = ep if m.moe.layers != "none" and not plan.shards_library else 1
    hosts_core = False
    for st in stages:
        for _ in st.prelude:
            layer(counts.prelude_layer, expert_split=fixed_ep)
        for _ in st.coda:
            layer(counts.coda_layer, expert_split=fixed_ep)
        hosts_core = hosts_core or st.depths is not None
        if st.first:
            out.other += counts.embedding / tp
        if st.last:
            out.other += (counts.output or (counts.embedding if layout.pp > 1 else 0)) / tp + d  # head, final norm
    if hosts_core:
        library = plan.num_stored_blocks / (ep if plan.shards_library else 1)
        layer(counts.block, blocks=library, expert_split=1 if plan.shards_library else ep)
        sets = counts.pass_attention_sets  # Foil's per-pass attention: projections and an input norm each
        out.muon += sets * counts.block.attention / tp
        out.other += sets * d
        out.other += (
            counts.router
            + counts.depth_vectors
            + counts.film
            + counts.injection
            + counts.loop_gates
            + counts.second_pass_router
            + sum(counts.part_params.values())  # plug-in per-pass parts with categories of their own
        )
    return out


# ------------------------------------------------------------------ activations
def layer_activation_bytes(
    cfg: ExperimentConfig, layout: Layout, where: str, tokens: int, score_entries: float, attention: str
) -> float:
    """Bytes one layer execution saves for backward over ``tokens`` tokens of one micro-batch.

    ``where``: ``fixed`` (prelude / coda, sequence-parallel under SP) or ``block`` (the core).
    ``attention``: ``dense`` (``[b, heads, s, s]`` scores, the boolean mask shared by the heads)
    or ``chunked`` (packed windows: the keys / values of two chunks per query chunk).
    Per token (measured with autograd's saved-tensor hooks, bench/memory.py): the layer input and
    the residual after attention, each RMSNorm's normalised input and output (``6 d``, divided by
    TP under SP), QKV after RoPE (chunked: queries plus two chunks of keys and values), the
    attention output, the SwiGLU input, its SiLU and its output (``4 f``; MoE: top-k experts plus
    the shared expert); per score entry and head the FP32 softmax output (and its cast copy in BF16).
    """
    m = cfg.model
    pbytes = 2 if m.precision.params_dtype == "bf16" else 4
    tp = layout.tp
    d, nq, nkv, c = _dims(m)
    if layout.recompute == "full":
        residual = d / tp if (where == "fixed" and layout.sequence_parallel) else d
        return tokens * residual * pbytes
    f = m.ffn_hidden
    if _is_moe(m, where) and m.moe.num_experts:
        f = (m.moe.ffn_hidden_size or f) * min(m.moe.router_topk, _num_experts(m, where))
        f += m.moe.shared_expert_intermediate_size or 0
    residual = 6 * d / (tp if (where == "fixed" and layout.sequence_parallel) else 1)
    kv = 2 * nkv * c * (2 if attention == "chunked" else 1)
    per_token = (residual + (nq * c + kv + nq * c + 4 * f) / tp) * pbytes
    per_entry = (4 + (pbytes if pbytes != 4 else 0)) * nq / tp
    mask = 1 if attention == "dense" else 0  # [b, 1, s, s] booleans, shared by the heads
    return tokens * per_token + score_entries * (per_entry + mask)


def microbatch_activations(cfg: ExperimentConfig, layout: Layout, pp_rank: int = 0) -> dict:
    """Bytes of activations one micro-batch leaves on pipeline stage ``pp_rank``: prelude, core, coda."""
    m = cfg.model
    plan = m.execution_plan()
    b, s = layout.micro_batch, layout.seq
    T = b * s
    dense_entries = b * s * s
    pbytes = 2 if m.precision.params_dtype == "bf16" else 4
    backprop = cfg.curriculum.backprop_depth
    parts = {"prelude": 0.0, "core": 0.0, "coda": 0.0, "largest_layer": 0.0}
    for st in _stage_items(cfg, layout, pp_rank):
        fixed = layer_activation_bytes(cfg, layout, "fixed", T, dense_entries, "dense")
        parts["prelude"] += len(st.prelude) * fixed
        parts["coda"] += len(st.coda) * fixed
        if st.prelude or st.coda:
            parts["largest_layer"] = max(parts["largest_layer"], fixed)
        if st.depths is None:
            continue
        first, last = st.depths
        for step in plan.steps(plan.depth):
            if not first <= step.depth <= last:
                continue
            if backprop is not None and step.depth <= plan.depth - backprop:
                continue  # truncated: the update runs without autograd (first windows aside)
            chunked = step.windowed
            entries = chunked_pairs(T, windows_of(m).size) if chunked else dense_entries
            act = layer_activation_bytes(cfg, layout, "block", T, entries, "chunked" if chunked else "dense")
            if step.routed and layout.recompute != "full":
                act += 2 * T * m.hidden_size * pbytes  # the gated combine: the gathered rows and block outputs
            parts["core"] += act
            parts["largest_layer"] = max(parts["largest_layer"], act)
    return parts


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Micro-batches (interleaved: chunk micro-batches) whose activations a stage holds at its peak."""
    if layout.pp == 1:
        return 1
    if not layout.vpp:
        return min(layout.pp - pp_rank, layout.num_microbatches)
    total = layout.num_microbatches * layout.vpp
    warmup = (layout.pp - pp_rank - 1) * 2 + (layout.vpp - 1) * layout.pp
    return min(warmup + 1, total)


def logits_bytes(cfg: ExperimentConfig, vocab_size: int, layout: Layout) -> float:
    """The last stage's head at its peak, inside megatron-core's cross entropy: the logits in the
    weights' dtype beside their FP32 max-shifted copy (which becomes the softmax it keeps, and in
    place its gradient; BF16 logits also get an FP32 copy first), plus the final norm's saved
    input and output (vocabulary split over TP)."""
    pbytes = 2 if cfg.model.precision.params_dtype == "bf16" else 4
    tokens = layout.micro_batch * layout.seq
    entries = tokens * vocab_size / layout.tp
    return entries * (pbytes + 4 + (4 if pbytes != 4 else 0)) + 2 * tokens * cfg.model.hidden_size * pbytes


def rank_memory(cfg: ExperimentConfig, vocab_size: int, layout: Layout, pp_rank: int = 0) -> RankMemory:
    """The estimate for one rank of pipeline stage ``pp_rank`` (see the module docstring)."""
    params = rank_parameters(cfg, vocab_size, layout, pp_rank)
    bf16 = cfg.model.precision.params_dtype == "bf16"
    weights = params.total * (2 if bf16 else 4)
    gradients = params.total * 4
    muon = cfg.optimizer.name == "muon"
    state = params.muon * (4 if muon else 8) + params.other * 8 + (params.total * 4 if bf16 else 0)
    if layout.distributed_optimizer:
        state /= layout.dp
    parts = microbatch_activations(cfg, layout, pp_rank)
    chunks = in_flight(layout, pp_rank)
    per = parts["prelude"] + parts["core"] + parts["coda"]
    if layout.vpp and layout.pp > 1:
        per /= layout.vpp  # a chunk micro-batch holds one chunk's layers
    last = any(st.last for st in _stage_items(cfg, layout, pp_rank))
    logits = logits_bytes(cfg, vocab_size, layout) if last else 0.0
    # the peak beyond the saved activations: the head's cross entropy on the last stage, else the backward
    # of one layer, whose activation gradients exist while its saved tensors are still held
    backward = 0.0 if last or layout.recompute == "full" else parts["largest_layer"]
    return RankMemory(
        pp_rank=pp_rank,
        params=params.total,
        weights=weights,
        gradients=gradients,
        optimizer=state,
        activations=per * chunks,
        logits=logits,
        backward=backward,
        in_flight=chunks,
        parts=parts,
    )


def estimate(cfg: ExperimentConfig, vocab_size: int, world_size: Optional[int] = None) -> list:
    """:class:`RankMemory` of every pipeline stage of ``cfg`` on ``world_size`` ranks."""
    layout = Layout.of(cfg, world_size)
    return [rank_memory(cfg, vocab_size, layout, r) for r in range(layout.pp)]


def layout_given(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg`` asks for more than one process's layout (``params`` then adds the per-rank section)."""
    par = cfg.parallel
    return (
        par.tensor_model_parallel_size > 1
        or par.pipeline_model_parallel_size > 1
        or par.expert_model_parallel_size > 1
        or par.use_distributed_optimizer
        or par.sequence_parallel
        or par.recompute_granularity is not None
    )


def per_rank_section(cfg: ExperimentConfig, vocab_size: int) -> tuple[str, list]:
    """``megatron-lol params``' per-rank lines for a layout: parameters and memory of every pipeline
    stage at the smallest world the layout needs (``megatron-lol memory --world-size`` for others)."""
    layout = Layout.of(cfg)
    ranks = [rank_memory(cfg, vocab_size, layout, r) for r in range(layout.pp)]
    lines = [
        "",
        f"  per rank (TP {layout.tp} x PP {layout.pp} x DP {layout.dp}"
        + (f", EP {layout.ep}" if layout.ep > 1 else "")
        + "; megatron-lol memory for other world sizes)",
    ]
    for r in ranks:
        lines.append(
            f"    stage {r.pp_rank}: {r.params:>14,.0f} parameters, weights {_gib(r.weights)}, gradients "
            f"{_gib(r.gradients)}, optimizer state {_gib(r.optimizer)}, activations {_gib(r.activations)}"
            + (f", logits {_gib(r.logits)}" if r.logits else f", one layer's backward {_gib(r.backward)}")
            + f"; total {_gib(r.total)}"
        )
    return "\n".join(lines), [r.to_dict() for r in ranks]


# ------------------------------------------------------------------ report
def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f} GiB" if x >= 2**30 else f"{x / 2**20:,.1f} MiB"


def device_memory_bytes() -> tuple[Optional[int], str]:
    """(bytes, what): the first CUDA device's memory when torch sees one, else this machine's RAM."""
    import os
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def format_estimate(
    cfg: ExperimentConfig, ranks: list, layout: Layout, device_bytes: Optional[float], device_name: str
) -> str:
    """The table ``megatron-lol memory`` prints: one column per pipeline stage."""
    par = (
        f"TP {layout.tp} x PP {layout.pp}"
        + (f" (virtual {layout.vpp})" if layout.vpp else "")
        + f" x DP {layout.dp}"
        + (f", EP {layout.ep}" if layout.ep > 1 else "")
        + (", SP" if layout.sequence_parallel else "")
        + (", distributed optimizer" if layout.distributed_optimizer else "")
        + (f", recompute {layout.recompute}" if layout.recompute else "")
    )
    head = (
        f"per-rank memory estimate: {par}; micro-batch {layout.micro_batch} x {layout.seq} tokens, "
        f"{layout.num_microbatches} micro-batch(es) per step, {cfg.model.precision.params_dtype}, "
        f"optimizer {cfg.optimizer.name}"
    )
    rows = [
        ("parameters", lambda r: f"{r.params / 1e6:,.2f}M"),
        ("weights", lambda r: _gib(r.weights)),
        ("gradients (fp32)", lambda r: _gib(r.gradients)),
        ("optimizer state", lambda r: _gib(r.optimizer)),
        ("activations", lambda r: f"{_gib(r.activations)} ({r.in_flight} in flight)"),
        ("logits (head)", lambda r: _gib(r.logits)),
        ("one layer's backward", lambda r: _gib(r.backward)),
        ("total", lambda r: _gib(r.total)),
    ]
    if device_bytes:
        rows.append((f"of {device_name} ({_gib(device_bytes)})", lambda r: f"{100 * r.total / device_bytes:.1f}%"))
    names = [f"stage {r.pp_rank}" if len(ranks) > 1 else "each rank" for r in ranks]
    width = max(len(n) for n, _ in rows) + 2
    cols = [max(len(names[i]), *(len(f(r)) for _, f in rows)) + 2 for i, r in enumerate(ranks)]
    lines = [head, "", f"  {'':<{width}}" + "".join(f"{n:>{w}}" for n, w in zip(names, cols))]
    for name, f in rows:
        lines.append(f"  {name:<{width}}" + "".join(f"{f(r):>{w}}" for r, w in zip(ranks, cols)))
    worst = max(ranks, key=lambda r: r.total)
    if device_bytes and worst.total > device_bytes:
        lines.append(f"  does not fit: stage {worst.pp_rank} needs {_gib(worst.total)} of {_gib(device_bytes)}")
    return "\n".join(lines)
