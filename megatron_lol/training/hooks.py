"""Step-boundary callbacks of the trainer: logging, checkpoints, preemption signals, time limits.

Each callback has ``on_start(trainer)``, ``on_step_end(trainer, result) ->
Stop | None`` (a :class:`Stop` asks the loop to end after this step, with the
process exit status it carries) and ``on_end(trainer, stop)``. Keeping these
out of the loop keeps the loop readable (as OLMo-core's callbacks do).

* ``TrainingConsole`` (:mod:`megatron_lol.training.console`) prints the log line and
  writes ``metrics.jsonl`` and the metric sinks.
* :class:`NonFiniteReportHook` prints every skipped (NaN/Inf) step.
* ``CheckpointHook`` (:mod:`megatron_lol.training.checkpointing`): load/resume
  at start, periodic and final saves, SIGTERM/SIGUSR1,
  ``exit_duration_in_mins`` (:mod:`megatron_lol.training.signals`) and ``exit_interval``.
* ``ProfilerHook`` (:mod:`megatron_lol.training.tracing`): the ``--profile`` window.

:class:`FaultHooks` is where tests inject faults (a NaN loss, a pause in the
middle of a save, a straggler) into an otherwise normal run: its default does
nothing, production code never builds another one, and no environment variable
or flag reaches it. ``tests/fault_rank_runner.py`` builds one and runs the train
CLI with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_lol.log import log_rank0


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


def _no_fault(iteration: int, tmp: str) -> None:
    return None


@dataclass(frozen=True)
class FaultHooks:
    """The points where a test injects a fault into a real training run; the default injects none.

    ``callbacks`` are extra :class:`Hook` objects run before the trainer's own (a test's NaN loss or
    straggler registers its module hooks in ``on_start``); ``before_commit(iteration, tmp)`` runs on
    every rank once a save's shards were handed to megatron-core and before the checkpoint is
    committed (tracker not moved: a window to kill a run in the middle of a save). They are an
    argument of :class:`~megatron_lol.training.trainer.Trainer` rather than environment variables
    so that production code holds no switch that turns a run into a drill.
    """

    callbacks: tuple = ()
    before_commit: Callable[[int, str], None] = _no_fault


NO_FAULTS = FaultHooks()


def default_hooks(trainer) -> list:
    hooks: list = list(trainer.faults.callbacks)
    hooks.append(trainer._console())
    hooks.append(NonFiniteReportHook())
    from megatron_lol.training.checkpointing import CheckpointHook

    hooks.append(CheckpointHook())
    if trainer.cfg.training.profile:
        from megatron_lol.training.tracing import ProfilerHook

        hooks.append(ProfilerHook())
    return hooks
