"""What a run will load, and whether it may write its save directory, from the files alone.

The resume rules of the package docstring decide from the tracker and the
``iter_*`` directories which checkpoint a run starts from. They are written once,
here, without torch or process groups, so that ``train --dry-run`` reaches the
same verdict as the run (:meth:`Checkpointer.resolve_and_load
<megatron_lol.training.checkpointing.checkpointer.Checkpointer.resolve_and_load>`)
and the run reaches it before it creates anything (``Trainer.setup``): a
``--load`` that names no checkpoint stops with one line before a save directory,
a lock file or a dataset cache exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_lol.training.checkpointing.files import (
    TRACKER,
    CheckpointError,
    CheckpointNotFoundError,
    checkpoint_dir,
    iter_name,
    latest_checkpoint,
    list_checkpoints,
    read_tracker,
    resume_iteration,
)


@dataclass
class LoadPlan:
    """The checkpoint a run starts from: ``directory/iter_{iteration}``; ``resume``: the same run
    continuing from its ``--save`` (else a stage starting from ``--load``); ``how``: why this
    checkpoint when the tracker did not name it (empty otherwise)."""

    directory: str
    iteration: int
    resume: bool
    how: str = ""

    @property
    def path(self) -> str:
        return checkpoint_dir(self.directory, self.iteration)


def load_plan(
    save: Optional[str], load: Optional[str], resume: bool, load_iteration: Optional[int]
) -> Optional[LoadPlan]:
    """The checkpoint a run with these settings loads (None: it starts fresh), or the one-line
    :class:`CheckpointError` the run would stop with.

    * ``resume`` and ``save`` holds a checkpoint: that one (the tracker's; without a tracker the
      newest ``iter_*`` its ``checksums.json`` proves complete).
    * not ``resume`` and ``save`` holds checkpoints: refused (they would be replaced).
    * otherwise ``load``, when given: ``load_iteration``, else its tracker's iteration, must be a
      complete checkpoint (its ``metadata.json`` written); ``load`` equal to ``save`` with
      ``--no-resume`` is not loaded.
    """
    if save and resume:
        it, how = resume_iteration(save)
        if it is not None:
            return LoadPlan(save, it, True, "" if how == "tracker" else how)
    elif save and (list_checkpoints(save) or read_tracker(save) is not None):
        found = ", ".join(iter_name(i) for i in list_checkpoints(save)) or TRACKER
        raise CheckpointError(
            f"{save} already holds checkpoints ({found}); --no-resume would train "
            f"from scratch and replace them: pass another --save, or remove them"
        )
    if not load:
        return None
    if save and os.path.abspath(load) == os.path.abspath(save) and not resume:
        return None
    if load_iteration is None and not os.path.isdir(load):
        raise CheckpointNotFoundError(f"{load}: no such directory: no checkpoint to load")
    iteration, _ = complete_checkpoint(load, load_iteration)
    return LoadPlan(load, iteration, False)


def complete_checkpoint(directory: str, iteration: Optional[int] = None) -> tuple:
    """``(iteration, path)`` of the checkpoint a load reads: ``iteration`` (default: the tracker's) of
    ``directory``, which must be complete (its ``metadata.json`` is written last); else one line."""
    if iteration is None:
        iteration = latest_checkpoint(directory)
        if iteration is None:
            raise CheckpointNotFoundError(
                f"{directory} has no {TRACKER}: no checkpoint to load "
                f"(found: {', '.join(iter_name(i) for i in list_checkpoints(directory)) or 'none'})"
            )
    path = checkpoint_dir(directory, iteration)
    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise CheckpointNotFoundError(f"{path} is not a complete checkpoint (no metadata.json)")
    return iteration, path


def check_save_dir(save: Optional[str]) -> Optional[str]:
    """Why this process cannot write checkpoints to ``save`` (None: it can, or there is no ``save``); the
    same for any directory a command creates for its output (a dataset cache, ``analyze --output``).

    An existing ``save`` must be a writable directory; a missing one is created by the run, so its
    nearest existing parent must be a writable directory. Nothing is created here.
    """
    if not save:
        return None
    path = os.path.abspath(save)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{save} is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{save} is not writable by this user"
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{save} cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{save} cannot be created: {parent} is not writable by this user"
    return None
