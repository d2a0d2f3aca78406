"""Library-of-Layers (LoL) causal language model in plain PyTorch, for HuggingFace transformers.

Written by ``megatron-lol convert-hf`` next to ``config.json``; load it with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. It is the
inference-time forward of megatron-lol's ``LoLGPTModel`` and nothing else:

* **documents**: a row may pack several documents; the EOD token
  (``config.eod_token_id``) is the last token of its document. Attention never
  crosses a document, and window positions restart at each document. With an
  ``attention_mask`` (padding), every run of padding is its own document too.
* **prelude**: ``n_prelude`` pre-norm layers (RMSNorm, bias-free attention with
  RoPE, SwiGLU MLP), causal attention inside the document.
* **core**: the steps of ``config.execution_plan`` (written by the exporter), in order;
  step ``l`` (its ``depth``):

  - (``input_injection``) ``s <- sigmoid(theta) * s + (1 - sigmoid(theta)) * s0``,
    ``s0`` the output of the prelude;
  - windows: position ``i`` of a document is in window ``floor((i + delta_l) / W)``,
    ``delta_l = ((l - 1) * S) mod W``;
  - a routed step (``block`` None), from the step's input only: ``r_0 = (e_l + s_first) / 2``
    for the first window of a document, ``r_k`` = mean of the window means of windows
    ``0..k-1`` otherwise; ``a = softmax(W r + b)`` in fp32 (no noise: inference);
    the block is ``argmax(a + bias)`` (the balancing bias as saved, used only to
    choose, ties to the lowest index) and the gate ``alpha`` is the unbiased ``a``
    of that block; ``s <- s + alpha * (E(s) - s)`` where ``E`` is the chosen block run
    with attention restricted to the window (causal);
  - a fixed step runs its ``block`` on every token (gate 1; attention ``full``
    (document), ``sliding`` (the last ``W`` tokens of the document) or ``strided``
    (the windows above)); with ``untied_attention`` (Foil) the pass uses its own
    input norm and attention ``pass_attention["{block}_{pass}"]`` (the MLP / experts,
    their router and the MLP norm are the block's own); with ``gated`` (Accordion's
    second pass) the two residual writes are gated per channel:
    ``h1 = h + g[i,0] * (Attn_out - h)``, ``h2 = h1 + g[i,1] * (MLP_out - h1)``
    (``*_out`` include their residual); with ``separate_router`` the MoE router weights
    are ``second_pass_routers[i]`` instead of the block's. Accordion's loop budget
    ``k`` (``config.loop_budget``, or ``loop_budget=`` of ``forward`` / ``generate``)
    runs the first ``depth_for_budget[k]`` steps;
  - FiLM (``film != "off"``): each block norm's output becomes ``gamma * y + beta``,
    one ``(gamma, beta)`` per depth and norm (``depth``) or per depth, block and norm
    (``depth_block``).
* **coda**: ``n_coda`` layers like the prelude, final RMSNorm, LM head.
* **mixture of experts** (``moe_layers``): the MLP of the prelude / coda layers
  (``fixed``) and also of the core blocks (``all``) is megatron-core's top-k MoE
  (:class:`MoEMLP`); routing is per token, so it is independent of windows.

KV cache: the fixed plans (``dense``, ``looped``, ``foil``, ``accordion``) cache keys and values,
one cache layer per layer *execution* (prelude layers, then every core execution --
a block run twice has two entries -- then the coda); ``generate()`` uses it. With a
cache, ``forward`` needs every token id of the rows so far to find the documents:
``generate()`` passes them as ``context_ids`` (a manual loop may too; otherwise the
ids seen by earlier calls with this cache are used). The routed plan (``lol``) has no
cache: ``generate()`` recomputes the whole sequence at every step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 calls the KV cache ``cache``, earlier versions ``past_key_values``
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

from .configuration_lol import LoLConfig


# --------------------------------------------------------------------------- layers
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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: float, dtype):
    """cos/sin ``[B, n, 1, head_dim]`` for integer ``positions`` ``[B, n]`` (non-interleaved RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache=None,
                cache_index: Optional[int] = None) -> torch.Tensor:
        """``x`` [B, n, h]; ``positions`` [B, n]; ``allowed`` [B, n, past + n] (query, key) booleans;
        ``cache``: a transformers KV cache, this call's keys / values go to layer ``cache_index``."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.scaling, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:  # the cache holds [B, kv_heads, length, d]
            k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), cache_index)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_heads != self.heads:  # grouped-query attention
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, n, d]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(out)


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
    """The MoE router's ``weight`` [E, h] (kept in fp32; logits are computed in fp32)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))


