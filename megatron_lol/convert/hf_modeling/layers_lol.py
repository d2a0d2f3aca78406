"""Layers of the Library-of-Layers (LoL) remote-code model: norms, RoPE, attention, MLPs, MoE,
the pre-norm layer every prelude / coda layer and library block is, and the document /
window helpers the full forward uses. Plain PyTorch: shipped next to ``modeling_lol.py``
in every export.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_lol import LoLConfig
from .parts_lol import apply_norm, apply_write


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


_INV_FREQ: dict = {}


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: float, dtype):
    """cos/sin ``[B, n, 1, head_dim]`` for integer ``positions`` ``[B, n]`` (non-interleaved RoPE)."""
    key = (head_dim, theta, positions.device)
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:  # computed once: decoding calls this for every layer and token
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
        )
        _INV_FREQ[key] = inv_freq
    freqs = (positions.to(torch.float32) / scaling).unsqueeze(-1) * inv_freq  # [B, n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: LoLConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling_factor
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope=None):
        """``q`` [B, heads, n, d] and ``k``, ``v`` [B, kv_heads, n, d] (the cache layout), RoPE applied
        (``rope``: the ``(cos, sin)`` of ``positions`` when the caller computed them already)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope if rope is not None else self.rope(positions, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def rope(self, positions: torch.Tensor, dtype):
        """cos / sin ``[B, 1, n, head_dim]`` of ``positions`` [B, n]."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.scaling, dtype)
        return cos.transpose(1, 2), sin.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        cache=None,
        cache_index: Optional[int] = None,
        cache_kwargs: Optional[dict] = None,
        rope=None,
    ) -> torch.Tensor:
        """``x`` [B, n, h]; ``positions`` [B, n]; ``allowed`` [B, n, keys] (query, key) booleans;
        ``cache``: a :class:`~.cache_lol.LoLCache`: this call's keys / values go to its layer
        ``cache_index`` (``cache_kwargs`` passed on, e.g. the rows a window layer updates),
        which returns every key / value the queries may see. Softmax attention in fp32 for fp32
        weights (torch's ``scaled_dot_product_attention``, keys / values shared by query groups)."""
        b, n, _ = x.shape
        q, k, v = self.project(x, positions, rope)
        if cache is not None:
            k, v = cache.update(k, v, cache_index, **(cache_kwargs or {}))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LoLConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        h, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scale`` [n] (an expert's routing weight per token) multiplies the activation, as
        megatron-core's expert MLP does (``per_token_scale``, product cast back to x's dtype)."""
        act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if scale is not None:
            act = (act * scale.unsqueeze(-1)).to(x.dtype)
        return self.down_proj(act)


class Router(nn.Module):
    """The MoE router's ``weight`` [E, h] (kept in fp32; logits are computed in fp32) and, with
    ``expert_bias``, megatron-core's balancing bias [E] (trained by its load rule, fixed here)."""

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None


class MoEMLP(nn.Module):
    """megatron-core's ``MoELayer`` at inference (local spec, ``TopKRouter``, ``SequentialMLP``).

    ``logits = x W^T`` in fp32; the ``top_k`` largest logits per token (``torch.topk``,
    the same tie order) are soft-maxed among themselves (``moe_router_pre_softmax=False``:
    the weights of the chosen experts sum to 1). With the sigmoid score
    (megatron-core's ``topk_routing_with_score_function``): ``s = sigmoid(logits)``, the
    top-k of ``s + expert_bias`` (the bias chooses, it does not weigh) and weights ``s``
    of the chosen normalised to sum 1 (``+1e-20``; top-1: ``s`` itself). Each chosen expert ``e`` computes
    ``down(w_e * silu(gate(x)) * up(x))``; the outputs are summed in expert order in x's
    dtype (megatron's unpermute), then the shared expert's output (if any) is added.
    No capacity limit: no token is dropped.
    """

    def __init__(self, config: LoLConfig, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = config.num_experts_per_tok
        self.score_function = getattr(config, "moe_router_score_function", "softmax")
        self.router = Router(config.hidden_size, num_experts, getattr(config, "moe_router_expert_bias", False))
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(num_experts))
        self.shared_expert = (
            MLP(config, config.shared_expert_intermediate_size) if config.shared_expert_intermediate_size else None
        )

    def route(self, x: torch.Tensor, router: Optional[Router] = None):
        """``x`` [n, h] -> (weights [n, k] fp32, expert ids [n, k]); ``router``: another router's
        weights and bias (Accordion's separate second-pass router) instead of this layer's."""
        router = self.router if router is None else router
        logits = torch.mm(x.float(), router.weight.float().t())
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if router.expert_bias is None else scores + router.expert_bias.float()
            _, index = torch.topk(choice, k=self.top_k, dim=1)
            top = torch.gather(scores, 1, index)
            return (top / (top.sum(dim=-1, keepdim=True) + 1e-20) if self.top_k > 1 else top), index
        top, index = torch.topk(logits, k=self.top_k, dim=1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), index

    def forward(self, x: torch.Tensor, router: Optional[Router] = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, index = self.route(flat, router)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(index == e, as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token], probs[token, slot]))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(shape)


class AttentionSet(nn.Module):
    """An input norm and attention: Foil's attention of one (block, pass)."""

    def __init__(self, config: LoLConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)


class Layer(nn.Module):
    """A pre-norm transformer layer; also the type of every library block (``num_experts``: MoE MLP)."""

    def __init__(self, config: LoLConfig, num_experts: Optional[int] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config) if num_experts is None else MoEMLP(config, num_experts)

    def forward(
        self,
        x,
        positions,
        allowed,
        *,
        hooks: tuple = (),
        attention: Optional[AttentionSet] = None,
        moe_router: Optional[Router] = None,
        cache=None,
        cache_index: Optional[int] = None,
        cache_kwargs: Optional[dict] = None,
        rope=None,
    ):
        """``hooks``: the step's per-pass parts ``((part, tensors), ...)`` (parts_lol.py): those of the
        ``norm`` hook on the two norms' outputs (FiLM), those of the ``write`` hook on the two residual
        writes (Accordion's loop gates); ``attention``: another input norm + attention to use (Foil's
        later passes); ``moe_router``: an MoE router (weights and bias) to use instead of the block's;
        ``rope``: RoPE's ``(cos, sin)`` of ``positions``, when computed once for several layers."""
        att = self if attention is None else attention
        norms = tuple(item for item in hooks if item[0].hook == "norm")
        writes = tuple(item for item in hooks if item[0].hook == "write")
        y = apply_norm(att.input_layernorm(x), 0, norms)
        h = apply_write(x, x + att.self_attn(y, positions, allowed, cache, cache_index, cache_kwargs, rope), 0, writes)
        y = apply_norm(self.post_attention_layernorm(h), 1, norms)
        out = h + (self.mlp(y) if moe_router is None else self.mlp(y, moe_router))
        return apply_write(h, out, 1, writes)

    def key_values(self, x, positions, hooks: tuple = (), attention: Optional[AttentionSet] = None):
        """The keys and values [B, kv_heads, n, d] this layer's attention computes for ``x`` [B, n, h]
        (what :meth:`forward` would put in a cache): the prefill of a window cache uses it for the
        tokens of the windows still open."""
        att = self if attention is None else attention
        y = apply_norm(att.input_layernorm(x), 0, tuple(item for item in hooks if item[0].hook == "norm"))
        _, k, v = att.self_attn.project(y, positions)
        return k, v


# ------------------------------------------------------------------ documents, windows
def document_starts(input_ids: torch.Tensor, eod_token_id, attention_mask=None) -> torch.Tensor:
    """``[B, n]`` True where a document starts: column 0, after an EOD token, and where padding begins or ends."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    if eod_token_id is not None:
        starts[:, 1:] |= input_ids[:, :-1] == eod_token_id
    if attention_mask is not None:
        starts[:, 1:] |= attention_mask[:, 1:] != attention_mask[:, :-1]
    return starts


def segment_ids(starts: torch.Tensor) -> torch.Tensor:
    """Number segments over the whole batch in row-major order (unique across rows)."""
    flat = starts.clone()
    flat[:, 0] = True
    return (flat.reshape(-1).long().cumsum(0) - 1).view(starts.shape)


def positions_in_segment(starts: torch.Tensor) -> torch.Tensor:
    """Position of each token counted from the start of its document."""
    b, n = starts.shape
    idx = torch.arange(n, device=starts.device).expand(b, n)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def causal_same_segment(segments: torch.Tensor, sliding: Optional[int] = None) -> torch.Tensor:
    """``allowed[b, i, j]``: ``j <= i`` and same segment (and ``i - j < sliding``)."""
    n = segments.shape[1]
    idx = torch.arange(n, device=segments.device)
    allowed = (idx.view(1, n) <= idx.view(n, 1)).unsqueeze(0)
    if sliding is not None:
        allowed = allowed & (idx.view(n, 1) - idx.view(1, n) < sliding).unsqueeze(0)
    return allowed & (segments.unsqueeze(2) == segments.unsqueeze(1))
