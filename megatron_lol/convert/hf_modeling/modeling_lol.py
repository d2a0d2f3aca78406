"""Library-of-Layers (LoL) causal language model in plain PyTorch, for HuggingFace transformers.

Written by ``megatron-lol convert-hf`` next to ``config.json`` (with ``configuration_lol.py``,
``layers_lol.py``, ``cache_lol.py`` and ``decoding_lol.py``); load it with
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

  - the step's per-pass parts (``parts_lol.py``): those the config turns on for every step
    (FiLM, input injection) and those the step names (``parts``), each applied at its hook:
    before the step (``input``: input injection, ``s <- sigmoid(theta) * s + (1 - sigmoid(theta))
    * s0``, ``s0`` the output of the prelude), on the block's norm outputs (``norm``: FiLM) or
    on its two residual writes (``write``: Accordion's loop gates); a part defined outside
    megatron_lol is shipped with the export (``plugin_parts_lol.py``);
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
    their router and the MLP norm are the block's own); with the ``loop_gates`` part
    (Accordion's second pass) the two residual writes are gated per channel:
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
  (:class:`~.layers_lol.MoEMLP`); routing is per token, so it is independent of windows.

Decoding cache (every plan): :class:`~.cache_lol.LoLCache`, one layer per layer
execution. The routed depths keep only the current window's keys / values and the
router's running sums, so a window's block is chosen when its first token arrives, from
exactly what the full forward would use: cached decoding gives the logits of
recomputing the whole prefix. ``generate()`` makes the cache (``use_cache=False``
recomputes every step); a forward called with ``use_cache=True`` or a ``cache`` fills it
from its tokens (the prefill) and later calls add one token per row at a time
(:mod:`.decoding_lol`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_lol import LoLCache
from .configuration_lol import LoLConfig
from .decoding_lol import decode_tokens, prefill_window
from .layers_lol import (
    AttentionSet,
    Layer,
    RMSNorm,
    Router,
    causal_same_segment,
    document_starts,
    positions_in_segment,
    segment_ids,
)
from .parts_lol import parts_of_step, selected
from .plugin_parts_lol import SHIPPED as _SHIPPED_PARTS  # noqa: F401 (registers the parts this export ships)

# transformers 5 calls the KV cache ``cache``, earlier versions ``past_key_values``
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


class Routing(nn.Module):
    """Router state, kept in fp32 whatever the model dtype: ``W_r, b_r`` per router (one when
    tied, else one per depth), the per-depth vectors ``e_l`` and the balancing bias as saved."""

    def __init__(self, config: LoLConfig):
        super().__init__()
        h, L, D = config.hidden_size, config.num_blocks, config.core_depth
        self.routers = nn.ModuleList(nn.Linear(h, L) for _ in range(1 if config.router_tied else D))
        self.depth_embeddings = nn.Parameter(torch.zeros(D, h))
        self.balancing_bias = nn.Parameter(torch.zeros(D if config.per_depth_bias else 1, L), requires_grad=False)
        if getattr(config, "router_only_tokens", None):
            self.router_only_embeddings = nn.Parameter(torch.zeros(len(config.router_only_tokens), h))


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
        # per step, the per-pass parts it applies; their tensors are parameters of this module by name
        self.step_part_classes = [self._parts_of(step) for step in steps]
        used = list(dict.fromkeys(cls for parts in self.step_part_classes for cls in parts))
        passes = 1 + max((st["pass"] for st in steps), default=0)
        self.part_names = []
        for cls in used:
            for name, (shape, init) in cls.parameters(config, L, D, passes).items():
                self.register_parameter(name, nn.Parameter(torch.full(tuple(shape), float(init))))
                self.part_names.append(name)
        untied = sorted({(st["block"], st["pass"]) for st in steps if st["untied_attention"]})
        if untied:
            self.pass_attention = nn.ModuleDict({f"{i}_{p}": AttentionSet(config) for i, p in untied})
        if any(step["separate_router"] for step in steps):
            self.second_pass_routers = nn.ModuleList(
                Router(h, config.block_experts, getattr(config, "moe_router_expert_bias", False)) for _ in range(L)
            )
        self.post_init()

    @property
    def has_budgets(self) -> bool:
        return self.config.has_budgets

    def resolve_budget(self, loop_budget: Optional[int]) -> Optional[int]:
        """Accordion's budget ``k`` for a call: the given one, else ``config.loop_budget``."""
        return self.config.resolve_budget(loop_budget)

    def schedule(self, loop_budget: Optional[int] = None) -> list:
        """The steps of the core a call runs (``config.execution_plan``; Accordion: its budget's prefix)."""
        budget = self.resolve_budget(loop_budget)
        steps = self.config.steps
        return steps[: self.config.depth_for_budget(budget)] if budget is not None else steps

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ------------------------------------------------------------------ pieces shared with decoding
    def _parts_of(self, step: dict) -> tuple:
        try:
            return parts_of_step(self.config, step.get("parts", ()))
        except KeyError as err:
            raise ValueError(
                f"config.json: step {step['depth']} names a part this export does not ship ({err.args[0]})"
            ) from None

    def hooks(self, step: dict, block, hook=None) -> tuple:
        """``((part, tensors), ...)`` of the parts ``step`` applies to a call of ``block`` (of ``hook`` only)."""
        parts = self.step_part_classes[step["depth"] - 1]
        if not parts:
            return ()
        params = {name: getattr(self, name) for name in self.part_names}
        return selected(parts, params, step["depth"], step["pass"], block, hook)

    def step_parts(self, step: dict, block: int, routed: bool = False) -> dict:
        """Keyword arguments of a block call at ``step`` besides the input and attention (a routed step:
        its parts only; untied attention and separate routers are fixed steps')."""
        hooks = tuple(item for item in self.hooks(step, block) if item[0].hook != "input")
        if routed:
            return {"hooks": hooks}
        p = step["pass"]
        return {
            "hooks": hooks,
            "attention": self.pass_attention[f"{block}_{p}"] if step["untied_attention"] else None,
            "moe_router": self.second_pass_routers[block] if step["separate_router"] else None,
        }

    def inject(self, step: dict, s: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
        """``s`` through the step's parts of the ``input`` hook (input injection)."""
        for cls, tensors in self.hooks(step, step["block"], "input"):
            s = cls.apply(s, s0, *tensors)
        return s

    def first_window_summary(self, depth: int, first: torch.Tensor) -> torch.Tensor:
        """``r_0 = (e_l + s_first) / 2`` (fp32) for first tokens ``first`` [N, h]."""
        return 0.5 * (self.routing.depth_embeddings[depth - 1].float().unsqueeze(0) + first.float())

    # ------------------------------------------------------------------ router-only tokens
    def router_only_index(self, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Each token's index in ``config.router_only_tokens`` (-1: an ordinary token); None without them."""
        tokens = getattr(self.config, "router_only_tokens", None)
        if not tokens:
            return None
        if ids is None:
            raise ValueError("a model with router-only tokens needs input_ids (not inputs_embeds)")
        match = ids.unsqueeze(-1) == torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
        return torch.where(match.any(-1), match.to(torch.int32).argmax(-1).to(torch.long), -1)

    def layer_ids(self, ids: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
        """What the layers embed: the filler in place of every router-only token."""
        return ids if index is None else torch.where(index >= 0, self.config.router_only_filler, ids)

    def router_only_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The router embedding of each router-only token, zero for the others (fp32)."""
        table = self.routing.router_only_embeddings.float()
        return torch.where((index >= 0).unsqueeze(-1), table[index.clamp(min=0)], 0.0)

    def router_only_sums(self, index: torch.Tensor, doc_pos: torch.Tensor) -> tuple:
        """Per token of the row-major stream: the sum and count of the router-only rows of its document
        up to and including it (running sums minus the sum before the document's first token)."""
        flat_index, flat_pos = index.reshape(-1), doc_pos.reshape(-1)
        sums = self.router_only_rows(flat_index).cumsum(dim=0)
        counts = (flat_index >= 0).to(torch.float32).cumsum(dim=0)
        start = torch.arange(flat_index.numel(), device=index.device) - flat_pos
        before, has_before = (start - 1).clamp(min=0), start > 0
        sums = sums - torch.where(has_before.unsqueeze(1), sums[before], 0.0)
        counts = counts - torch.where(has_before, counts[before], 0.0)
        return sums, counts

    def decide(self, depth: int, summary: torch.Tensor):
        """Block and gate of windows with router summaries ``summary`` [N, h] fp32 (no noise)."""
        routing = self.routing
        router = routing.routers[0 if len(routing.routers) == 1 else depth - 1]
        if getattr(self.config, "router_input", "windows") == "depth":  # a route that ignores the input
            summary = routing.depth_embeddings[depth - 1].float().unsqueeze(0).expand_as(summary)
        probs = torch.softmax(F.linear(summary, router.weight.float(), router.bias.float()), dim=-1)
        bias = routing.balancing_bias[depth - 1 if self.config.per_depth_bias else 0].float()
        choice = torch.argmax(probs + bias, dim=-1)  # first maximum: ties go to the lowest block
        gate = probs.gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice, gate

    def check_cache(self, cache, loop_budget: Optional[int]) -> None:
        """A cache must be a LoLCache, made for the call's loop budget (when one is given)."""
        # by name: an export's remote-code copy of cache_lol.py defines its own (equal) class
        if type(cache).__name__ != LoLCache.__name__ or not hasattr(cache, "docs"):
            raise ValueError(
                f"a LoL model decodes with a LoLCache (got {type(cache).__name__}): pass "
                f"use_cache=True, or cache=LoLCache(model.config)"
            )
        if loop_budget is not None and self.resolve_budget(loop_budget) != cache.loop_budget:
            raise ValueError(f"this cache was filled with loop_budget={cache.loop_budget}, not {loop_budget}")

    # ------------------------------------------------------------------ full forward
    def _windows(self, depth: int, doc_pos: torch.Tensor):
        """Window id of every token (unique over the batch), and per window: ordinal, first token."""
        W, S = self.config.window_size, self.config.window_shift
        delta = ((depth - 1) * S) % W
        new_window = (doc_pos == 0) | ((doc_pos + delta) % W == 0)
        window = segment_ids(new_window)
        flat_first = torch.nonzero(new_window.reshape(-1)).squeeze(1)
        ordinal = torch.div(doc_pos.reshape(-1)[flat_first] + delta, W, rounding_mode="floor")
        return window, ordinal, flat_first

    def _route(self, depth: int, s: torch.Tensor, window, ordinal, flat_first, doc, router_only=None) -> dict:
        """Choice and gate of every window at this depth, with the sums the decoding cache keeps."""
        h = s.shape[-1]
        flat = s.reshape(-1, h).float()
        num_windows = ordinal.numel()
        win = window.reshape(-1)
        sums = torch.zeros(num_windows, h, dtype=torch.float32, device=s.device).index_add_(0, win, flat)
        counts = torch.bincount(win, minlength=num_windows).to(torch.float32)
        means = sums / counts.unsqueeze(1)
        # sums of the means of the windows before each window of the same document: the running
        # sum a decoding cache keeps (0 + mu_0, then + mu_1, ...; a shifted cumulative sum)
        window_doc = doc.reshape(-1)[flat_first]
        num_docs = int(window_doc.max()) + 1
        grid = torch.zeros(num_docs, int(ordinal.max()) + 2, h, dtype=torch.float32, device=s.device)
        grid[window_doc, ordinal + 1] = means
        before = grid.cumsum(dim=1)[window_doc, ordinal]
        k = ordinal.clamp(min=1).unsqueeze(1).to(torch.float32)
        summary = torch.where(
            (ordinal == 0).unsqueeze(1), self.first_window_summary(depth, flat[flat_first]), before / k
        )
        if router_only is not None:  # the router-only mean up to each window's first token
            summary = summary + router_only[flat_first]
        choice, gate = self.decide(depth, summary)
        return {
            "choice": choice,
            "gate": gate,
            "sums": sums,
            "counts": counts,
            "before": before,
            "ordinal": ordinal,
            "window_doc": window_doc,
            "flat_first": flat_first,
        }

    def _packed(self, window: torch.Tensor, flat_first: torch.Tensor):
        """Each window's tokens as a row of ``W`` flat token indices (``[num_windows, W]``, the
        window's first token where it is shorter) with their validity: a block runs on windows
        packed this way, so attention costs ``O(W)`` per token, not ``O(n)``."""
        W = self.config.window_size
        counts = torch.bincount(window.reshape(-1), minlength=flat_first.numel())
        slots = torch.arange(W, device=window.device)
        valid = slots.unsqueeze(0) < counts.unsqueeze(1)
        index = torch.where(valid, flat_first.unsqueeze(1) + slots.unsqueeze(0), flat_first.unsqueeze(1))
        return index, valid

    def _run_windows(self, block: int, parts: dict, flat, flat_pos, index, valid):
        """``(inputs, outputs, token index)`` of ``block`` run on packed windows (causal attention inside
        each window; padding slots see the window's tokens and are dropped)."""
        W = index.shape[1]
        causal = torch.ones(W, W, dtype=torch.bool, device=index.device).tril()
        x = flat[index]
        out = self.blocks[block](x, flat_pos[index], causal.unsqueeze(0) & valid.unsqueeze(1), **parts)
        return x[valid], out[valid], index[valid]

    def _routed_step(self, step, s, positions, doc, doc_pos, *, cache, index, routes, router_only=None):
        """A routed step: every window runs the block its router chose."""
        depth = step["depth"]
        b, n, h = s.shape
        window, ordinal, flat_first = self._windows(depth, doc_pos)
        route = self._route(depth, s, window, ordinal, flat_first, doc, router_only)
        if routes is not None:
            rows = torch.div(flat_first, n, rounding_mode="floor")
            document = route["window_doc"] - doc[:, 0].index_select(0, rows)
            routes.extend(
                zip(
                    rows.tolist(),
                    [depth] * rows.numel(),
                    document.tolist(),
                    ordinal.tolist(),
                    (flat_first % n).tolist(),
                    route["choice"].tolist(),
                    route["gate"].tolist(),
                )
            )
        if cache is not None:
            prefill_window(self, cache.layers[index], step, s, positions, window, route)
        packed, valid = self._packed(window, flat_first)
        flat, flat_pos = s.reshape(-1, h), positions.reshape(-1)
        update = torch.zeros_like(flat)
        for block in torch.unique(route["choice"]).tolist():
            chosen = route["choice"] == block
            parts = self.step_parts(step, block, routed=True)
            x, out, tokens = self._run_windows(block, parts, flat, flat_pos, packed[chosen], valid[chosen])
            update[tokens] = out - x
        token_gate = route["gate"][window]
        return s + token_gate.unsqueeze(-1).to(s.dtype) * update.view(b, n, h)

    def _fixed_step(self, step, s, positions, doc, doc_pos, *, cache, index, queries):
        """dense / looped / Foil / accordion: the step's block on every token."""
        block = step["block"]
        parts = self.step_parts(step, block)
        if step["attention"] == "strided":  # the windows of the depth, packed
            b, n, h = s.shape
            window, _, flat_first = self._windows(step["depth"], doc_pos)
            if cache is not None:  # the cache keeps each row's open window
                prefill_window(self, cache.layers[index], step, s, positions, window, None)
            packed, valid = self._packed(window, flat_first)
            _, out, tokens = self._run_windows(block, parts, s.reshape(-1, h), positions.reshape(-1), packed, valid)
            return torch.empty_like(s).view(-1, h).index_copy_(0, tokens, out).view(b, n, h)
        if step["attention"] == "sliding":
            allowed = causal_same_segment(doc, sliding=self.config.window_size)
        else:
            allowed = causal_same_segment(doc)
        return self.blocks[block](s, positions, allowed[:, queries], **parts, cache=cache, cache_index=index)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        loop_budget: Optional[int] = None,
        cache: Optional[LoLCache] = None,
        routes: Optional[list] = None,
    ):
        """Final hidden states [B, n, h] and the cache (None without one).

        ``cache``: a :class:`~.cache_lol.LoLCache`; empty, this call fills it from its tokens
        (prefill); filled, ``input_ids`` are the next tokens of its rows, decoded one at a time.
        ``attention_mask`` may cover the ``n`` new tokens or all ``past + n``. ``routes``: a list
        that receives every routed window's ``(row, depth, document, window, start, block, gate)``
        (full forward only; a cache made with ``record_routes`` records its own).
        """
        cfg = self.config
        if cache is not None:
            self.check_cache(cache, loop_budget)
            budget = cache.loop_budget
            if cache.get_seq_length():
                steps = self.schedule(budget)
                return decode_tokens(self, cache, input_ids, attention_mask, inputs_embeds, steps), cache
        else:
            budget = self.resolve_budget(loop_budget)
        if routes is None and cache is not None:
            routes = cache.routes  # a cache made with record_routes records the prefill's windows too
        b, n = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        ids = input_ids
        if ids is None:  # inputs_embeds only: one document per row
            ids = torch.full((b, n), -1, dtype=torch.long, device=inputs_embeds.device)
        if attention_mask is not None:
            attention_mask = attention_mask[:, -n:]
        starts = document_starts(ids, cfg.eod_token_id, attention_mask)
        doc = segment_ids(starts)
        doc_pos = positions_in_segment(starts)
        # RoPE sees only differences inside a document or window: row positions are as good
        positions = torch.arange(n, device=ids.device).expand(b, n)
        queries = slice(0, n)
        ro_index = self.router_only_index(input_ids)
        router_only = ro_sums = ro_counts = None
        if ro_index is not None:
            ro_sums, ro_counts = self.router_only_sums(ro_index, doc_pos)
            router_only = ro_sums / ro_counts.clamp(min=1).unsqueeze(1)
            input_ids = self.layer_ids(input_ids, ro_index)
        s = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        allowed = causal_same_segment(doc)
        for i, layer in enumerate(self.prelude):
            s = layer(s, positions, allowed, cache=cache, cache_index=i)
        steps = self.schedule(budget)
        s0 = s
        for i, step in enumerate(steps):
            s = self.inject(step, s, s0)
            index = cfg.n_prelude + i
            if step["block"] is None:
                s = self._routed_step(
                    step, s, positions, doc, doc_pos, cache=cache, index=index, routes=routes, router_only=router_only
                )
            else:
                s = self._fixed_step(step, s, positions, doc, doc_pos, cache=cache, index=index, queries=queries)
        first_coda = cfg.n_prelude + len(steps)
        for i, layer in enumerate(self.coda):
            s = layer(s, positions, allowed, cache=cache, cache_index=first_coda + i)
        if cache is not None:
            mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
            cache.docs.fill(starts, ids, mask)
            if ro_sums is not None:
                last = torch.arange(1, b + 1, device=ids.device) * n - 1
                cache.docs.ro_sum, cache.docs.ro_count = ro_sums[last], ro_counts[last]
        return self.norm(s), cache


class LoLForCausalLM(LoLPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # the cache summarises closed windows: it cannot be cropped (no assisted decoding)
    _is_stateful = True

    def __init__(self, config: LoLConfig):
        super().__init__(config)
        self.model = LoLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() gets a LoLCache from prepare_inputs_for_generation

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        *,
        return_dict: Optional[bool] = None,
        loop_budget: Optional[int] = None,
        use_cache: Optional[bool] = None,
        cache: Optional[LoLCache] = None,
        past_key_values=None,
        context_ids: Optional[torch.LongTensor] = None,
        routes: Optional[list] = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``loop_budget``: Accordion's budget ``k`` for this call (default ``config.loop_budget``).
        ``cache`` (or ``past_key_values``): a :class:`~.cache_lol.LoLCache`; ``use_cache=True``
        without one makes one (returned in the output). ``context_ids`` [B, past + n]: every
        token id so far, checked against the cache (optional: the cache follows documents itself).
        ``routes``: see :meth:`LoLModel.forward`. ``logits_to_keep`` > 0: logits of the last that
        many positions only (``generate`` asks for one)."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = LoLCache(self.config, loop_budget)
        if context_ids is not None:
            if cache is not None:
                self.model.check_cache(cache, loop_budget)
            past = cache.get_seq_length() if cache is not None else 0
            n = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            if context_ids.shape[1] != past + n:
                raise ValueError(
                    f"context_ids has {context_ids.shape[1]} tokens per row; the cache holds {past} and {n} are new"
                )
        hidden, cache = self.model(
            input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            loop_budget=loop_budget,
            cache=cache,
            routes=routes,
        )
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep and labels is None else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **({_CACHE_FIELD: cache} if cache is not None else {}))

    def prepare_inputs_for_generation(
        self,
        input_ids,
        *,
        next_sequence_length: Optional[int] = None,
        cache=None,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        use_cache=None,
        loop_budget=None,
        **kwargs,
    ):
        inputs = {"attention_mask": attention_mask}
        inputs.update((k, v) for k, v in kwargs.items() if k != "is_first_iteration")  # logits_to_keep, ...
        if loop_budget is not None:
            inputs["loop_budget"] = loop_budget
        if use_cache is False:  # recompute the whole sequence at every step
            inputs["input_ids"] = input_ids
            return inputs
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = LoLCache(self.config, loop_budget)
        past = cache.get_seq_length()
        if inputs_embeds is not None and past == 0:
            inputs.update(input_ids=None, inputs_embeds=inputs_embeds)
        elif next_sequence_length is not None:
            inputs["input_ids"] = input_ids[:, -next_sequence_length:]
        else:
            inputs["input_ids"] = input_ids[:, past:]
        inputs.update(cache=cache, use_cache=True)
        return inputs
