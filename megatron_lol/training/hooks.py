"""Step-boundary callbacks of the trainer: logging, checkpoints, preemption signals, time limits.

Each callback has ``on_start(trainer)``, ``on_step_end(trainer, result) ->
Stop | None`` (a :class:`Stop` asks the loop to end after this step, with the
process exit status it carries) and ``on_end(trainer, stop)``. Keeping these
out of the loop keeps the loop readable (as OLMo-core's callbacks do).

* ``TrainingConsole`` (:mod:`megatron_lol.training.console`) prints the log line and
  writes ``metrics.jsonl`` and the metric sinks.
* :class:`NonFiniteReportHook` prints every skipped (NaN/Inf) step.
* :class:`NaNInjectionHook` (fault injection for tests and drills): with
  ``MEGATRON_LOL_INJECT_NAN_STEPS=5,9`` the model's output (the per-token loss)
  is multiplied by NaN in the forward passes of 1-based iterations 5 and 9, so
  the loss *and* the gradients are non-finite.
* ``CheckpointHook`` (:mod:`megatron_lol.training.checkpointing`): load/resume
  at start, periodic and final saves, SIGTERM/SIGUSR1,
  ``exit_duration_in_mins`` (:mod:`megatron_lol.training.signals`) and ``exit_interval``.
* ``ProfilerHook`` (:mod:`megatron_lol.training.tracing`): the ``--profile`` window.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_lol.log import log_rank0

INJECT_NAN_ENV = "MEGATRON_LOL_INJECT_NAN_STEPS"


@dataclass(frozen=True)
class Stop:
    """A callback's request to end training after this step; the process exits with ``exit_code``."""

    exit_code: int
    reason: str


class Hook:
    def on_start(self, trainer) -> None:  # pragma: no cover - interface
        pass

    def on_step_end(self, trainer, result) -> Optional[Stop]:  # pragma: no cover - interface
        return None

    def on_end(self, trainer, stop: Optional[Stop]) -> None:  # pragma: no cover - interface
        pass


class NonFiniteReportHook(Hook):
    def on_step_end(self, trainer, result) -> Optional[Stop]:
        if getattr(result, "skipped", False):
            log_rank0(
                f" non-finite: loss {result.loss} / grad norm {result.grad_norm} at iteration "
                f"{result.step}: step skipped ({trainer.nonfinite_skipped} of at most "
                f"{trainer.cfg.training.skip_nonfinite_steps} allowed)"
            )
        return None


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
                if isinstance(output, tuple):  # (loss, core output)
                    return (output[0] * float("nan"),) + tuple(output[1:])
                return output * float("nan")
            return output

        self.handle = trainer.model.register_forward_hook(poison)
        log_rank0(f" fault injection: NaN loss at iterations {sorted(self.steps)}")

    def on_end(self, trainer, stop: Optional[Stop]) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def default_hooks(trainer) -> list:
    hooks: list = []
    inject = NaNInjectionHook.from_env()
    if inject is not None:
        hooks.append(inject)
    hooks.append(trainer._console())
    hooks.append(NonFiniteReportHook())
    from megatron_lol.training.checkpointing import CheckpointHook

    hooks.append(CheckpointHook())
    if trainer.cfg.training.profile:
        from megatron_lol.training.tracing import ProfilerHook

        hooks.append(ProfilerHook())
    return hooks