class MoEMLP(nn.Module):
    """megatron-core's ``MoELayer`` at inference (local spec, ``TopKRouter``, ``SequentialMLP``).

    ``logits = x W^T`` in fp32; the ``top_k`` largest logits per token (``torch.topk``,
    the same tie order) are soft-maxed among themselves (``moe_router_pre_softmax=False``:
    the weights of the chosen experts sum to 1); each chosen expert ``e`` computes
    ``down(w_e * silu(gate(x)) * up(x))``; the outputs are summed in expert order in x's
    dtype (megatron's unpermute), then the shared expert's output (if any) is added.
    No capacity limit: no token is dropped.
    """

    def __init__(self, config: LoLConfig, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = config.num_experts_per_tok
        self.router = Router(config.hidden_size, num_experts)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(num_experts))
        self.shared_expert = (MLP(config, config.shared_expert_intermediate_size)
                              if config.shared_expert_intermediate_size else None)

    def route(self, x: torch.Tensor, router_weight: Optional[torch.Tensor] = None):
        """``x`` [n, h] -> (weights [n, k] fp32, expert ids [n, k])."""
        weight = self.router.weight if router_weight is None else router_weight
        logits = torch.mm(x.float(), weight.float().t())
        top, index = torch.topk(logits, k=self.top_k, dim=1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), index

    def forward(self, x: torch.Tensor, router_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, index = self.route(flat, router_weight)
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

    def forward(self, x, positions, allowed, film=None, attention: Optional[AttentionSet] = None, gates=None,
                router_weight: Optional[torch.Tensor] = None, cache=None, cache_index: Optional[int] = None):
        """``film``: optional ``(gamma [2, h], beta [2, h])`` applied after the two norms;
        ``attention``: another input norm + attention to use (Foil's later passes);
        ``gates``: ``(g_attn [h], g_mlp [h])`` scaling the two residual writes (Accordion's
        second pass); ``router_weight``: MoE router weights to use instead of the block's."""
        att = self if attention is None else attention
        y = att.input_layernorm(x)
        if film is not None:
            y = film[0][0].to(y.dtype) * y + film[1][0].to(y.dtype)
        h = x + att.self_attn(y, positions, allowed, cache, cache_index)
        if gates is not None:
            h = x + gates[0].to(x.dtype) * (h - x)
        y = self.post_attention_layernorm(h)
        if film is not None:
            y = film[0][1].to(y.dtype) * y + film[1][1].to(y.dtype)
        out = h + (self.mlp(y) if router_weight is None else self.mlp(y, router_weight))
        if gates is not None:
            out = h + gates[1].to(x.dtype) * (out - h)
        return out


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


class Routing(nn.Module):
    """Router state, kept in fp32 whatever the model dtype: ``W_r, b_r`` per router (one when
    tied, else one per depth), the per-depth vectors ``e_l`` and the balancing bias as saved."""

    def __init__(self, config: LoLConfig):
        super().__init__()
        h, L, D = config.hidden_size, config.num_blocks, config.core_depth
        self.routers = nn.ModuleList(nn.Linear(h, L) for _ in range(1 if config.router_tied else D))
        self.depth_embeddings = nn.Parameter(torch.zeros(D, h))
        self.balancing_bias = nn.Parameter(torch.zeros(D if config.per_depth_bias else 1, L), requires_grad=False)


# --------------------------------------------------------------------------- model
class LoLPreTrainedModel(PreTrainedModel):
    config_class = LoLConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]
    _keep_in_fp32_modules = ["routing", "mlp.router", "second_pass_routers"]
    _keep_in_fp32_modules_strict = ["routing", "mlp.router", "second_pass_routers"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, Router):
            module.weight.data.normal_(mean=0.0, std=std)


