"""Step-boundary hooks of the trainer: checkpoints, preemption signals, time limits.

Each hook has ``on_start(trainer)``, ``on_step_end(trainer, result) -> bool``
(True asks the loop to stop after this step) and ``on_end(trainer)``. Keeping
these out of the loop keeps the loop readable (as OLMo-core's callbacks do).

* :class:`NonFiniteReportHook` prints every skipped (NaN/Inf) step.
* :class:`NaNInjectionHook` (fault injection for tests and drills): with
  ``MEGATRON_LOL_INJECT_NAN_STEPS=5,9`` the model's output (the per-token loss)
  is multiplied by NaN in the forward passes of 1-based iterations 5 and 9, so
  the loss *and* the gradients are non-finite.
* ``CheckpointHook`` (:mod:`megatron_lol.training.checkpointing`): load/resume
  at start, periodic and final saves, SIGTERM/SIGUSR1 and
  ``exit_duration_in_mins`` (:mod:`megatron_lol.training.signals`).
"""

from __future__ import annotations

import os

from megatron_lol.log import log_rank0

INJECT_NAN_ENV = "MEGATRON_LOL_INJECT_NAN_STEPS"


class Hook:
    def on_start(self, trainer) -> None:  # pragma: no cover - interface
        pass

    def on_step_end(self, trainer, result) -> bool:  # pragma: no cover - interface
        return False

    def on_end(self, trainer) -> None:  # pragma: no cover - interface
        pass


class NonFiniteReportHook(Hook):
    def on_step_end(self, trainer, result) -> bool:
        if getattr(result, "skipped", False):
            log_rank0(f" non-finite: loss {result.loss} / grad norm {result.grad_norm} at iteration "
                       f"{result.step}: step skipped ({trainer.nonfinite_skipped} of at most "
                       f"{trainer.cfg.training.skip_nonfinite_steps} allowed)")
        return False


class NaNInjectionHook(Hook):
    def __init__(self, steps):
        self.steps = set(int(s) for s in steps)
        self.handle = None

    @classmethod
    def from_env(cls):
        raw = os.environ.get(INJECT_NAN_ENV, "").strip()
        if not raw:
            return None
        return cls(s for s in raw.replace(" ", ",").split(",") if s)

    def on_start(self, trainer) -> None:
        def poison(module, args, output):
            if module.training and trainer.iteration + 1 in self.steps:
                return output * float("nan")
            return output

        self.handle = trainer.model.register_forward_hook(poison)
        log_rank0(f" fault injection: NaN loss at iterations {sorted(self.steps)}")

    def on_end(self, trainer) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def default_hooks(trainer) -> list:
    hooks: list = []
    inject = NaNInjectionHook.from_env()
    if inject is not None:
        hooks.append(inject)
    hooks.append(NonFiniteReportHook())
    try:
        from megatron_lol.training.checkpointing import CheckpointHook
    except ImportError:
        return hooks
    hooks.append(CheckpointHook())
    return hooks
