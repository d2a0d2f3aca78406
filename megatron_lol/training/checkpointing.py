"""Checkpoints with megatron-core distributed checkpointing (``torch_dist``).

Layout of a save directory ``{save}``::

    {save}/latest_checkpointed_iteration.txt   # one integer; written last
    {save}/iter_0000123/                       # complete checkpoints only
        metadata.json, common.pt, __*.distcp   # megatron dist_checkpointing (torch_dist)
        run_config.yaml                        # the run's ExperimentConfig + checkpoint info
        tokenizer/                             # copies of the tokenizer file(s), when small
    {save}/.tmp_iter_0000124/                  # a save in progress (or killed): never loaded
    {save}/metrics.jsonl

A save writes into ``.tmp_iter_XXXXXXX``; when every rank has finished (for
async saves: after megatron's finalize, metadata.json included) rank 0 renames
it to ``iter_XXXXXXX`` and only then rewrites the tracker (via ``os.replace``).
A process killed at any moment therefore leaves the tracker pointing at the
previous complete checkpoint. Old checkpoints beyond ``keep_last`` are deleted
only after the tracker names the new one. Weights that are not all finite are
never written (:class:`NonFiniteWeightsError`).

Keys inside the ``torch_dist`` checkpoint (what a converter reads):

* ``model.<key>`` -- each entry of the LoLGPTModel's ``state_dict()`` (the inner
  module, not the DDP wrapper), as a *global* (unsharded-shape) tensor, e.g.
  ``model.embedding.word_embeddings.weight`` [padded_vocab, hidden],
  ``model.core.balancer.bias`` (balancing bias), ``model.output_layer.weight``.
  Load them without process groups with
  ``megatron.core.dist_checkpointing.load_plain_tensors(dir)`` (or
  ``torch.distributed.checkpoint``), whatever TP/PP/EP layout saved them.
* ``optimizer.*`` -- megatron's optimizer state (distributed optimizer:
  ``fully_reshardable``), keyed from the model keys; a chain of several optimizers (Muon + AdamW)
  prefixes each one's keys with ``chained_<i>.``.
* ``rng_state`` -- a ShardedObject, one entry per global rank: python, numpy,
  torch CPU, CUDA (when present) and megatron's tensor-parallel RNG tracker
  states. Restored only when the parallel layout is unchanged.
* common (``common.pt``, identical on all ranks): ``rng_default`` (rank 0's
  python/numpy/torch generators, restored on a resharded resume), ``iteration``,
  ``consumed_train_samples``, ``nonfinite_skipped``, ``scheduler`` (the LR
  schedule's state dict), ``curriculum`` (``{"depth": ...}``), ``layout``
  (tp/pp/ep/dp/world of the saving run), ``optimizer_kind`` (``adam``, ``muon``, or Muon with
  the layer-wise distributed optimizer: only the same kind resumes the optimizer state), ``format_version``.

``run_config.yaml`` is ``ExperimentConfig.to_dict()`` with ``model.vocab_size``
set to the padded vocabulary the weights have (so ``load_config(...,
check_data=False)`` rebuilds the model), plus a top-level ``checkpoint:``
section (the checkpoint's record, not a setting: ``load_config`` and
:func:`read_run_config` set it aside) with
``iteration``, ``consumed_train_samples``, ``padded_vocab_size``,
``tokenizer`` (type, file paths, copied file names, ``vocab_size``, ``eod_id``),
``layout``, ``key_prefix: model.`` and ``format: torch_dist``.

Resume rules (:func:`resolve_load`): if ``training.resume`` and ``save`` holds a
complete checkpoint, continue from it -- everything restored, so the resumed run
sees exactly the samples and random numbers it would have. Otherwise, if
``training.load`` is set, start a stage from it (``load_iteration``,
``reset_optimizer``, ``reset_schedule``; RNG is re-seeded from
``training.seed``). A different TP/PP/EP/DP layout reshards on load.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lol.log import log_rank0
from megatron_lol.training.hooks import Hook, Stop
from megatron_lol.training.optimizer import optimizer_state_kind

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
KEY_PREFIX = "model."
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp_"
DISTRIB_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
TOKENIZER_COPY_LIMIT = 64 << 20


class NonFiniteWeightsError(FloatingPointError):
    """Refused to save: some model weight is NaN or Inf."""


class CheckpointNotFoundError(RuntimeError):
    pass


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


# ------------------------------------------------------------------ layout
def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iter_name(iteration))


def tmp_dir(root: str, iteration: int) -> str:
    return os.path.join(root, TMP_PREFIX + iter_name(iteration))


def read_tracker(root: Optional[str]) -> Optional[int]:
    """The iteration named by ``{root}/latest_checkpointed_iteration.txt``, or None."""
    if not root:
        return None
    path = os.path.join(root, TRACKER)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        raise CheckpointNotFoundError(f"{path}: expected an integer iteration, got {text!r}") from None


def write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER)
    with open(path + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def list_checkpoints(root: str) -> list:
    """Iterations of the complete ``iter_*`` directories under ``root``, ascending."""
    out = []
    if not root or not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        if name.startswith("iter_") and os.path.isdir(os.path.join(root, name)):
            try:
                out.append(int(name[5:]))
            except ValueError:
                continue
    return sorted(out)


def latest_checkpoint(root: Optional[str]) -> Optional[int]:
    """The tracker's iteration if its directory exists, else None."""
    it = read_tracker(root)
    if it is None:
        return None
    if not os.path.exists(os.path.join(checkpoint_dir(root, it), "metadata.json")):
        raise CheckpointNotFoundError(
            f"{os.path.join(root, TRACKER)} names iteration {it} but {checkpoint_dir(root, it)} "
            f"is missing or incomplete")
    return it