class LoLModel(LoLPreTrainedModel):
    def __init__(self, config: LoLConfig):
        super().__init__(config)
        h, L, D = config.hidden_size, config.num_blocks, config.core_depth
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        fixed, core = config.fixed_layer_experts, config.block_experts
        self.prelude = nn.ModuleList(Layer(config, fixed) for _ in range(config.n_prelude))
        self.blocks = nn.ModuleList(Layer(config, core) for _ in range(L))
        self.coda = nn.ModuleList(Layer(config, fixed) for _ in range(config.n_coda))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        steps = config.steps
        if any(step["block"] is None for step in steps):
            self.routing = Routing(config)
        if config.film != "off":
            shape = (D, 2, h) if config.film == "depth" else (D, L, 2, h)
            self.film_gamma = nn.Parameter(torch.ones(shape))
            self.film_beta = nn.Parameter(torch.zeros(shape))
        if config.input_injection:
            self.injection_logit = nn.Parameter(torch.zeros(h))
        untied = sorted({(st["block"], st["pass"]) for st in steps if st["untied_attention"]})
        if untied:
            self.pass_attention = nn.ModuleDict({f"{i}_{p}": AttentionSet(config) for i, p in untied})
        if any(step["gated"] for step in steps):
            self.loop_gates = nn.Parameter(torch.ones(L, 2, h))
        if any(step["separate_router"] for step in steps):
            self.second_pass_routers = nn.ModuleList(Router(h, config.block_experts) for _ in range(L))
        self.post_init()

    @property
    def supports_cache(self) -> bool:
        """Fixed plans keep a KV cache; the routed plan recomputes."""
        return all(step["block"] is not None for step in self.config.steps)

    @property
    def has_budgets(self) -> bool:
        return bool((self.config.execution_plan or {}).get("depth_for_budget"))

    def resolve_budget(self, loop_budget: Optional[int]) -> int:
        """Accordion's budget ``k`` for a call: the given one, else ``config.loop_budget``."""
        cfg = self.config
        k = cfg.loop_budget if loop_budget is None else int(loop_budget)
        if k not in cfg.loop_budgets:
            raise ValueError(f"loop_budget={k} is not one of the model's loop_budgets {list(cfg.loop_budgets)}")
        return k

    def schedule(self, loop_budget: Optional[int] = None) -> list:
        """The steps of the core a call runs (``config.execution_plan``; Accordion: its budget's prefix)."""
        steps = self.config.steps
        if self.has_budgets:
            return steps[:self.config.depth_for_budget(self.resolve_budget(loop_budget))]
        return steps

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ------------------------------------------------------------------ core
    def _film(self, depth: int, block: int):
        if self.config.film == "off":
            return None
        if self.config.film == "depth":
            return self.film_gamma[depth - 1], self.film_beta[depth - 1]
        return self.film_gamma[depth - 1, block], self.film_beta[depth - 1, block]

    def _windows(self, depth: int, doc_pos: torch.Tensor):
        """Window id of every token (unique over the batch), and per window: ordinal, document, first token."""
        W, S = self.config.window_size, self.config.window_shift
        delta = ((depth - 1) * S) % W
        new_window = (doc_pos == 0) | ((doc_pos + delta) % W == 0)
        window = segment_ids(new_window)
        flat_first = torch.nonzero(new_window.reshape(-1)).squeeze(1)
        ordinal = torch.div(doc_pos.reshape(-1)[flat_first] + delta, W, rounding_mode="floor")
        return window, ordinal, flat_first

    def _route(self, depth: int, s: torch.Tensor, window, ordinal, flat_first, doc):
        """Choice and gate of every window at this depth (SPEC 1.2, no noise)."""
        h = s.shape[-1]
        flat = s.reshape(-1, h).float()
        num_windows = ordinal.numel()
        win = window.reshape(-1)
        sums = torch.zeros(num_windows, h, dtype=torch.float32, device=s.device).index_add_(0, win, flat)
        counts = torch.bincount(win, minlength=num_windows).to(torch.float32)
        means = sums / counts.unsqueeze(1)
        # prefix means over the windows before each window of the same document
        window_doc = doc.reshape(-1)[flat_first]
        num_docs = int(window_doc.max()) + 1
        grid = torch.zeros(num_docs, int(ordinal.max()) + 1, h, dtype=torch.float32, device=s.device)
        grid[window_doc, ordinal] = means
        before = (grid.cumsum(dim=1) - grid)[window_doc, ordinal]
        k = ordinal.clamp(min=1).unsqueeze(1).to(torch.float32)
        routing = self.routing
        first_window = 0.5 * (routing.depth_embeddings[depth - 1].float().unsqueeze(0) + flat[flat_first])
        summary = torch.where((ordinal == 0).unsqueeze(1), first_window, before / k)
        router = routing.routers[0 if len(routing.routers) == 1 else depth - 1]
        probs = torch.softmax(F.linear(summary, router.weight.float(), router.bias.float()), dim=-1)
        bias = routing.balancing_bias[depth - 1 if self.config.per_depth_bias else 0].float()
        choice = torch.argmax(probs + bias, dim=-1)  # first maximum: ties go to the lowest block
        gate = probs.gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice, gate

    def _run_block_on(self, block: int, depth: int, s, positions, window, selected):
        """Run ``block`` on the tokens ``selected`` [B, n] (window-causal attention); returns ``E(s) - s`` there."""
        b, n, h = s.shape
        count = selected.sum(dim=1)
        width = int(count.max())
        # the selected tokens of each row first, in order (stable sort), padded to ``width``
        order = torch.sort((~selected).to(torch.int8), dim=1, stable=True).indices[:, :width]
        valid = torch.arange(width, device=s.device).unsqueeze(0) < count.unsqueeze(1)
        x = s.gather(1, order.unsqueeze(-1).expand(b, width, h))
        seg = torch.where(valid, window.gather(1, order), torch.full_like(order, -1))
        out = self.blocks[block](x, positions.gather(1, order), causal_same_segment(seg), self._film(depth, block))
        update = torch.zeros_like(s)
        update.scatter_(1, order.unsqueeze(-1).expand(b, width, h), torch.where(valid.unsqueeze(-1), out - x, 0))
        return update

    def _core(self, s, positions, doc, doc_pos, steps):
        """The routed core: every step routes each window to one block."""
        cfg = self.config
        s0 = s
        for step in steps:
            depth = step["depth"]
            if cfg.input_injection:
                mix = torch.sigmoid(self.injection_logit).to(s.dtype)
                s = mix * s + (1 - mix) * s0
            window, ordinal, flat_first = self._windows(depth, doc_pos)
            choice, gate = self._route(depth, s, window, ordinal, flat_first, doc)
            token_choice, token_gate = choice[window], gate[window]
            update = torch.zeros_like(s)
            for block in range(cfg.num_blocks):
                selected = token_choice == block
                if selected.any():
                    update = update + self._run_block_on(block, depth, s, positions, window, selected)
            s = s + token_gate.unsqueeze(-1).to(s.dtype) * update
        return s

    def _fixed_core(self, s, positions, doc, doc_pos, steps, cache, queries):
        """dense / looped / Foil / accordion: each step runs its block on every token."""
        cfg = self.config
        s0 = s
        first = cfg.n_prelude  # cache layer of the first core execution
        for i, step in enumerate(steps):
            depth, block, p = step["depth"], step["block"], step["pass"]
            if cfg.input_injection:
                mix = torch.sigmoid(self.injection_logit).to(s.dtype)
                s = mix * s + (1 - mix) * s0
            if step["attention"] == "strided":
                allowed = causal_same_segment(self._windows(depth, doc_pos)[0])
            elif step["attention"] == "sliding":
                allowed = causal_same_segment(doc, sliding=cfg.window_size)
            else:
                allowed = causal_same_segment(doc)
            attention = self.pass_attention[f"{block}_{p}"] if step["untied_attention"] else None
            gates = (self.loop_gates[block, 0], self.loop_gates[block, 1]) if step["gated"] else None
            router_weight = self.second_pass_routers[block].weight if step["separate_router"] else None
            s = self.blocks[block](s, positions, allowed[:, queries], self._film(depth, block), attention=attention,
                                   gates=gates, router_weight=router_weight, cache=cache, cache_index=first + i)
        return s

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, loop_budget: Optional[int] = None, cache=None,
                context_ids: Optional[torch.LongTensor] = None):
        """Final hidden states [B, n, h] and the cache (None without one).

        ``cache`` (fixed plans): a transformers KV cache holding earlier tokens of these rows;
        ``context_ids`` [B, past + n]: every token id so far (``input_ids`` are the last ``n``);
        ``attention_mask`` may cover the ``n`` new tokens or all ``past + n``.
        """
        cfg = self.config
        b, n = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        if cache is not None and not self.supports_cache:
            raise ValueError("plan lol has no KV cache: call without a cache")
        if loop_budget is not None and not self.has_budgets:
            raise ValueError(f"loop_budget: only plan accordion has a loop budget (this model's plan is {cfg.plan})")
        budget = self.resolve_budget(loop_budget) if self.has_budgets else None
        past = 0
        ids = input_ids
        if cache is not None:
            past = cache.get_seq_length()
            if getattr(cache, "_lol_budget", budget) != budget:
                raise ValueError(f"this cache was filled with loop_budget={cache._lol_budget}, not {budget}")
            cache._lol_budget = budget
            if past:
                if context_ids is None:
                    context_ids = getattr(cache, "_lol_ids", None)
                    context_ids = None if context_ids is None else torch.cat([context_ids, input_ids], dim=1)
                if context_ids is None or context_ids.shape[1] != past + n:
                    raise ValueError("with a filled cache, pass context_ids (all token ids so far) to find documents")
                ids = context_ids
                if attention_mask is not None and attention_mask.shape[1] == n:
                    prev = getattr(cache, "_lol_mask", None)
                    prev = torch.ones_like(ids[:, :past]) if prev is None else prev
                    attention_mask = torch.cat([prev.to(attention_mask.dtype), attention_mask], dim=1)
            cache._lol_ids = ids
            cache._lol_mask = attention_mask
        if ids is None:  # inputs_embeds only: one document per row
            ids = torch.full((b, past + n), -1, dtype=torch.long, device=inputs_embeds.device)
        starts = document_starts(ids, cfg.eod_token_id, attention_mask)
        doc = segment_ids(starts)
        doc_pos = positions_in_segment(starts)
        # RoPE sees only differences inside a document or window: row positions are as good
        positions = torch.arange(past, past + n, device=ids.device).expand(b, n)
        queries = slice(past, past + n)  # the rows of the (query, key) masks for the new tokens
        s = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        allowed = causal_same_segment(doc)[:, queries]
        for i, layer in enumerate(self.prelude):
            s = layer(s, positions, allowed, cache=cache, cache_index=i)
        steps = self.schedule(budget)
        if not self.supports_cache:
            s = self._core(s, positions, doc, doc_pos, steps)
        else:
            s = self._fixed_core(s, positions, doc, doc_pos, steps, cache, queries)
        executions = len(steps)
        first_coda = cfg.n_prelude + executions
        for i, layer in enumerate(self.coda):
            s = layer(s, positions, allowed, cache=cache, cache_index=first_coda + i)
        return self.norm(s), cache


