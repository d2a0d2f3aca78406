"""A run's training FLOPs, and the iterations a FLOP budget buys (``training.train_flops``).

Comparisons "at matched compute" (the LoL paper's 1B math runs: LoL and three
dense baselines at about 90 ExaFLOPs each) fix the training FLOPs, not the step
count: a growing core makes LoL's early steps cheap, so at one budget it takes
more steps than a dense model of the same stored size. With
``training.train_flops`` set, ``train_iters`` is derived: the largest ``N`` whose
run, counted by the FLOP model (:func:`megatron_lol.perf.flops.training_flops_per_step`,
model FLOPs with the allowed attention pairs), does not exceed the budget. The
run's steps are counted at the depths the growing curriculum gives them over a
run of ``N`` steps (:func:`megatron_lol.plan.curriculum.steps_per_depth`), so the
growth period moves with ``N``; Accordion's steps are counted at the mean over
its budgets (the expectation of its per-micro-batch sampling).

``F(N)`` is strictly increasing in ``N`` (one more step adds at least the cost of
a step at the initial depth, however the longer growth period shifts the other
steps' depths), so a bisection finds ``N``. The budget needs
``training.global_batch_size``: without it the step's size, and so ``N``, would
depend on the data-parallel size of the launch.
"""

from __future__ import annotations

from typing import Optional

from megatron_lol.errors import ConfigError
from megatron_lol.perf.flops import training_flops_per_step
from megatron_lol.plan.curriculum import steps_per_depth


def _global_batch(cfg) -> int:
    tr = cfg.training
    if tr.global_batch_size is None:
        raise ConfigError(
            "training.global_batch_size: must be set to count a run's FLOPs (training.train_flops "
            "or the params verb's training row); otherwise the data-parallel size sets it"
        )
    return tr.global_batch_size


class RunFlops:
    """``F(N)``, the training FLOPs of a run of ``N`` steps, with the per-depth step costs cached."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab = cfg, vocab_size
        self.batch, self.seq = _global_batch(cfg), cfg.training.seq_length
        plan = cfg.model.execution_plan()
        cur = cfg.curriculum
        self.full_depth = plan.depth
        self.initial_depth = cur.initial_depth if plan.growable else None
        self.growth_fraction = cur.growth_fraction
        self._step: dict = {}

    def step(self, depth: Optional[int]) -> float:
        """FLOPs of one optimizer step at core ``depth`` (None: the plan's own, Accordion's budget mean)."""
        if depth not in self._step:
            self._step[depth] = training_flops_per_step(self.cfg, depth, self.batch, self.seq, vocab_size=self.vocab)
        return self._step[depth]

    def depths(self, train_iters: int) -> dict:
        """``{depth: steps}`` of a run of ``train_iters`` steps (key None: a plan that does not grow)."""
        if self.initial_depth is None:
            return {None: train_iters} if train_iters > 0 else {}
        return steps_per_depth(train_iters, self.full_depth, self.initial_depth, self.growth_fraction)

    def __call__(self, train_iters: int) -> float:
        return sum(n * self.step(d) for d, n in self.depths(train_iters).items())

    def iterations_for(self, budget: float) -> int:
        """The largest ``N`` with ``F(N) <= budget`` (ConfigError when one step is over it)."""
        first = self(1)
        if first > budget:
            raise ConfigError(
                f"training.train_flops: {budget:.4g} is less than one iteration "
                f"({first:.4g} FLOPs at global batch {self.batch} x {self.seq} tokens)"
            )
        lo, hi = 1, 2
        while self(hi) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # F(lo) <= budget < F(hi)
            mid = (lo + hi) // 2
            if self(mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo


def run_training_flops(cfg, vocab_size: int, train_iters: Optional[int] = None) -> float:
    """Training FLOPs of the whole run (all ranks): ``train_iters`` (default the config's) steps."""
    n = cfg.training.train_iters if train_iters is None else train_iters
    return RunFlops(cfg, vocab_size)(n)


def iterations_for_flops(cfg, vocab_size: int, budget: Optional[float] = None) -> int:
    """The iterations ``budget`` (default ``training.train_flops``) buys; see the module docstring."""
    budget = cfg.training.train_flops if budget is None else budget
    return RunFlops(cfg, vocab_size).iterations_for(budget)


def apply_flop_budget(cfg, vocab_size: int) -> Optional[str]:
    """Set ``training.train_iters`` from ``training.train_flops`` (no-op without a budget); the line
    to log: the iterations, the FLOPs they take and the budget."""
    budget = cfg.training.train_flops
    if budget is None:
        return None
    run = RunFlops(cfg, vocab_size)
    n = run.iterations_for(budget)
    cfg.training.train_iters = n
    grows = (
        ""
        if run.initial_depth is None
        else (f", growing depth {run.initial_depth} -> {run.full_depth} over the first {run.growth_fraction:g} of them")
    )
    return (
        f"training.train_flops {budget:.4g}: {n} iterations of {run.batch} x {run.seq} tokens "
        f"= {run(n):.4g} training FLOPs (FLOP model{grows}; vocabulary {vocab_size})"
    )


__all__ = ["RunFlops", "run_training_flops", "iterations_for_flops", "apply_flop_budget"]
