"""Distributed-checkpoint keys of a LoL model that are the same for every layout.

megatron-core's default ``MegatronModule.sharded_state_dict`` treats children
without a ``sharded_state_dict`` of their own (``ModuleDict`` containers, the
routed core) as replicated, so tensor-parallel shards inside them would be
saved with their local shape. Here the module tree is walked instead: modules
with their own implementation (``TransformerLayer``, parallel linears,
embeddings) provide theirs, everything else contributes its direct parameters
and buffers (replicated over TP and DP) and recurses.

Two LoL-specific facts on top:

* expert parallelism shards the block library: a block exists on one EP rank
  and is replicated only over the expert-data-parallel group, which therefore
  gives its replica ids;
* pipeline stages that host routed depths all hold the library (same keys):
  the first stage's copy is the main replica, later stages mark theirs as
  secondary (collective over the pipeline group).

Keys are global (layers by global index, blocks by library index), so a
checkpoint saved on one layout loads on any other.
"""

from __future__ import annotations

from typing import Optional

import torch


def lol_sharded_state_dict(model, prefix: str = "", metadata: Optional[dict] = None) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    defaults = {MegatronModule.sharded_state_dict, LanguageModule.sharded_state_dict}
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    tp_group = ps.get_tensor_model_parallel_group()
    core = getattr(model, "core", None)
    expert_sharded = core is not None and core.plan.shards_library and ps.get_expert_model_parallel_world_size() > 1
    block_metadata = dict(metadata, dp_cp_group=ps.get_expert_data_parallel_group()) if expert_sharded else metadata

    def walk(module, pfx: str, md: dict) -> dict:
        fn = getattr(type(module), "sharded_state_dict", None)
        if module is not model and fn is not None and fn not in defaults:
            return module.sharded_state_dict(pfx, (), md)
        own: dict = {}
        module._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own, pfx, sharded_offsets=(), tp_group=tp_group, dp_cp_group=md["dp_cp_group"]
        )
        for name, child in module.named_children():
            child_pfx = f"{pfx}{name}."
            out.update(walk(child, child_pfx, block_metadata if child_pfx == f"{prefix}core.blocks." else md))
        return out

    sd = walk(model, prefix, metadata)
    output_key, embedding_key = f"{prefix}output_layer.weight", f"{prefix}embedding.word_embeddings.weight"
    if getattr(model, "share_embeddings_and_output_weights", False) and output_key in sd:
        model.tie_embeddings_and_output_weights_state_dict(sd, output_key, embedding_key, metadata)
    mark_pipeline_replicas(sd)
    return sd


def mark_pipeline_replicas(sd: dict) -> None:
    """Keys held by several pipeline stages: only the first stage's copy is the main replica."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return
    # ShardedTensor, ShardedObject (_extra_state) and ShardedTensorFactory (SwiGLU fc1)
    tensors = [v for v in nested_values(sd) if isinstance(v, ShardedBase)]
    keys = sorted({t.key for t in tensors})
    gathered: list = [None] * pp
    torch.distributed.all_gather_object(gathered, keys, group=ps.get_pipeline_model_parallel_group())
    me = ps.get_pipeline_model_parallel_rank()
    earlier = set().union(*[set(k) for k in gathered[:me]]) if me else set()
    for t in tensors:
        if t.key in earlier:
            rid = t.replica_id if isinstance(t.replica_id, tuple) else (t.replica_id,)
            t.replica_id = (1,) + tuple(rid[1:])
