"""Saving and loading a :class:`Trainer`'s complete state, and the hook that does it.

See the package docstring (:mod:`megatron_lol.training.checkpointing`) for the
directory layout, the commit order and the resume rules.

Errors every rank must see alike (a lock held elsewhere, a corrupted file, a
failed write) are agreed on with one ``all_gather_object`` (:func:`agree`) so
that all ranks raise the same one-line :class:`CheckpointError` instead of some
waiting forever in a collective for the one that failed.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from megatron_lol.errors import CliError
from megatron_lol.log import log_rank0
from megatron_lol.training.checkpointing.files import (
    MANIFEST,
    TMP_PREFIX,
    TRACKER,
    CheckpointError,
    checkpoint_dir,
    checkpoint_files,
    digest_files,
    files_of_rank,
    fsync_dir,
    iter_name,
    list_checkpoints,
    read_manifest,
    read_tracker,
    tmp_dir,
    truncate_metrics,
    verify_files,
    write_manifest,
    write_tracker,
)
from megatron_lol.training.checkpointing.lock import SaveDirLock
from megatron_lol.training.checkpointing.resolve import complete_checkpoint, load_plan
from megatron_lol.training.checkpointing.safe_load import (
    check_optimizer_fits,
    describe_error,
    load_common,
    load_sharded,
    read_metadata_file,
)
from megatron_lol.training.checkpointing.schedule import check_schedule
from megatron_lol.training.checkpointing.schedule import load_schedule as load_schedule_state
from megatron_lol.training.checkpointing.state import (
    KEY_PREFIX,
    NonFiniteWeightsError,
    barrier,
    build_save_state,
    gather_to_all,
    optimizer_sharded_state_dict,
    parallel_layout,
    rank,
    rng_sharded_object,
    run_config_dict,
    set_default_rng_state,
    set_rng_state,
    trainer_model_state,
    weights_finite,
    world_size,
    write_run_config,
)
from megatron_lol.training.checkpointing.writer_manager import prepare_writer_processes
from megatron_lol.training.hooks import NO_FAULTS, FaultHooks, Hook, Stop
from megatron_lol.training.optimizer import optimizer_state_kind


def agree(problem: Optional[str]) -> None:
    """Raise :class:`CheckpointError` on every rank when any rank reports a problem."""
    problems = gather_to_all(problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(first)


@dataclass
class _PendingSave:
    iteration: int
    tmp: str
    final: str
    started: float


class Checkpointer:
    """Saves and loads a :class:`Trainer`'s complete state; see the package docstring."""

    def __init__(self, trainer, faults: FaultHooks = NO_FAULTS):
        """``faults``: a test's injected faults (:class:`~megatron_lol.training.hooks.FaultHooks`); the
        trainer passes its own, which in production is the default that injects none."""
        self.trainer = trainer
        self.faults = faults
        tr = trainer.cfg.training
        self.save_root = tr.save
        self.keep_last = tr.keep_last
        self.async_save = tr.async_save
        self.verify_checksums = getattr(tr, "verify_checksums", True)
        self._queue = None
        self._inflight: Optional[_PendingSave] = None
        self.last_saved_iteration: Optional[int] = None
        self.loaded_from: Optional[str] = None
        self.resumed = False
        self.save_seconds: list = []

    # --------------------------------------------------------------- save
    def save(self, blocking: bool = False) -> Optional[str]:
        """Save the trainer's state as ``iter_{iteration}``; returns the final path.

        With ``async_save`` the write continues in the background unless
        ``blocking``; the tracker is written when it is finalized. A failed write
        (disk full ...) removes the partial save and raises :class:`CheckpointError`.
        """
        from megatron.core import dist_checkpointing

        trainer = self.trainer
        if not self.save_root:
            return None
        it = int(trainer.iteration)
        if it == self.last_saved_iteration:
            return checkpoint_dir(self.save_root, it)
        if not weights_finite(trainer):
            raise NonFiniteWeightsError(
                f"refusing to save checkpoint at iteration {it}: model weights contain NaN/Inf "
                f"(previous checkpoint kept: {read_tracker(self.save_root)})"
            )
        # one save in flight at a time: finish the previous async one first
        self.finalize(blocking=True)
        t0 = time.perf_counter()
        root, tmp, final = self.save_root, tmp_dir(self.save_root, it), checkpoint_dir(self.save_root, it)
        problem = None
        if rank() == 0:
            try:
                os.makedirs(root, exist_ok=True)
                for name in os.listdir(root):  # leftovers of killed saves (this run holds the lock)
                    if name.startswith(TMP_PREFIX):
                        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                os.makedirs(tmp)
            except OSError as err:
                problem = f"cannot create {tmp}: {describe_error(err)}"
        agree(problem)
        state = build_save_state(trainer)
        info = run_config_dict(trainer)
        pending = _PendingSave(it, tmp, final, t0)
        try:
            request = dist_checkpointing.save(state, tmp, async_sharded_save=self.async_save)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            raise CheckpointError(self._abandon(pending, err)) from None
        self.faults.before_commit(it, tmp)  # tests only (hooks.FaultHooks); nothing by default
        self.last_saved_iteration = it
        if request is None:
            self._commit(pending, info)
            return final
        request.finalize_fns.append(lambda: self._commit(pending, info))
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(request)
        self._inflight = pending
        log_rank0(f" checkpoint: async save of iteration {it} started ({time.perf_counter() - t0:.2f} s blocking)")
        if blocking:
            self.finalize(blocking=True)
        return final

    def _abandon(self, pending: _PendingSave, err: BaseException) -> str:
        """After a failed write: remove the partial save (freeing its space); the message to raise.

        megatron-core raises torch's ``CheckpointException`` on every rank when any rank's write failed
        (its coordinator broadcasts the verdict), but only the coordinator holds the failing ranks' errors:
        one ``all_gather_object`` here gives every rank the same line, naming the first failing rank,
        its host and its shard file. Any other exception is this rank's own and is described as such."""
        where, what = pending.tmp, describe_error(err)
        if isinstance(err, CheckpointException):
            failures = {
                r: describe_error(f[0] if isinstance(f, tuple) else f)
                for r, f in (getattr(err, "failures", None) or {}).items()
            }
            shards = sorted(glob.glob(os.path.join(pending.tmp, f"__{rank()}_*.distcp")))
            gathered = gather_to_all((rank(), socket.gethostname(), shards[0] if shards else None, failures))
            failed = {r: e for *_, part in gathered for r, e in part.items()}
            if failed:
                first = min(failed)
                _, host, shard, _ = gathered[first]
                where = f"{shard or pending.tmp} on rank {first} (host {host})"
                what = failed[first] + (f"; {len(failed) - 1} more rank(s) failed" if len(failed) > 1 else "")
        if rank() == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        kept = read_tracker(self.save_root) if os.path.isdir(self.save_root) else None
        self.last_saved_iteration = kept
        return (
            f"saving iteration {pending.iteration} failed: writing {where}: {what}; no rank moved the "
            f"tracker, the partial save was removed, the last complete checkpoint is "
            f"{iter_name(kept) if kept is not None else 'none'}"
        )

    def _commit(self, pending: _PendingSave, info: dict) -> None:
        """All ranks, after every rank's shards (and metadata) are on disk: checksums, rename, tracker."""
        problem, entries = None, {}
        try:
            if rank() == 0:
                write_run_config(info, pending.tmp)
            mine = files_of_rank(checkpoint_files(pending.tmp), rank(), world_size())
            entries = digest_files(pending.tmp, mine)
        except OSError as err:
            problem = f"saving iteration {pending.iteration}: {describe_error(err)}"
        gathered = gather_to_all((problem, entries))
        problem = next((p for p, _ in gathered if p), None)
        if problem is None and rank() == 0:
            try:
                self._publish(pending, {k: v for _, part in gathered for k, v in part.items()})
            except OSError as err:
                problem = f"saving iteration {pending.iteration}: {describe_error(err)}"
        if problem is not None and rank() == 0 and os.path.isdir(pending.tmp):
            shutil.rmtree(pending.tmp, ignore_errors=True)
            problem += f" (partial save removed; last complete checkpoint: {read_tracker(self.save_root)})"
        self._inflight = None
        agree(problem)
        seconds = time.perf_counter() - pending.started
        self.save_seconds.append(seconds)
        log_rank0(f" checkpoint: saved iteration {pending.iteration} to {pending.final} ({seconds:.2f} s)")

    def _publish(self, pending: _PendingSave, entries: dict) -> None:
        """Rank 0: manifest, rename into place, tracker, pruning."""
        write_manifest(pending.tmp, entries)
        fsync_dir(pending.tmp)
        if os.path.exists(pending.final):
            # a complete copy the tracker does not name: killed between rename and tracker, or the
            # tracker was pointed back on purpose; this save of the same iteration replaces it
            if read_tracker(self.save_root) == pending.iteration:  # pragma: no cover - guarded by save()
                raise CheckpointError(f"{pending.final} is the tracked checkpoint; not overwriting it")
            log_rank0(f" checkpoint: replacing {pending.final}, which {TRACKER} does not name")
            shutil.rmtree(pending.final)
        os.rename(pending.tmp, pending.final)
        fsync_dir(self.save_root)
        write_tracker(self.save_root, pending.iteration)
        self._prune()

    def _prune(self) -> None:
        if not self.keep_last:
            return
        tracked = read_tracker(self.save_root)
        its = [i for i in list_checkpoints(self.save_root) if i != tracked]
        its = sorted(its + ([tracked] if tracked is not None else []))
        for old in its[: -self.keep_last]:
            if old != tracked:
                shutil.rmtree(checkpoint_dir(self.save_root, old), ignore_errors=True)

    def finalize(self, blocking: bool = False) -> None:
        """Finalize finished async saves (all ranks must call this at the same point)."""
        if self._queue is None or not self._queue.get_num_unfinalized_calls():
            return
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (KeyboardInterrupt, SystemExit, CheckpointError):
            raise
        except BaseException as err:  # noqa: BLE001 - the writer's failure, re-raised by megatron
            pending, self._inflight = self._inflight, None
            if pending is None:
                raise
            raise CheckpointError(self._abandon(pending, err)) from None

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    # --------------------------------------------------------------- load
    def verify(self, path: str) -> None:
        """Check every file against the checkpoint's ``checksums.json`` (the ranks share the work)."""
        if not self.verify_checksums:
            log_rank0(f" checkpoint: checksums of {path} not verified (training.verify_checksums=false)")
            return
        t0 = time.perf_counter()
        problem, files = None, None
        try:
            files = read_manifest(path)
        except CheckpointError as err:
            problem = str(err)
        if files is None and problem is None:
            log_rank0(f" checkpoint: {path} has no {MANIFEST} (an older save): files not verified")
            return
        if problem is None:
            problem = verify_files(path, files, sorted(files)[rank() :: world_size()])
        agree(problem)
        mb = sum(v["size"] for v in files.values()) / 2**20
        log_rank0(f" checkpoint: {len(files)} files ({mb:.1f} MB) match {MANIFEST} ({time.perf_counter() - t0:.2f} s)")

    def load(
        self,
        directory: str,
        iteration: Optional[int] = None,
        *,
        resume: bool = True,
        load_optimizer: bool = True,
        load_schedule: bool = True,
    ) -> int:
        """Restore from ``{directory}/iter_{iteration}`` (default: the tracker's).

        ``resume``: same run continuing -- RNG states are restored too (when the
        layout is unchanged). ``load_schedule`` False: iteration, LR schedule,
        data position and skip count stay at 0 (a new stage).
        """
        trainer = self.trainer
        iteration, path = complete_checkpoint(directory, iteration)
        t0 = time.perf_counter()
        self.verify(path)
        metadata = read_metadata_file(path)
        common = load_common(path)
        layout = parallel_layout(trainer)
        load_rng = resume and common.get("layout") == layout
        model_sd = trainer_model_state(trainer)
        request = {"model": model_sd}
        # a chain of several optimizers (Muon + AdamW, expert groups) prefixes its keys with chained_<i>.
        has_optimizer = load_optimizer and any(
            k.startswith(("optimizer", "chained_")) for k in metadata.state_dict_metadata
        )
        if load_optimizer and not has_optimizer:
            log_rank0(f" checkpoint: {path} has no optimizer state; starting it fresh")
        saved_kind, kind = common.get("optimizer_kind", "adam"), optimizer_state_kind(trainer.cfg)
        if has_optimizer and saved_kind != kind:
            raise CliError(
                f"{path}: holds the optimizer state of {saved_kind}, this run uses {kind}; to switch, "
                f"start a new --save from --load {directory} with training.reset_optimizer: true"
            )
        if has_optimizer:
            request["optimizer"] = optimizer_sharded_state_dict(trainer, model_sd, is_loading=True)
            check_optimizer_fits(path, directory, request["optimizer"], metadata, common.get("layout"), layout)
        # a resume whose schedules differ from the checkpoint's stops here, before any state is read,
        # unless told which wins; a stage takes its own settings (.schedule)
        keep_schedule = (
            load_schedule and resume and directory == self.save_root and check_schedule(trainer, common, path)
        )
        if load_rng:
            request["rng_state"] = rng_sharded_object(None)
        state = load_sharded(request, path)
        model_state = {k[len(KEY_PREFIX) :] if k.startswith(KEY_PREFIX) else k: v for k, v in state["model"].items()}
        trainer.model.load_state_dict(model_state, strict=True)
        if has_optimizer:
            trainer.optimizer.load_state_dict(state["optimizer"])
        if load_schedule:
            load_schedule_state(trainer, common, use_checkpoint=keep_schedule)
            trainer.iteration = int(common["iteration"])
            trainer.consumed_train_samples = int(common["consumed_train_samples"])
            trainer.nonfinite_skipped = int(common.get("nonfinite_skipped", 0))
        if load_rng:
            set_rng_state(state["rng_state"])
        elif resume:
            if "rng_default" in common:
                set_default_rng_state(common["rng_default"])
            log_rank0(
                f" checkpoint: parallel layout changed {common.get('layout')} -> {layout}: weights and "
                f"optimizer resharded, default RNGs from saving rank 0, tensor-parallel RNG re-seeded"
            )
        barrier()
        self.loaded_from = path
        if directory == self.save_root:
            self.last_saved_iteration = int(common["iteration"])
        log_rank0(
            f" checkpoint: loaded {path} (iteration {common['iteration']}, consumed samples "
            f"{common['consumed_train_samples']}, optimizer {'loaded' if has_optimizer else 'fresh'}, "
            f"schedule {'loaded' if load_schedule else 'reset'}, "
            f"rng {'loaded' if load_rng else 'rank-0 default' if resume else 'fresh'}) "
            f"in {time.perf_counter() - t0:.2f} s"
        )
        return iteration

    def resolve_and_load(self) -> Optional[str]:
        """Apply the resume rules of the package docstring (:func:`.resolve.load_plan`, which
        ``train --dry-run`` runs too); returns the path loaded, if any."""
        tr = self.trainer.cfg.training
        plan = load_plan(tr.save, tr.load, tr.resume, tr.load_iteration)
        if plan is None:
            if tr.load and tr.save and not tr.resume:
                log_rank0(f" checkpoint: --no-resume: not loading {tr.load}")
            return None
        if not plan.resume:
            self.load(
                plan.directory,
                plan.iteration,
                resume=False,
                load_optimizer=not tr.reset_optimizer,
                load_schedule=not tr.reset_schedule,
            )
            return self.loaded_from
        it = plan.iteration
        if plan.how:
            log_rank0(f" checkpoint: {plan.how}: resuming from {plan.path}")
        newer = [i for i in list_checkpoints(tr.save) if i > it]
        if newer:
            log_rank0(
                f" checkpoint: {', '.join(iter_name(i) for i in newer)} in {tr.save} "
                f"{'is' if len(newer) == 1 else 'are'} newer than {iter_name(it)} but not named "
                f"by {TRACKER}: a save of the same iteration replaces it"
            )
        self.load(tr.save, it, resume=True)
        self.resumed = True
        if plan.how and rank() == 0:
            write_tracker(tr.save, it)
        return self.loaded_from

    def drop_relogged_metrics(self) -> None:
        """Rank 0, after loading: remove the records of ``metrics.jsonl`` that this run logs again.

        A resumed run repeats the steps after its checkpoint; those records of the
        interrupted run go, so every step appears once. A ``training.metrics_file``
        outside the save directory is only cut on a resume of the same run.
        """
        trainer = self.trainer
        tr = trainer.cfg.training
        path = getattr(trainer, "metrics_path", None)
        own = tr.save and path and os.path.abspath(path) == os.path.abspath(os.path.join(tr.save, "metrics.jsonl"))
        if rank() != 0 or not path or not (self.resumed or own):
            return
        dropped = truncate_metrics(path, int(trainer.iteration))
        if dropped:
            log_rank0(
                f" checkpoint: {path}: dropped {dropped} record(s) after step {trainer.iteration} "
                f"(logged by the interrupted run; this run logs them again)"
            )


