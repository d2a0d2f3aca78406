"""Parallel layouts of a config for an allocation, ranked: ``megatron-lol plan-layout``.

A config is written for one cluster: ``micro_batch_size x data-parallel size``
must divide ``global_batch_size`` (the dry run's check), so the paper's 1,040
sequences per step fit 8 or 40 data-parallel ranks but not 32 or 128. Given
``nodes x gpus_per_node`` devices of ``device_bytes`` memory, the planner
enumerates the layouts the trainer accepts and proposes the best ones:

* **structure**: tensor parallelism (dividing the attention heads and KV
  groups, within a node), pipeline parallelism and its virtual stages (plans
  that allow it; :func:`~megatron_lol.plan.stages.check_pipeline_layout`),
  expert parallelism (LoL's block library, or the MoE experts: the divisors the
  config validation accepts), data parallelism the rest of the world;
* **batch**: the global batch nearest the config's that a data-parallel size
  allows (a multiple of it), and every micro-batch dividing its share;
* **memory** per device from :mod:`megatron_lol.perf.memory` (the worst pipeline
  stage), escalating from the config's settings to the distributed optimizer,
  then full recomputation, until it fits in :data:`USABLE_FRACTION` of the
  device (the rest is left to the CUDA context, NCCL's buffers and the
  allocator's fragmentation, which the estimator does not count).

Ranking, first to last key: fits; global batch within ``batch_tolerance`` of
the config's (else the deviation itself); estimated tokens/s per device (the
FLOP model, :mod:`megatron_lol.perf.flops`, at one assumed MFU for every layout,
slowed by the pipeline bubble ``(pp - 1) / (micro-batches x virtual stages)``
and by 4/3 for full recomputation); fewer model-parallel ranks (TP x PP, then
EP: the FLOP model does not see their communication, so the simpler layout wins
a tie); the smaller batch deviation; the micro-batch nearest the config's; the
fewest changed settings. Tokens/s per device depends on the layout only through
those factors: it is a ranking aid, not a measurement (``megatron-lol profile``
measures).

A changed global batch changes the tokens per step by ``r = new / old``; every
setting counted in iterations is rescaled by ``1 / r`` so that the run, its
schedule and its checkpoints see the same numbers of tokens
(:data:`ITERATION_KEYS`): ``train_iters``, the learning-rate warm-up and WSD
decay, the evaluation and save intervals, ``exit_interval``, and
``eval_iters`` (rounded up: at least as many validation sequences). The
growing-depth period and the balancing-bias stop are fractions of
``train_iters`` and follow it; ``log_interval`` and the profiler's steps are
left alone. A FLOP budget (``training.train_flops``) is kept: the trainer derives
the iterations from it at the new batch. The learning rate is not rescaled.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_lol.config.schema import ExperimentConfig
from megatron_lol.errors import ConfigError

USABLE_FRACTION = 0.9  # of a device's memory a proposal may fill
RECOMPUTE_SLOWDOWN = 4 / 3  # full recomputation runs each layer's forward twice: 4 instead of 3 forward passes

# iteration-valued settings, rescaled with the global batch: (dotted key, how to round)
ITERATION_KEYS = (
    ("training.train_iters", "round"),
    ("optimizer.lr_warmup_iters", "round"),
    ("optimizer.lr_wsd_decay_iters", "round"),
    ("training.eval_interval", "round"),
    ("training.save_interval", "round"),
    ("training.exit_interval", "round"),
    ("training.eval_iters", "ceil"),
)

LAYOUT_KEYS = {
    "tp": "parallel.tensor_model_parallel_size",
    "pp": "parallel.pipeline_model_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size",
    "ep": "parallel.expert_model_parallel_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "distributed_optimizer": "parallel.use_distributed_optimizer",
    "recompute": "parallel.recompute_granularity",
    "recompute_method": "parallel.recompute_method",
    "micro_batch": "training.micro_batch_size",
    "global_batch": "training.global_batch_size",
}


@dataclass
class Target:
    """The allocation a plan is for."""

    nodes: int
    gpus_per_node: int
    device_bytes: float
    mfu: float = 0.35
    peak_tflops: float = 989.4  # H100 SXM, BF16 dense (perf/peaks.py)
    batch_tolerance: float = 0.05

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Proposal:
    """One layout, its estimates and the settings it changes (dotted key -> (config's, proposed))."""

    tp: int
    pp: int
    vpp: Optional[int]
    ep: int
    dp: int
    micro_batch: int
    global_batch: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: Optional[str]
    memory_bytes: float  # the worst pipeline stage's estimate
    fits: bool
    step_seconds: float
    tokens_per_s_per_gpu: float
    batch_deviation: float  # (proposed - config's) / config's global batch
    changes: dict = field(default_factory=dict)
    train_iters: Optional[int] = None  # of the proposal (derived from the FLOP budget when there is one)
    tokens: Optional[int] = None  # total training tokens of the proposal
    config_tokens: Optional[int] = None

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["changes"] = {k: list(v) for k, v in self.changes.items()}
        return d


# ------------------------------------------------------------------ small helpers
def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def get_dotted(cfg: ExperimentConfig, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def set_dotted_attr(cfg: ExperimentConfig, key: str, value) -> None:
    section, name = key.split(".", 1)
    setattr(getattr(cfg, section), name, value)


def frozen_plan(cfg: ExperimentConfig) -> ExperimentConfig:
    """A copy of ``cfg`` whose model answers ``execution_plan()`` from one build.

    The plan is a function of the model's fields, which the planner never
    changes; building it anew for each of the memory estimator's calls was most
    of a search's time.
    """
    model = copy.deepcopy(cfg.model)
    plan = model.execution_plan()
    object.__setattr__(model, "execution_plan", lambda prefix="model": plan)
    return dataclasses.replace(cfg, model=model)


def with_layout(cfg: ExperimentConfig, **values) -> ExperimentConfig:
    """A shallow copy of ``cfg`` with new parallel / training sections (the model is shared, read-only)."""
    par = dataclasses.replace(cfg.parallel)
    tr = dataclasses.replace(cfg.training)
    out = dataclasses.replace(cfg, parallel=par, training=tr)
    for name, value in values.items():
        set_dotted_attr(out, LAYOUT_KEYS[name], value)
    return out


def layout_error(cfg: ExperimentConfig, world: int) -> Optional[str]:
    """What ``train --dry-run`` says of ``cfg``'s layout and batch at ``world`` ranks (None: it passes).

    The same checks in the same order: the parallel section against the model,
    the pipeline cut, the data-parallel size, the global batch against
    ``micro_batch_size x data-parallel size``.
    """
    from megatron_lol.plan.stages import check_pipeline_layout

    par, tr = cfg.parallel, cfg.training
    try:
        par.validate(cfg.model)
        plan = cfg.model.execution_plan()
        check_pipeline_layout(
            cfg.model,
            plan.depth,
            par.pipeline_model_parallel_size,
            par.virtual_pipeline_model_parallel_size,
            plan.name,
            plan.pipeline_ok,
        )
        dp = par.data_parallel_size(world)
    except ConfigError as err:
        return str(err)
    gbs = tr.global_batch_size or tr.micro_batch_size * dp
    if gbs % (tr.micro_batch_size * dp):
        return (
            f"training.global_batch_size: {gbs} is not a multiple of micro_batch_size x "
            f"data_parallel_size = {tr.micro_batch_size * dp} (world size {world})"
        )
    return None


def memory_bytes(cfg: ExperimentConfig, vocab: int, world: int) -> float:
    """The worst pipeline stage's per-device estimate (:mod:`megatron_lol.perf.memory`)."""
    from megatron_lol.perf.memory import Layout, rank_memory

    layout = Layout.of(cfg, world)
    return max(rank_memory(cfg, vocab, layout, r).total for r in range(layout.pp))


def run_length(cfg: ExperimentConfig, vocab: int) -> tuple[int, float]:
    """(iterations, training FLOPs) of the run ``cfg`` describes (a FLOP budget's iterations derived)."""
    from megatron_lol.perf.budget import RunFlops

    run = RunFlops(cfg, vocab)
    iters = (
        run.iterations_for(cfg.training.train_flops)
        if cfg.training.train_flops is not None
        else cfg.training.train_iters
    )
    return iters, run(iters)


# ------------------------------------------------------------------ rescaling
def rescaled(cfg: ExperimentConfig, global_batch: int) -> dict:
    """The iteration-valued settings of ``cfg`` at ``global_batch`` (:data:`ITERATION_KEYS`), as
    ``{key: (config's, new)}`` for those that change."""
    old = cfg.training.global_batch_size
    if old is None or old == global_batch:
        return {}
    ratio = old / global_batch
    out = {}
    for key, how in ITERATION_KEYS:
        value = get_dotted(cfg, key)
        if value is None or (key == "training.train_iters" and cfg.training.train_flops is not None):
            continue
        if value == 0:
            continue  # no warm-up stays none
        new = math.ceil(value * ratio) if how == "ceil" else max(1, round(value * ratio))
        if new != value:
            out[key] = (value, new)
    return out


def derived_config(cfg: ExperimentConfig, changes: dict) -> ExperimentConfig:
    """A deep copy of ``cfg`` with ``changes`` (``{key: (old, new)}``) applied."""
    out = copy.deepcopy(cfg)
    for key, (_, new) in changes.items():
        set_dotted_attr(out, key, new)
    return out


# ------------------------------------------------------------------ search
def _structures(cfg: ExperimentConfig, target: Target) -> list:
    """(tp, pp, vpp, ep, dp) the trainer accepts at ``target.world`` ranks, simplest first
    (fewest model-parallel ranks, then expert-parallel ranks, then virtual stages)."""
    m, plan = cfg.model, cfg.model.execution_plan()
    world = target.world
    kv = m.num_query_groups or m.num_attention_heads
    tps = [t for t in divisors(m.num_attention_heads) if kv % t == 0 and t <= max(1, target.gpus_per_node)]
    pps = [1] + ([p for p in range(2, 33) if world % p == 0] if plan.pipeline_ok else [])
    if plan.shards_library:
        ep_pool = plan.num_stored_blocks
    elif m.moe.layers != "none" and m.moe.num_experts:
        ep_pool = math.gcd(m.moe.num_experts, plan.core_experts or m.moe.num_experts)
    else:
        ep_pool = 1
    out = []
    for tp in tps:
        for pp in pps:
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for vpp in [None] + ([2, 4] if pp > 1 else []):
                for ep in divisors(ep_pool):
                    if (dp * tp) % ep:
                        continue
                    probe = with_layout(
                        cfg, tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=tp > 1, micro_batch=1, global_batch=dp
                    )
                    if layout_error(probe, world) is None:
                        out.append((tp, pp, vpp, ep, dp))
    return sorted(out, key=lambda s: (s[0] * s[1], s[3], s[2] or 0, s[1]))


def _global_batches(target_batch: int, dp: int) -> list:
    """The multiples of ``dp`` nearest ``target_batch`` (both when they are as near)."""
    lo = (target_batch // dp) * dp
    hi = lo + dp
    if lo == 0:
        return [dp]
    if lo == target_batch:
        return [lo]
    d_lo, d_hi = target_batch - lo, hi - target_batch
    return [lo] if d_lo < d_hi else [hi] if d_hi < d_lo else [lo, hi]


def _micro_batches(share: int, config_mbs: int, pp: int) -> list:
    """Micro-batches dividing a data-parallel rank's ``share`` of the batch, in order of preference:
    under PP the smallest first (the most micro-batches, the smallest bubble), else the nearest the
    config's (larger first on a tie)."""
    options = [d for d in divisors(share) if d <= 4 * config_mbs] or [1]
    if pp > 1:
        return options
    return sorted(options, key=lambda d: (abs(math.log(d / config_mbs)), -d))


class _Search:
    """The state of one :func:`plan_layouts` search."""

    def __init__(self, cfg: ExperimentConfig, target: Target, vocab: int, base_batch: int, flops_per_sequence: float):
        self.cfg, self.target, self.vocab = cfg, target, vocab
        self.base_batch, self.flops_per_sequence = base_batch, flops_per_sequence
        self.usable = USABLE_FRACTION * target.device_bytes
        par = cfg.parallel
        # settings tried in turn until a layout fits: the config's, the distributed optimizer, full recomputation
        self.settings = list(
            dict.fromkeys(
                [
                    (par.use_distributed_optimizer, par.recompute_granularity),
                    (True, par.recompute_granularity),
                    (True, "full"),
                ]
            )
        )

    def proposal(self, structure: tuple, gbs: int, mbs: int, dopt: bool, recompute: Optional[str]) -> Proposal:
        tp, pp, vpp, ep, dp = structure
        cfg, par, target = self.cfg, self.cfg.parallel, self.target
        c = with_layout(
            cfg,
            tp=tp,
            pp=pp,
            vpp=vpp,
            ep=ep,
            sequence_parallel=tp > 1,
            distributed_optimizer=dopt,
            recompute=recompute,
            recompute_method=par.recompute_method if recompute == "full" else None,
            micro_batch=mbs,
            global_batch=gbs,
        )
        mem = memory_bytes(c, self.vocab, target.world)
        micro_batches = gbs // (dp * mbs)
        bubble = (pp - 1) / (micro_batches * (vpp or 1)) if pp > 1 else 0.0
        slow = (1 + bubble) * (RECOMPUTE_SLOWDOWN if recompute == "full" else 1.0)
        step = self.flops_per_sequence * gbs / (target.world * target.peak_tflops * 1e12 * target.mfu) * slow
        return Proposal(
            tp=tp,
            pp=pp,
            vpp=vpp,
            ep=ep,
            dp=dp,
            micro_batch=mbs,
            global_batch=gbs,
            sequence_parallel=tp > 1,
            distributed_optimizer=dopt,
            recompute=recompute,
            memory_bytes=mem,
            fits=mem <= self.usable,
            step_seconds=step,
            tokens_per_s_per_gpu=gbs * cfg.training.seq_length / step / target.world,
            batch_deviation=(gbs - self.base_batch) / self.base_batch,
            changes=_layout_changes(cfg, c),
        )

    def for_structure(self, structure: tuple) -> list:
        """The best proposal of each global batch for one structure: the first micro-batch (in order of
        preference) that fits with the fewest escalated settings; the smallest estimate when none fits."""
        dp, pp = structure[4], structure[1]
        out = []
        for gbs in _global_batches(self.base_batch, dp):
            smallest = None
            found = None
            for dopt, recompute in self.settings:
                if dopt and dp == 1 and not self.cfg.parallel.use_distributed_optimizer:
                    continue
                for mbs in _micro_batches(gbs // dp, self.cfg.training.micro_batch_size, pp):
                    p = self.proposal(structure, gbs, mbs, dopt, recompute)
                    if p.fits:
                        found = p
                        break
                    if smallest is None or p.memory_bytes < smallest.memory_bytes:
                        smallest = p
                if found is not None:
                    break
            out.append(found or smallest)
        return out


def plan_layouts(cfg: ExperimentConfig, target: Target, vocab: int, top: int = 5) -> list:
    """The ``top`` best :class:`Proposal` for ``target`` (see the module docstring for the ranking),
    each checked as the dry run checks it. ``cfg``'s ``params_dtype`` is the one to estimate in.

    Structures are explored simplest first; once ``top`` proposals that fit, keep the batch within
    the tolerance and run at the model's full speed (no bubble, no recomputation) are found, layouts
    with more model-parallel ranks are not explored (none could rank above them)."""
    if target.world < 1:
        raise ConfigError(f"plan-layout: the allocation has no device ({target.nodes} x {target.gpus_per_node})")
    cfg = frozen_plan(cfg)
    tr, par = cfg.training, cfg.parallel
    base_batch = tr.global_batch_size
    no_batch = base_batch is None
    if no_batch:  # a config without a global batch: micro-batch x the world's data parallelism
        base_batch = tr.micro_batch_size * max(
            1, target.world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
        )
        cfg = with_layout(cfg, global_batch=base_batch)
    iters, flops = run_length(cfg, vocab)
    search = _Search(cfg, target, vocab, base_batch, flops / (iters * base_batch))
    candidates: list = []
    perfect_at = None  # the model-parallel size where the top-th full-speed proposal was found
    for structure in _structures(cfg, target):
        mp = structure[0] * structure[1]
        if perfect_at is not None and mp > perfect_at:
            break
        candidates += search.for_structure(structure)
        perfect = [
            p
            for p in candidates
            if p.fits and abs(p.batch_deviation) <= target.batch_tolerance and p.pp == 1 and p.recompute != "full"
        ]
        if len(perfect) >= top and perfect_at is None:
            perfect_at = mp
    if no_batch:  # the config had no global batch: the proposal sets one
        for p in candidates:
            p.changes["training.global_batch_size"] = (None, p.global_batch)
    candidates.sort(key=lambda p: _rank_key(p, target, tr.micro_batch_size))
    out = []
    for p in candidates:
        _finish(cfg, p, vocab, iters, base_batch * tr.seq_length)
        if layout_error(derived_config(cfg, p.changes), target.world) is None:
            out.append(p)
        if len(out) == top:
            break
    return out


def _layout_changes(cfg: ExperimentConfig, proposed: ExperimentConfig) -> dict:
    out = {}
    for key in LAYOUT_KEYS.values():
        old, new = get_dotted(cfg, key), get_dotted(proposed, key)
        if old != new:
            out[key] = (old, new)
    return out


def _rank_key(p: Proposal, target: Target, config_mbs: int) -> tuple:
    dev = abs(p.batch_deviation)
    return (
        not p.fits,
        0.0 if dev <= target.batch_tolerance else dev,
        -float(f"{p.tokens_per_s_per_gpu:.6g}"),  # equal speeds compare equal whatever the float noise
        p.model_parallel,
        p.ep,
        p.vpp or 0,
        dev,
        abs(math.log(p.micro_batch / config_mbs)),
        len(p.changes),
        p.memory_bytes,
    )


def _finish(cfg: ExperimentConfig, p: Proposal, vocab: int, iters: int, tokens_per_step: int) -> None:
    """Add the rescaled iteration settings to ``p.changes`` and the run's token counts."""
    p.changes.update(rescaled(cfg, p.global_batch))
    p.config_tokens = iters * tokens_per_step
    if cfg.training.train_flops is not None:
        p.train_iters, _ = run_length(derived_config(cfg, p.changes), vocab)
    else:
        p.train_iters = p.changes.get("training.train_iters", (None, iters))[1]
    p.tokens = p.train_iters * p.global_batch * cfg.training.seq_length


__all__ = [
    "ITERATION_KEYS",
    "USABLE_FRACTION",
    "Proposal",
    "Target",
    "derived_config",
    "layout_error",
    "memory_bytes",
    "plan_layouts",
    "rescaled",
]
