"""The model's parameter inventory, read off the built model (as torchtitan counts).

:func:`parameter_shapes` builds the same :class:`~megatron_lol.model.lol_model.LoLGPTModel`
the trainer builds, at tensor-, pipeline- and expert-parallel size 1, on the ``meta``
device (no storage is allocated and no initialiser runs), and returns every
``named_parameters()`` entry with its shape. Parameter counts
(:mod:`megatron_lol.model.params`) are sums over this walk, so a new part of a plan is
counted the moment the model builds it; nothing restates the model's shapes by hand.

The build needs megatron-core's process state at size 1. In a process that has none
(``megatron-lol params``, analysis) it is set up for the build and torn down after; a
process whose state is already size 1 (tests) builds in place; a process of a larger
parallel run (the trainer's FLOP and memory figures) asks a child process, whose state
it would otherwise disturb. Walks are cached per (model config, vocabulary).

Counting always uses megatron-core's local layer spec with its sequential experts: the
Transformer Engine spec holds the same parameters under other names (norm gains fused
into the next linear, grouped expert weights), and FP8 changes no count.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_lol.config.schema import ModelConfig

_CACHE: dict = {}

# the child process of a larger parallel run: a lone process on the CPU
_RUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def parameter_shapes(model: ModelConfig, vocab_size: int) -> dict:
    """``{name: shape}`` of every parameter of ``LoLGPTModel(model, vocab_size)`` at TP = PP = EP = 1,
    in ``named_parameters()`` order."""
    return dict(_walk(model, vocab_size)["parameters"])


def state_shapes(model: ModelConfig, vocab_size: int) -> dict:
    """``{name: shape}`` of every tensor of that model's ``state_dict()`` (parameters and persistent
    buffers such as MoE expert biases; megatron-core's empty ``_extra_state`` entries left out), in
    ``state_dict()`` order."""
    return dict(_walk(model, vocab_size)["state"])


def _walk(model: ModelConfig, vocab_size: int) -> dict:
    key = (repr(model), vocab_size)
    if key not in _CACHE:
        _CACHE[key] = _walk_here(model, vocab_size) if _can_build_here() else _walk_in_child(model, vocab_size)
    return _CACHE[key]


def _counting_config(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(
        model, precision=dataclasses.replace(model.precision, transformer_engine=False, fp8=None)
    )


def _can_build_here() -> bool:
    """No parallel state yet, or a world of one with everything at size 1."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return True
    if dist.get_world_size() != 1:
        return False
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    sizes = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
    )
    return sizes == (1, 1, 1, 1)


@contextmanager
def _size_one_state():
    """megatron-core's process state at size 1 for the build; what this sets up, it tears down."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lol.platform import setup_platform

    setup_platform()
    made_group = not dist.is_initialized()
    if made_group:
        # an in-memory store: no port, and no torchrun variables read (a parent's MASTER_PORT may be taken)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    made_state = not ps.model_parallel_is_initialized()
    if made_state:
        ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if made_state:
            ps.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()


def _walk_here(model: ModelConfig, vocab_size: int) -> dict:
    # imported here: megatron-core's import costs seconds, and this module's importers
    # (config checks, FLOP and memory models) need it only when they count
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from megatron_lol.model.library import transformer_config
    from megatron_lol.model.lol_model import LoLGPTModel

    m = _counting_config(model)
    n_layers = m.n_prelude + m.n_coda + m.execution_plan().num_stored_blocks
    # building an MoE model clears megatron-core's process-global MoE loss tracker: keep a live run's
    tracker = get_moe_layer_wise_logging_tracker()
    saved = dict(tracker)
    with _size_one_state():
        tconfig = dataclasses.replace(transformer_config(m, num_layers=n_layers), perform_initialization=False)
        try:
            with torch.device("meta"):
                built = LoLGPTModel(m, vocab_size, eod_id=0, tconfig=tconfig, init_seed=None)
        finally:
            tracker.clear()
            tracker.update(saved)
        return {
            "parameters": {name: tuple(p.shape) for name, p in built.named_parameters()},
            "state": {name: tuple(t.shape) for name, t in built.state_dict().items() if isinstance(t, torch.Tensor)},
        }


def _walk_in_child(model: ModelConfig, vocab_size: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RUN_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the meta build needs no device; leave the run's GPUs alone
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "shapes.pkl"  # a file, not stdout: libraries print there
        done = subprocess.run(
            [sys.executable, "-m", "megatron_lol.model.inventory", str(out)],
            input=pickle.dumps((model, vocab_size)),
            capture_output=True,
            env=env,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"counting parameters in a child process failed: {tail[0]}")
        return pickle.loads(out.read_bytes())


def _child_main(out: str) -> None:
    model, vocab_size = pickle.loads(sys.stdin.buffer.read())
    Path(out).write_bytes(pickle.dumps(_walk_here(model, vocab_size)))


if __name__ == "__main__":
    _child_main(sys.argv[1])
