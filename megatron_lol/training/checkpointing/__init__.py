"""Checkpoints with megatron-core distributed checkpointing (``torch_dist``).

Layout of a save directory ``{save}``::

    {save}/latest_checkpointed_iteration.txt   # one integer; written last
    {save}/iter_0000123/                       # complete checkpoints only
        metadata.json, common.pt, .metadata, __*.distcp   # megatron dist_checkpointing (torch_dist)
        run_config.yaml                        # the run's ExperimentConfig + checkpoint info
        tokenizer/                             # copies of the tokenizer file(s), when small
        checksums.json                         # size and SHA-256 of every file above
    {save}/.tmp_iter_0000124/                  # a save in progress (or killed): never loaded
    {save}/.writer.lock                        # flock held by the one run writing here
    {save}/metrics.jsonl

A save writes into ``.tmp_iter_XXXXXXX``; when every rank has finished (for
async saves: after megatron's finalize, metadata.json included) each rank
digests the shard files it wrote, rank 0 writes ``checksums.json``, renames the
directory to ``iter_XXXXXXX`` and only then rewrites the tracker (via
``os.replace``). A process killed at any moment therefore leaves the tracker
pointing at the previous complete checkpoint. Old checkpoints beyond
``keep_last`` are deleted only after the tracker names the new one. Weights
that are not all finite are never written (:class:`NonFiniteWeightsError`); a
write that fails (disk full: the message says ENOSPC) removes its partial save
and stops the run with a one-line :class:`CheckpointError`.

Modules: :mod:`.files` (names, tracker, completeness, checksums, metrics
truncation), :mod:`.lock` (one writer per save directory), :mod:`.safe_load`
(restricted unpickling of ``.metadata``, one-line load errors), :mod:`.state`
(what is saved), :mod:`.resolve` (what a run will load, and whether it may write its save
directory: the checks ``train --dry-run`` shares with the run), :mod:`.checkpointer`
(:class:`Checkpointer`, :class:`CheckpointHook`).

Keys inside the ``torch_dist`` checkpoint (what a converter reads):

* ``model.<key>`` -- each entry of the LoLGPTModel's ``state_dict()`` (the inner
  module, not the DDP wrapper), as a *global* (unsharded-shape) tensor, e.g.
  ``model.embedding.word_embeddings.weight`` [padded_vocab, hidden],
  ``model.core.balancer.bias`` (balancing bias), ``model.output_layer.weight``.
  Load them without process groups with
  ``megatron_lol.convert.checkpoint.DistCheckpointReader`` (or
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
  schedule's state dict), ``schedule`` (``{"train_iters": ...}``: what the depth
  growth and the bias stop are measured against), ``curriculum`` (``{"depth": ...}``), ``layout``
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

Resume rules (:meth:`Checkpointer.resolve_and_load`):

* ``training.resume`` (the default) and ``save`` names a checkpoint in its
  tracker: continue from it -- everything restored, so the resumed run sees
  exactly the samples and random numbers it would have. Without a tracker, the
  newest ``iter_*`` directory is resumed only if its ``checksums.json`` proves
  it complete; otherwise the run stops and names the directories. A tracker
  holding garbage or naming a missing directory stops the run too.
* A resume whose learning-rate, growth or bias-stop schedule differs from the
  checkpoint's (e.g. another ``--train-iters``) stops with one line before
  reading any state, unless ``--override-opt_param-scheduler`` (this run's) or
  ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's) says which wins
  (:mod:`.schedule`; Megatron-LM's behaviour).
* ``--no-resume`` into a ``save`` that already holds checkpoints stops: they
  would be overwritten.
* Otherwise, if ``training.load`` is set, start a stage from it
  (``load_iteration``, ``reset_optimizer``, ``reset_schedule``; RNG is
  re-seeded from ``training.seed``; the stage's own schedule settings apply). A different
  TP/PP/EP/DP layout reshards on load.

Every load checks the files against ``checksums.json`` first
(``training.verify_checksums: false`` skips that for very large checkpoints)
and reads ``.metadata`` through a restricted unpickler. A resumed run drops the
records of ``metrics.jsonl`` after its checkpoint's step (they are logged again).
"""

# each name of the interface, by the submodule that defines it; imported on first use, so that the
# file-level checks (:mod:`.files`, :mod:`.resolve`: what ``train --dry-run`` reads) do not import torch
_SOURCES = {
    "checkpointer": ("CheckpointHook", "Checkpointer", "agree"),
    "writer_manager": ("prepare_writer_processes",),
    "files": (
        "MANIFEST",
        "RUN_CONFIG",
        "TMP_PREFIX",
        "TRACKER",
        "CheckpointError",
        "CheckpointNotFoundError",
        "checkpoint_dir",
        "iter_name",
        "latest_checkpoint",
        "list_checkpoints",
        "read_tracker",
        "resume_iteration",
        "tmp_dir",
        "write_tracker",
    ),
    "lock": ("LOCK_FILE", "SaveDirLock"),
    "resolve": ("LoadPlan", "load_plan", "check_save_dir"),
    "safe_load": ("RestrictedUnpickler", "read_metadata_file", "restricted_unpickling"),
    "state": (
        "DISTRIB_OPTIM_METADATA",
        "FORMAT_VERSION",
        "KEY_PREFIX",
        "NonFiniteWeightsError",
        "build_save_state",
        "model_sharded_state_dict",
        "parallel_layout",
        "read_run_config",
        "run_config_dict",
        "weights_finite",
    ),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


# the package's interface: each name is defined in the submodule _SOURCES names
__all__ = [name for names in _SOURCES.values() for name in names]
