"""What a checkpoint holds: the sharded state of model and optimizer, RNGs, run config.

See the package docstring (:mod:`megatron_lol.training.checkpointing`) for the
keys and the ``run_config.yaml`` contract that converters rely on.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from typing import Optional

import torch

from megatron_lol.training.checkpointing.files import RUN_CONFIG
from megatron_lol.training.optimizer import optimizer_state_kind

KEY_PREFIX = "model."
FORMAT_VERSION = 1
DISTRIB_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
TOKENIZER_COPY_LIMIT = 64 << 20


class NonFiniteWeightsError(FloatingPointError):
    """Refused to save: some model weight is NaN or Inf."""


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def gather_to_all(value) -> list:
    """``value`` of every rank, on every rank (one ``all_gather_object``)."""
    if world_size() == 1:
        return [value]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, value)
    return out


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


def set_rng_state(state: dict) -> None:
    """Every generator of :func:`_rng_state`: the default ones and megatron's tensor-parallel tracker."""
    from megatron.core import tensor_parallel

    set_default_rng_state(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _default_rng_state_rank0() -> dict:
    """Rank 0's python/numpy/torch(/CUDA) generator states, the same object on every rank."""
    state = _rng_state()
    state.pop("tracker")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [state if rank() == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def set_default_rng_state(state: dict) -> None:
    import numpy as np

    from megatron_lol.platform import cuda_available

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and cuda_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_sharded_object(data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = torch.distributed.get_world_size()
    return ShardedObject("rng_state", data, (world,), (rank(),), replica_id=0)


def trainer_model_state(trainer) -> dict:
    return model_sharded_state_dict(trainer.model, KEY_PREFIX)


def model_sharded_state_dict(model, prefix: str = KEY_PREFIX, metadata: Optional[dict] = None) -> dict:
    """The model's ShardedTensors under ``{prefix}<state_dict key>``, correct for any TP/PP/EP layout.

    ``LoLGPTModel.sharded_state_dict`` walks the module tree (layers in plain
    containers keep their tensor-parallel sharding), gives expert-sharded blocks
    their expert-data-parallel replica ids and marks pipeline-stage copies of
    the library as secondary replicas: see :mod:`megatron_lol.parallel.sharded_state`.
    """
    return model.sharded_state_dict(prefix=prefix, metadata=metadata)


def optimizer_sharded_state_dict(trainer, model_sd: dict, is_loading: bool) -> dict:
    kwargs = {"is_loading": is_loading}
    if trainer.cfg.parallel.use_distributed_optimizer:
        kwargs["metadata"] = dict(DISTRIB_OPTIM_METADATA)
    return trainer.optimizer.sharded_state_dict(model_sd, **kwargs)


def build_save_state(trainer) -> dict:
    from megatron_lol.training.checkpointing.schedule import schedule_record

    model_sd = trainer_model_state(trainer)
    state = {
        "model": model_sd,
        "optimizer": optimizer_sharded_state_dict(trainer, model_sd, is_loading=False),
        "rng_state": rng_sharded_object(_rng_state()),
        # layout-independent fallback for a resharded resume
        "rng_default": _default_rng_state_rank0(),
        "scheduler": trainer.scheduler.state_dict(),
        "schedule": schedule_record(trainer),  # the iterations growth and bias stop are measured against
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


def _recorded_tokenizer_model(data, tok):
    """The tokenizer file the checkpoint records (and copies): the config's path made absolute, or for a
    HuggingFace Hub name the ``tokenizer.json`` it was read from in the local Hub cache."""
    if not data.tokenizer_model:
        return None
    if data.tokenizer_on_hub() and getattr(tok, "files", None):
        return os.path.abspath(tok.files[0])
    return os.path.abspath(data.tokenizer_model)


def run_config_dict(trainer) -> dict:
    cfg = trainer.cfg.to_dict()
    cfg["model"]["vocab_size"] = int(trainer.vocab_size)
    if cfg["training"].get("train_flops") is not None:
        cfg["training"]["train_iters"] = None  # derived from the budget, which the file keeps: reloadable as is
    d = trainer.cfg.data
    tok = trainer.tokenizer
    cfg["checkpoint"] = {
        "iteration": int(trainer.iteration),
        "consumed_train_samples": int(trainer.consumed_train_samples),
        "padded_vocab_size": int(trainer.vocab_size),
        "tokenizer": {
            "type": d.tokenizer_type,
            "tokenizer_model": _recorded_tokenizer_model(d, tok),
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


def write_run_config(info: dict, directory: str) -> None:
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