# ------------------------------------------------------------------ hook
class CheckpointHook(Hook):
    """Loads at start; saves every ``save_interval``, at the end, before a preemption exit and before a
    stop at ``exit_interval``."""

    def __init__(self):
        self.ckpt: Optional[Checkpointer] = None
        self.stop_check = None
        self.lock: Optional[SaveDirLock] = None

    def on_start(self, trainer) -> None:
        from megatron_lol.training import signals

        self.ckpt = Checkpointer(trainer, trainer.faults)
        trainer.checkpointer = self.ckpt
        save = trainer.cfg.training.save
        if save:
            self.lock = SaveDirLock(save)
            agree(self.lock.acquire() if rank() == 0 else None)
        try:
            if save:
                prepare_writer_processes()
            self.ckpt.resolve_and_load()
            self.ckpt.drop_relogged_metrics()
        except BaseException:
            # a run that stops before its first step leaves no trace: no lock file, no save directory
            # it created (SaveDirLock.discard)
            if self.lock is not None:
                self.lock.discard()
                self.lock = None
            raise
        signals.install_handlers()  # a signal caught during start-up (train's CLI listens early) stays set
        if rank() == 0:
            signals.clear_requeue_marker(save)
        self.stop_check = signals.StopCheck(trainer.cfg.training.exit_duration_in_mins)

    def on_step_end(self, trainer, result) -> Optional[Stop]:
        from megatron_lol.training import signals

        tr = trainer.cfg.training
        self._periodic(trainer, lambda: self.ckpt.finalize(blocking=False))
        reason = self.stop_check()
        if reason is not None:
            if trainer.iteration >= tr.train_iters:
                return None  # finished anyway; on_end saves
            log_rank0(
                f" preemption: {reason} at iteration {trainer.iteration}: saving and exiting "
                f"with status {signals.EXIT_REQUEUE}"
            )
            if tr.save:
                self.ckpt.save(blocking=True)
                if rank() == 0:
                    signals.write_requeue_marker(tr.save, trainer.iteration, reason)
                # launchers kill the other ranks as soon as one exits non-zero: nobody leaves
                # before the checkpoint *and* the marker are on disk
                barrier()
            else:
                log_rank0(" preemption: no training.save directory: nothing saved")
            return Stop(signals.EXIT_REQUEUE, reason)
        if tr.exit_interval and trainer.iteration % tr.exit_interval == 0 and trainer.iteration < tr.train_iters:
            # Megatron-LM's --exit-interval: a planned stop (status 0) with a checkpoint to continue from
            log_rank0(
                f" exit interval: stopping at iteration {trainer.iteration} (--exit-interval "
                f"{tr.exit_interval})" + (", after saving it" if tr.save else "")
            )
            if tr.save:
                self.ckpt.save(blocking=True)
                barrier()
            return Stop(0, f"--exit-interval {tr.exit_interval}")
        if tr.save and tr.save_interval and trainer.iteration % tr.save_interval == 0:
            self._periodic(trainer, self.ckpt.save)
        return None

    @staticmethod
    def _periodic(trainer, save) -> None:
        """A periodic save (or its async completion): with ``training.on_save_failure: continue`` a failed
        one is reported and training goes on to the next save (every rank agrees on the failure, none moved
        the tracker: :meth:`Checkpointer._abandon`); by default the error stops the run. Final and
        preemption saves always stop on failure: nothing comes after them to save instead."""
        try:
            save()
        except CheckpointError as err:
            if trainer.cfg.training.on_save_failure != "continue":
                raise
            log_rank0(f" checkpoint: {err} (training.on_save_failure=continue: training goes on)")

    def on_end(self, trainer, stop: Optional[Stop]) -> None:
        from megatron_lol.training import signals

        tr = trainer.cfg.training
        try:
            if tr.save and trainer.iteration >= tr.train_iters and stop is None:
                self.ckpt.save(blocking=True)
            self.ckpt.finalize(blocking=True)
        finally:
            self.ckpt.close()
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            signals.clear()  # handled: a later run in this process starts without it