class LoLForCausalLM(LoLPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LoLConfig):
        super().__init__(config)
        self.model = LoLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None, loop_budget: Optional[int] = None, use_cache: Optional[bool] = None,
                cache=None, past_key_values=None, context_ids: Optional[torch.LongTensor] = None,
                **kwargs) -> CausalLMOutputWithPast:
        """``loop_budget``: Accordion's budget ``k`` for this call (default ``config.loop_budget``).
        ``cache`` (or ``past_key_values``) / ``use_cache``: KV cache of the fixed plans."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache and self.model.supports_cache:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache()
        hidden, cache = self.model(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   loop_budget=loop_budget, cache=cache, context_ids=context_ids)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **({_CACHE_FIELD: cache} if cache is not None else {}))

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, past_key_values=None,
                                      use_cache=None, loop_budget=None, **kwargs):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if loop_budget is not None:
            inputs["loop_budget"] = loop_budget
        cache = cache if cache is not None else past_key_values
        if not self.model.supports_cache or use_cache is False or cache is None:
            # no cache: every step recomputes the whole sequence (the routed plan always: routing
            # depends on all earlier windows)
            return inputs
        past = cache.get_seq_length()
        inputs.update(input_ids=input_ids[:, past:], context_ids=input_ids, use_cache=True)
        inputs[_CACHE_FIELD] = cache
        return inputs
