"""Step-boundary hooks of the trainer: checkpoints, preemption signals, time limits.

Each hook has ``on_start(trainer)``, ``on_step_end(trainer, result) -> bool``
(True asks the loop to stop after this step) and ``on_end(trainer)``. Keeping
these out of the loop keeps the loop readable (as OLMo-core's callbacks do).
"""

from __future__ import annotations


class Hook:
    def on_start(self, trainer) -> None:  # pragma: no cover - interface
        pass

    def on_step_end(self, trainer, result) -> bool:  # pragma: no cover - interface
        return False

    def on_end(self, trainer) -> None:  # pragma: no cover - interface
        pass


def default_hooks(trainer) -> list:
    hooks: list = []
    try:
        from megatron_lol.training.checkpointing import CheckpointHook
    except ImportError:
        return hooks
    hooks.append(CheckpointHook())
    return hooks
