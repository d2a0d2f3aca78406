"""Tensor names and layouts: megatron-lol (megatron-core) <-> HuggingFace.

Native names are ``LoLGPTModel.state_dict()`` keys (checkpoint keys without the
``model.`` prefix), read off the model built on the ``meta`` device
(:func:`native_shapes`), never listed by hand. Two megatron-core layouts need care:

* ``self_attention.linear_qkv.weight`` packs, for every query group ``g`` in
  turn, the rows of the ``heads / groups`` query heads of the group, then its
  key head, then its value head (``SelfAttention.get_query_key_value_tensors``);
* ``mlp.linear_fc1.weight`` of SwiGLU is ``[gate; up]`` (the checkpoint holds the
  global tensor in this order whatever the tensor-parallel size).

Both are split into HuggingFace's ``q_proj / k_proj / v_proj`` and
``gate_proj / up_proj`` and merged back exactly (pure row permutations).

FFN mixture-of-experts layers (megatron-core ``MoELayer``, local spec,
``SequentialMLP``) hold ``mlp.router.weight`` ``[E, h]``, the experts and
optionally one shared expert. The checkpoint stores the experts *stacked*
over the global expert index, whatever the expert-parallel size:
``mlp.experts.experts.linear_fc1.weight`` ``[E, 2 f_e, h]`` (each expert's
``[gate; up]``) and ``mlp.experts.experts.linear_fc2.weight`` ``[E, h, f_e]``
(``SequentialMLP.sharded_state_dict`` prepends the expert axis; the module's
own ``state_dict`` says ``mlp.experts.local_experts.{i}.``). These stacked
checkpoint names are used as the native names here. The shared expert is
``mlp.shared_experts.linear_fc1.weight`` ``[2 f_s, h]`` / ``linear_fc2.weight``.
megatron-core's local spec may store the two norms of a layer as
``self_attention.linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight`` (as Transformer Engine's fused layers do);
both spellings are accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_lol.config.schema import ModelConfig
from megatron_lol.model.inventory import state_shapes
from megatron_lol.model.parts import part_of_parameter

NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    moe_ffn: int = 0  # f_e of one routed expert (0: no MoE layers)
    shared_ffn: int = 0  # f_s of the shared expert (0: none)
    expert_bias: bool = False  # MoE routers hold megatron-core's expert_bias [E] (loss-free balancing)

    @classmethod
    def of(cls, m: ModelConfig) -> "Dims":
        heads = m.num_attention_heads
        moe = m.moe.layers != "none"
        return cls(
            hidden=m.hidden_size,
            heads=heads,
            groups=m.num_query_groups or heads,
            head_dim=m.kv_channels or m.hidden_size // heads,
            ffn=m.ffn_hidden,
            moe_ffn=(m.moe.ffn_hidden_size or m.ffn_hidden) if moe else 0,
            shared_ffn=(m.moe.shared_expert_intermediate_size or 0) if moe else 0,
            expert_bias=moe and m.moe.router_enable_expert_bias,
        )


def fixed_experts(m: ModelConfig) -> int | None:
    """Experts of the prelude / coda MLPs (None: dense MLPs)."""
    return m.moe.num_experts if m.moe.layers in ("fixed", "all") else None


def core_experts(m: ModelConfig) -> int | None:
    """Experts of the core blocks' MLPs (None: dense MLPs); Foil's ``plan.experts``."""
    return m.execution_plan().core_experts


EXPERT_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2.weight"
# the module's own name of one expert's tensor, stacked over the expert index in the checkpoint
_LOCAL_EXPERT = re.compile(r"^(.*\.)mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def native_shapes(m: ModelConfig, vocab: int) -> dict[str, tuple]:
    """Every tensor a ``LoLGPTModel`` with this config saves, with its global shape, in ``state_dict()`` order.

    Read off the model itself (:func:`megatron_lol.model.inventory.state_shapes`: built on the
    ``meta`` device at TP size 1), so a part a plan adds is exported as soon as the model builds
    it; only the checkpoint's stacking of each layer's experts (module docstring) is applied here.
    """
    out: dict[str, tuple] = {}
    for name, shape in state_shapes(m, vocab).items():
        expert = _LOCAL_EXPERT.match(name)
        if expert is None:
            out[name] = shape
            continue
        prefix, index, suffix = expert.groups()
        stacked = f"{prefix}mlp.experts.experts.{suffix}"
        if int(index) != out.get(stacked, (0,))[0]:
            raise ValueError(f"{name}: experts out of order in the model's state")
        out[stacked] = (int(index) + 1, *shape)
    return out


def checkpoint_key(name: str, available) -> str | None:
    """The checkpoint key holding native tensor ``name`` (norm aliases resolved), or None."""
    key = "model." + name
    if key in available:
        return key
    for plain, fused in NORM_ALIASES.items():
        if name.endswith(plain):
            alias = "model." + name[: -len(plain)] + fused
            if alias in available:
                return alias
    return None


# ----------------------------------------------------------------- layouts
def split_qkv(w: torch.Tensor, d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = d.heads // d.groups
    g = w.view(d.groups, per + 2, d.head_dim, w.shape[-1])
    q = g[:, :per].reshape(d.heads * d.head_dim, -1)
    k = g[:, per].reshape(d.groups * d.head_dim, -1)
    v = g[:, per + 1].reshape(d.groups * d.head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    per = d.heads // d.groups
    h = q.shape[-1]
    g = torch.cat(
        [q.view(d.groups, per, d.head_dim, h), k.view(d.groups, 1, d.head_dim, h), v.view(d.groups, 1, d.head_dim, h)],
        dim=1,
    )
    return g.reshape(-1, h).contiguous()


# native layer suffix -> HF layer suffix (qkv and fc1 are split)
HF_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
}


def layer_to_hf(suffix: str, t: torch.Tensor, d: Dims) -> list[tuple[str, torch.Tensor]]:
    """HF ``(suffix, tensor)`` pairs of one native layer tensor (qkv, fc1 and the stacked experts are split)."""
    if suffix == EXPERT_FC1:  # [E, 2 f, h] -> per expert gate / up
        out = []
        for e, w in enumerate(t):
            gate, up = w.chunk(2, dim=0)
            out += [
                (f"mlp.experts.{e}.gate_proj.weight", gate.contiguous()),
                (f"mlp.experts.{e}.up_proj.weight", up.contiguous()),
            ]
        return out
    if suffix == EXPERT_FC2:
        return [(f"mlp.experts.{e}.down_proj.weight", w.contiguous()) for e, w in enumerate(t)]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = t.chunk(2, dim=0)
        return [
            ("mlp.shared_expert.gate_proj.weight", gate.contiguous()),
            ("mlp.shared_expert.up_proj.weight", up.contiguous()),
        ]
    if suffix == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(t, d)
        return [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", k), ("self_attn.v_proj.weight", v)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2, dim=0)
        return [("mlp.gate_proj.weight", gate.contiguous()), ("mlp.up_proj.weight", up.contiguous())]
    return [(HF_LAYER[suffix], t)]


def split_layer_name(name: str) -> tuple[str, str]:
    """``core.blocks.3.mlp.linear_fc1.weight`` -> (``core.blocks.3.``, ``mlp.linear_fc1.weight``)."""
    parts = name.split(".")
    n = 3 if name.startswith(("core.blocks.", "core.pass_attention.")) else 2
    return ".".join(parts[:n]) + ".", ".".join(parts[n:])


def lol_hf_names(name: str, m: ModelConfig) -> str | None:
    """HF (remote-code LoL) prefix for a native tensor / layer prefix, or None when not exported.
    A per-pass part's tensor ``core.<t>`` (megatron_lol/model/parts.py) is ``model.<t>``: the remote code
    registers it on ``LoLModel`` under the same name."""
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
        "core.depth_vectors": "model.routing.depth_embeddings",
        "core.router_only_embeddings": "model.routing.router_only_embeddings",
        "core.balancer.bias": "model.routing.balancing_bias",
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("core.") and part_of_parameter(name[len("core.") :]) is not None:
        return "model." + name[len("core.") :]  # a per-pass part's tensor: core.<t> is model.<t>
    if name.startswith("core.routers."):
        r, kind, param = name.split(".")[2:5]
        if kind == "noise_scale":
            return None  # training-time noise only
        return f"model.routing.routers.{r}.{param}"
    if name.startswith("core.second_pass_routers."):
        return f"model.second_pass_routers.{name.split('.')[2]}.{name.split('.')[3]}"
    if name.startswith("core.pass_attention."):
        return "model.pass_attention." + name.split(".")[2] + "."
    if name.startswith("prelude."):
        return "model.prelude." + name.split(".")[1] + "."
    if name.startswith("core.blocks."):
        return "model.blocks." + name.split(".")[2] + "."
    if name.startswith("coda."):
        return "model.coda." + name.split(".")[1] + "."
    raise KeyError(name)


def llama_layer_index(prefix: str, m: ModelConfig) -> int:
    """Position of a native layer in the flat Llama stack (prelude, core blocks in order, coda)."""
    parts = prefix.strip(".").split(".")
    if parts[0] == "prelude":
        return int(parts[1])
    if parts[0] == "core":
        return m.n_prelude + int(parts[2])
    return m.n_prelude + m.execution_plan().num_stored_blocks + int(parts[1])
