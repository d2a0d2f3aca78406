"""Initialisation that does not depend on the parallel layout.

The same seed gives the same initial weights whatever the layout: every rank
draws the full master weight of each component it builds from that
component's own RNG stream (:func:`seeded`), and megatron-core's MoE experts
are re-initialised by their global index (:func:`seed_experts_by_global_index`).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Optional

import torch
from torch import nn


@contextlib.contextmanager
def seeded(seed: Optional[int], key: str):
    """Initialise one component from its own RNG stream, derived from (seed, key).

    Every rank draws the full master weight of each component it builds from
    the same stream, whatever else it builds: so the same seed gives the same
    initial weights whatever the parallel layout (TP splits the master weight;
    a pipeline stage or expert-parallel rank that skips other components does
    not shift this one's stream).
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
        yield


def seed_experts_by_global_index(model: nn.Module, seed: Optional[int]) -> None:
    """Give every MoE expert its own initialisation stream, keyed by its *global* index.

    megatron-core builds a rank's local experts one after another from one
    stream, so under expert parallelism rank 1's first expert would start like
    rank 0's first, and a layout would change the weights. Each local expert is
    re-initialised from a fresh megatron ``MLP`` built under ``seeded(seed,
    "<layer>.experts.<global index>")`` (same class, config and TP group; TP
    still splits the full master weight), so any EP x TP layout starts from the
    weights of one process.
    """
    if seed is None:
        return
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    ep = parallel_state.get_expert_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0
    for name, module in model.named_modules():
        if not isinstance(module, SequentialMLP):
            continue
        for i, expert in enumerate(module.local_experts):
            global_index = ep_rank * module.num_local_experts + i
            sub = MLPSubmodules(linear_fc1=type(expert.linear_fc1), linear_fc2=type(expert.linear_fc2))
            with seeded(seed, f"{name}.{global_index}"):
                fresh = MLP(
                    module.config,
                    sub,
                    ffn_hidden_size=module.config.moe_ffn_hidden_size,
                    is_expert=True,
                    tp_group=module.tp_group,
                )
            with torch.no_grad():
                for (n, p), (n2, q) in zip(expert.named_parameters(), fresh.named_parameters()):
                    assert n == n2 and p.shape == q.shape, (name, n, n2)
                    p.copy_(q)
