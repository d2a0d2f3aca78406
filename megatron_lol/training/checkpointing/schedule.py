"""The schedules a resumed run continues: learning rate (megatron-core's scheduler), depth growth, bias stop.

A checkpoint holds megatron-core's ``OptimizerParamScheduler`` state (peak and
final learning rate, warm-up and decay iterations, decay style, weight decay)
and, in ``common["schedule"]``, ``train_iters``: the iterations the growing depth
(``curriculum.growth_fraction``) and the balancing-bias stop
(``model.plan.routing.bias_update_stop_fraction``) are measured against.

Resuming the same run with settings that change any of these would change the
rest of its schedules without a word (``--train-iters 800`` -> ``900`` moves the
end of the decay, the growth and the bias stop). As in Megatron-LM, such a
resume stops with one line unless the run says which schedule wins:

* ``--override-opt_param-scheduler``: this run's settings (the schedules are
  recomputed from them, at the checkpoint's iteration);
* ``--use-checkpoint-opt_param-scheduler``: the checkpoint's (megatron-core's
  scheduler keeps its values; growth and bias stop keep its ``train_iters``),
  while the run still trains to its own ``--train-iters``.

A new stage started from ``--load`` (another ``--save``) takes its own settings,
as documented for stages (package docstring).
"""

from __future__ import annotations

from megatron_lol.errors import ConfigError
from megatron_lol.log import log_rank0

# scheduler state key -> the flag that sets it
COMPARED = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--train-iters",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
}


def schedule_record(trainer) -> dict:
    """What a checkpoint records beside the scheduler state (``common["schedule"]``)."""
    return {"train_iters": int(getattr(trainer, "schedule_iters", trainer.cfg.training.train_iters))}


def _grows(trainer) -> bool:
    """Whether ``train_iters`` enters a schedule besides the learning rate's."""
    return trainer.cfg.curriculum.initial_depth is not None or bool(trainer._balancers())


def differences(trainer, saved: dict, record: dict) -> list:
    """``name old -> new (--flag)`` for every schedule setting of this run that differs from the checkpoint's."""
    now = trainer.scheduler.state_dict()
    out = []
    for key, flag in COMPARED.items():
        if key in saved and saved[key] != now[key] and not (key == "end_wd" and "start_wd" in out):
            out.append(f"{key} {saved[key]} -> {now[key]} ({flag})")
    saved_iters, iters = int(record.get("train_iters", saved.get("lr_decay_steps", 0))), trainer.schedule_iters
    if _grows(trainer) and saved_iters != iters:
        out.append(f"depth growth and bias-update stop over {saved_iters} -> {iters} iterations (--train-iters)")
    return out


def check_schedule(trainer, common: dict, path: str) -> bool:
    """On a resume of the same run: stop (one line) when this run's schedules differ from the checkpoint's
    and neither ``training.override_opt_param_scheduler`` nor ``use_checkpoint_opt_param_scheduler``
    says which wins. Returns whether the checkpoint's schedule is to be kept."""
    tr = trainer.cfg.training
    diffs = differences(trainer, common["scheduler"], common.get("schedule") or {})
    if not diffs:
        return False
    if not (tr.override_opt_param_scheduler or tr.use_checkpoint_opt_param_scheduler):
        raise ConfigError(
            f"{path}: this run's schedule differs from the checkpoint's ({'; '.join(diffs)}): "
            f"pass --override-opt_param-scheduler to use this run's, or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    which = "the checkpoint's" if tr.use_checkpoint_opt_param_scheduler else "this run's"
    log_rank0(f" checkpoint: schedule differs from the checkpoint's ({'; '.join(diffs)}): using {which}")
    return tr.use_checkpoint_opt_param_scheduler


def load_schedule(trainer, common: dict, use_checkpoint: bool) -> None:
    """Restore the scheduler's position from a checkpoint's ``common`` state, with this run's settings
    or (``use_checkpoint``) the checkpoint's, growth and bias stop included."""
    saved, record = common["scheduler"], common.get("schedule") or {}
    sched = trainer.scheduler
    flags = sched.override_opt_param_scheduler, sched.use_checkpoint_opt_param_scheduler
    sched.override_opt_param_scheduler, sched.use_checkpoint_opt_param_scheduler = not use_checkpoint, use_checkpoint
    try:
        sched.load_state_dict(saved)
    finally:
        sched.override_opt_param_scheduler, sched.use_checkpoint_opt_param_scheduler = flags
    if use_checkpoint:
        trainer.schedule_iters = int(record.get("train_iters", saved["lr_decay_steps"]))