def read_run_config(path: str):
    """``(ExperimentConfig, checkpoint_info)`` from a checkpoint dir or its run_config.yaml."""
    import yaml

    from megatron_lol.config import config_from_dict

    if os.path.isdir(path):
        path = os.path.join(path, RUN_CONFIG)
    with open(path) as f:
        raw = yaml.safe_load(f)
    info = raw.pop("checkpoint", {})
    return config_from_dict(raw, check_data=False), info


# ------------------------------------------------------------------ state
def parallel_layout(trainer) -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world": torch.distributed.get_world_size(),
    }


def _rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    from megatron_lol.platform import cuda_available

    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    from megatron_lol.platform import cuda_available

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and cuda_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _default_rng_state_rank0() -> dict:
    """Rank 0's python/numpy/torch(/CUDA) generator states, the same object on every rank."""
    state = _rng_state()
    state.pop("tracker")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [state if _rank() == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def _set_default_rng_state(state: dict) -> None:
    import numpy as np

    from megatron_lol.platform import cuda_available

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and cuda_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_sharded_object(data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = torch.distributed.get_world_size()
    return ShardedObject("rng_state", data, (world,), (_rank(),), replica_id=0)


def _model_sharded_state_dict(trainer) -> dict:
    return model_sharded_state_dict(trainer.model, KEY_PREFIX)


def model_sharded_state_dict(model, prefix: str = KEY_PREFIX, metadata: Optional[dict] = None) -> dict:
    """The model's ShardedTensors under ``{prefix}<state_dict key>``, correct for any TP/PP/EP layout.

    ``LoLGPTModel.sharded_state_dict`` walks the module tree (layers in plain
    containers keep their tensor-parallel sharding), gives expert-sharded blocks
    their expert-data-parallel replica ids and marks pipeline-stage copies of
    the library as secondary replicas: see :mod:`megatron_lol.parallel.sharded_state`.
    """
    return model.sharded_state_dict(prefix=prefix, metadata=metadata)


def _optimizer_sharded_state_dict(trainer, model_sd: dict, is_loading: bool) -> dict:
    kwargs = {"is_loading": is_loading}
    if trainer.cfg.parallel.use_distributed_optimizer:
        kwargs["metadata"] = dict(DISTRIB_OPTIM_METADATA)
    return trainer.optimizer.sharded_state_dict(model_sd, **kwargs)


def build_save_state(trainer) -> dict:
    model_sd = _model_sharded_state_dict(trainer)
    state = {
        "model": model_sd,
        "optimizer": _optimizer_sharded_state_dict(trainer, model_sd, is_loading=False),
        "rng_state": _rng_sharded_object(_rng_state()),
        # layout-independent fallback for a resharded resume
        "rng_default": _default_rng_state_rank0(),
        "scheduler": trainer.scheduler.state_dict(),
        "iteration": int(trainer.iteration),
        "consumed_train_samples": int(trainer.consumed_train_samples),
        "nonfinite_skipped": int(getattr(trainer, "nonfinite_skipped", 0)),
        "curriculum": {"depth": int(trainer.depth_at(trainer.iteration))},
        "layout": parallel_layout(trainer),
        "optimizer_kind": optimizer_state_kind(trainer.cfg),
        "format_version": FORMAT_VERSION,
    }
    return state


def weights_finite(trainer) -> bool:
    """True when every model weight and buffer is finite on every rank (one all-reduce)."""
    from megatron_lol.platform import device

    ok = True
    with torch.no_grad():
        for t in list(trainer.model.parameters()) + list(trainer.model.buffers()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                ok = False
                break
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device())
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item()) == 0


def run_config_dict(trainer) -> dict:
    cfg = trainer.cfg.to_dict()
    cfg["model"]["vocab_size"] = int(trainer.vocab_size)
    d = trainer.cfg.data
    tok = trainer.tokenizer
    cfg["checkpoint"] = {
        "iteration": int(trainer.iteration),
        "consumed_train_samples": int(trainer.consumed_train_samples),
        "padded_vocab_size": int(trainer.vocab_size),
        "tokenizer": {
            "type": d.tokenizer_type,
            "tokenizer_model": os.path.abspath(d.tokenizer_model) if d.tokenizer_model else None,
            "vocab_file": os.path.abspath(d.vocab_file) if d.vocab_file else None,
            "merge_file": os.path.abspath(d.merge_file) if d.merge_file else None,
            "copied_files": {},
            "vocab_size": int(tok.vocab_size),
            "eod_id": None if trainer.eod_id is None else int(trainer.eod_id),
        },
        "layout": parallel_layout(trainer),
        "key_prefix": KEY_PREFIX,
        "format": "torch_dist",
        "format_version": FORMAT_VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        import megatron.core

        cfg["checkpoint"]["megatron_core_version"] = megatron.core.__version__
    except Exception:  # pragma: no cover
        pass
    return cfg


def _write_run_config(info: dict, directory: str) -> None:
    import yaml

    tok = info["checkpoint"]["tokenizer"]
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        src = tok.get(key)
        if src and os.path.isfile(src) and os.path.getsize(src) <= TOKENIZER_COPY_LIMIT:
            os.makedirs(os.path.join(directory, "tokenizer"), exist_ok=True)
            rel = os.path.join("tokenizer", os.path.basename(src))
            shutil.copyfile(src, os.path.join(directory, rel))
            tok["copied_files"][key] = rel
    with open(os.path.join(directory, RUN_CONFIG), "w") as f:
        yaml.safe_dump(info, f, sort_keys=False)


# ------------------------------------------------------------------ save
_WRITER_MANAGER = None


def prepare_writer_processes() -> None:
    """Start megatron's checkpoint-writer results queue ourselves, signal-proof.

    ``filesystem_async`` keeps one ``multiprocessing`` Manager (spawn context)
    per process for the results of its writer processes. Slurm signals every
    process of a job step, so that Manager would die of the very SIGUSR1/SIGTERM
    whose save needs it ("Connection refused" in the middle of the save). Ours
    ignores those signals; the training process still receives and handles them.
    """
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_lol.training import signals

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=signals.ignore_preemption_signals)
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGER = manager


PAUSE_ENV = "MEGATRON_LOL_CKPT_PAUSE"


def _maybe_pause(iteration: int, tmp: str) -> None:
    """Fault injection for tests: ``MEGATRON_LOL_CKPT_PAUSE=ITER:SECONDS`` sleeps after the
    shards of iteration ITER are written and before the checkpoint is committed, so a test
    can ``kill -9`` a run in the middle of a save."""
    raw = os.environ.get(PAUSE_ENV)
    if not raw:
        return
    at, _, seconds = raw.partition(":")
    if int(at) == iteration:
        log_rank0(f" checkpoint: pausing {seconds} s before committing {tmp} ({PAUSE_ENV})")
        time.sleep(float(seconds or 60))


@dataclass
class _PendingSave:
    iteration: int
    tmp: str
    final: str
    started: float


class Checkpointer:
    """Saves and loads a :class:`Trainer`'s complete state; see the module docstring."""

    def __init__(self, trainer):
        self.trainer = trainer
        tr = trainer.cfg.training
        self.save_root = tr.save
        self.keep_last = tr.keep_last
        self.async_save = tr.async_save
        self._queue = None
        self._pending: list = []
        self.last_saved_iteration: Optional[int] = None
        self.loaded_from: Optional[str] = None
        self.save_seconds: list = []

    # --------------------------------------------------------------- save
    def save(self, blocking: bool = False) -> Optional[str]:
        """Save the trainer's state as ``iter_{iteration}``; returns the final path.

        With ``async_save`` the write continues in the background unless
        ``blocking``; the tracker is written when it is finalized.
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
                f"(previous checkpoint kept: {read_tracker(self.save_root)})")
        # one save in flight at a time: finish the previous async one first
        self.finalize(blocking=True)
        t0 = time.perf_counter()
        root, tmp, final = self.save_root, tmp_dir(self.save_root, it), checkpoint_dir(self.save_root, it)
        if _rank() == 0:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # leftovers of killed saves
                if name.startswith(TMP_PREFIX):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        state = build_save_state(trainer)
        info = run_config_dict(trainer)
        request = dist_checkpointing.save(state, tmp, async_sharded_save=self.async_save)
        _maybe_pause(it, tmp)
        pending = _PendingSave(it, tmp, final, t0)
        self.last_saved_iteration = it
        if request is None:
            self._commit(pending, info)
            return final
        request.finalize_fns.append(lambda: self._commit(pending, info))
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(request)
        log_rank0(f" checkpoint: async save of iteration {it} started ({time.perf_counter() - t0:.2f} s blocking)")
        if blocking:
            self.finalize(blocking=True)
        return final

    def _commit(self, pending: _PendingSave, info: dict) -> None:
        """All ranks: after every rank's shards (and metadata) are on disk."""
        _barrier()
        if _rank() == 0:
            _write_run_config(info, pending.tmp)
            _fsync_dir(pending.tmp)
            if os.path.exists(pending.final):
                # a complete copy the tracker does not name (killed between rename and tracker)
                if read_tracker(self.save_root) == pending.iteration:  # pragma: no cover - guarded by caller
                    raise RuntimeError(f"{pending.final} is the tracked checkpoint; not overwriting it")
                shutil.rmtree(pending.final)
            os.rename(pending.tmp, pending.final)
            _fsync_dir(self.save_root)
            write_tracker(self.save_root, pending.iteration)
            self._prune()
        _barrier()
        seconds = time.perf_counter() - pending.started
        self.save_seconds.append(seconds)
        log_rank0(f" checkpoint: saved iteration {pending.iteration} to {pending.final} ({seconds:.2f} s)")

    def _prune(self) -> None:
        if not self.keep_last:
            return
        tracked = read_tracker(self.save_root)
        its = [i for i in list_checkpoints(self.save_root) if i != tracked]
        its = sorted(its + ([tracked] if tracked is not None else []))
        for old in its[:-self.keep_last]:
            if old != tracked:
                shutil.rmtree(checkpoint_dir(self.save_root, old), ignore_errors=True)

    def finalize(self, blocking: bool = False) -> None:
        """Finalize finished async saves (all ranks must call this at the same point)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    # --------------------------------------------------------------- load
    def load(self, directory: str, iteration: Optional[int] = None, *, resume: bool = True,
             load_optimizer: bool = True, load_schedule: bool = True) -> int:
        """Restore from ``{directory}/iter_{iteration}`` (default: the tracker's).

        ``resume``: same run continuing -- RNG states are restored too (when the
        layout is unchanged). ``load_schedule`` False: iteration, LR schedule,
        data position and skip count stay at 0 (a new stage).
        """
        from megatron.core import dist_checkpointing

        trainer = self.trainer
        if iteration is None:
            iteration = latest_checkpoint(directory)
            if iteration is None:
                raise CheckpointNotFoundError(f"no checkpoint tracker {os.path.join(directory, TRACKER)}")
        path = checkpoint_dir(directory, iteration)
        if not os.path.exists(os.path.join(path, "metadata.json")):
            raise CheckpointNotFoundError(f"{path} is not a complete checkpoint")
        t0 = time.perf_counter()
        common = dist_checkpointing.load_common_state_dict(path)
        layout = parallel_layout(trainer)
        load_rng = resume and common.get("layout") == layout
        model_sd = _model_sharded_state_dict(trainer)
        request = {"model": model_sd}
        # a chain of several optimizers (Muon + AdamW, expert groups) prefixes its keys with chained_<i>.
        has_optimizer = load_optimizer and any(k.startswith(("optimizer", "chained_")) for k in _ckpt_keys(path))
        if load_optimizer and not has_optimizer:
            log_rank0(f" checkpoint: {path} has no optimizer state; starting it fresh")
        saved_kind, kind = common.get("optimizer_kind", "adam"), optimizer_state_kind(trainer.cfg)
        if has_optimizer and saved_kind != kind:
            from megatron_lol.errors import CliError

            raise CliError(f"{path}: holds the optimizer state of {saved_kind}, this run uses {kind}; to switch, "
                           f"start a new --save from --load {directory} with training.reset_optimizer: true")
        if has_optimizer:
            request["optimizer"] = _optimizer_sharded_state_dict(trainer, model_sd, is_loading=True)
        if load_rng:
            request["rng_state"] = _rng_sharded_object(None)
        state = dist_checkpointing.load(request, path)
        model_state = {k[len(KEY_PREFIX):] if k.startswith(KEY_PREFIX) else k: v
                       for k, v in state["model"].items()}
        trainer.model.load_state_dict(model_state, strict=True)
        if has_optimizer:
            trainer.optimizer.load_state_dict(state["optimizer"])
        if load_schedule:
            sched = trainer.scheduler
            # the config wins for max/min lr, warmup and decay; the position comes from the checkpoint
            override = sched.override_opt_param_scheduler
            sched.override_opt_param_scheduler = True
            try:
                sched.load_state_dict(common["scheduler"])
            finally:
                sched.override_opt_param_scheduler = override
            trainer.iteration = int(common["iteration"])
            trainer.consumed_train_samples = int(common["consumed_train_samples"])
            trainer.nonfinite_skipped = int(common.get("nonfinite_skipped", 0))
        if load_rng:
            _set_rng_state(state["rng_state"])
        elif resume:
            if "rng_default" in common:
                _set_default_rng_state(common["rng_default"])
            log_rank0(f" checkpoint: parallel layout changed {common.get('layout')} -> {layout}: weights and "
                      f"optimizer resharded, default RNGs from saving rank 0, tensor-parallel RNG re-seeded")
        _barrier()
        self.loaded_from = path
        if directory == self.save_root:
            self.last_saved_iteration = int(common["iteration"])
        log_rank0(f" checkpoint: loaded {path} (iteration {common['iteration']}, consumed samples "
                  f"{common['consumed_train_samples']}, optimizer {'loaded' if has_optimizer else 'fresh'}, "
                  f"schedule {'loaded' if load_schedule else 'reset'}, "
                  f"rng {'loaded' if load_rng else 'rank-0 default' if resume else 'fresh'}) "
                  f"in {time.perf_counter() - t0:.2f} s")
        return iteration

    def resolve_and_load(self) -> Optional[str]:
        """Apply the resume rules of the module docstring; returns the path loaded, if any."""
        tr = self.trainer.cfg.training
        if tr.resume and tr.save and latest_checkpoint(tr.save) is not None:
            self.load(tr.save, resume=True)
            return self.loaded_from
        if tr.load:
            same = tr.save and os.path.abspath(tr.load) == os.path.abspath(tr.save)
            if same and not tr.resume:
                log_rank0(f" checkpoint: --no-resume: not loading {tr.load}")
                return None
            self.load(tr.load, tr.load_iteration, resume=False,
                      load_optimizer=not tr.reset_optimizer, load_schedule=not tr.reset_schedule)
            return self.loaded_from
        return None


def _ckpt_keys(path: str) -> set:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return set(load_tensors_metadata(path).keys())


# ------------------------------------------------------------------ hook
class CheckpointHook(Hook):
    """Loads at start; saves every ``save_interval``, at the end, and before a preemption exit."""

    def __init__(self):
        self.ckpt: Optional[Checkpointer] = None
        self.stop_check = None

    def on_start(self, trainer) -> None:
        from megatron_lol.training import signals

        self.ckpt = Checkpointer(trainer)
        trainer.checkpointer = self.ckpt
        if trainer.cfg.training.save:
            prepare_writer_processes()
        self.ckpt.resolve_and_load()
        signals.install_handlers()  # a signal caught during start-up (train's CLI listens early) stays set
        if _rank() == 0:
            signals.clear_requeue_marker(trainer.cfg.training.save)
        self.stop_check = signals.StopCheck(trainer.cfg.training.exit_duration_in_mins)

    def on_step_end(self, trainer, result) -> Optional[Stop]:
        from megatron_lol.training import signals

        tr = trainer.cfg.training
        self.ckpt.finalize(blocking=False)
        reason = self.stop_check()
        if reason is not None:
            if trainer.iteration >= tr.train_iters:
                return None  # finished anyway; on_end saves
            log_rank0(f" preemption: {reason} at iteration {trainer.iteration}: saving and exiting "
                      f"with status {signals.EXIT_REQUEUE}")
            if tr.save:
                self.ckpt.save(blocking=True)
                if _rank() == 0:
                    signals.write_requeue_marker(tr.save, trainer.iteration, reason)
                # launchers kill the other ranks as soon as one exits non-zero: nobody leaves
                # before the checkpoint *and* the marker are on disk
                _barrier()
            else:
                log_rank0(" preemption: no training.save directory: nothing saved")
            return Stop(signals.EXIT_REQUEUE, reason)
        if tr.save and tr.save_interval and trainer.iteration % tr.save_interval == 0:
            self.ckpt.save()
        return None

    def on_end(self, trainer, stop: Optional[Stop]) -> None:
        tr = trainer.cfg.training
        try:
            if tr.save and trainer.iteration >= tr.train_iters and stop is None:
                self.ckpt.save(blocking=True)
            self.ckpt.finalize(blocking=True)
        finally:
            self.ckpt.close()
            from megatron_lol.training import signals

            signals.clear()  # handled: a later run in this process starts without it
