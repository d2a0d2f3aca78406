"""Cached decoding of a Library-of-Layers (LoL) model with a :class:`~.cache_lol.LoLCache`.

Two halves, both exact with respect to the full forward (``modeling_lol.LoLModel``):

* :func:`prefill_window`: after the full forward of a prompt has computed a windowed
  step, keep what decoding needs of it: per row, the open (last) window's keys / values
  under the block that runs it and, at a routed depth, that window's block and gate, the
  running sum and count of its inputs and the sum of the means of the document's
  earlier windows (the router's prefix) with their number;
* :func:`decode_tokens`: then one token per row at a time. At a routed depth, where a
  window opens (a new document, or ``(p + delta_l) mod W == 0`` for document position
  ``p``) the previous window's mean joins the prefix sum, its keys / values are dropped,
  and the router decides the new window's block from ``r_0 = (e_l + s)/2`` (first window)
  or ``prefix / k``: the same summary the full forward computes for that window, since
  it reads only earlier windows. The token's input joins the window's running sum and
  the chosen block runs on it with attention over the window's cached keys. Rows that
  chose different blocks run as one call per block.

Document-wide layers attend over the row's cached keys from its current document's
start (and the last ``W`` of them for ``sliding`` attention).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .layers_lol import MLP, rotate_half
from .parts_lol import apply_norm


def prefill_window(
    model, layer, step: dict, s: torch.Tensor, positions: torch.Tensor, window: torch.Tensor, route: Optional[dict]
) -> None:
    """Fill the window cache ``layer`` of ``step`` from the full forward: ``s`` [B, n, h] is the
    step's input, ``window`` [B, n] the window id of each token, ``route`` what the routed step
    decided (None for a fixed block with strided attention)."""
    b, n, h = s.shape
    last = window[:, -1]
    length = (window == last.unsqueeze(1)).sum(dim=1)  # tokens of each row's open window
    c = int(length.max())
    xs, pos = s[:, n - c :], positions[:, n - c :]
    if route is None:
        row_block = torch.full((b,), step["block"], dtype=torch.long, device=s.device)
    else:
        row_block = route["choice"].index_select(0, last)
    keys = values = None
    for block in torch.unique(row_block).tolist():
        rows = torch.nonzero(row_block == block).squeeze(1)
        parts = model.step_parts(step, block)
        k, v = model.blocks[block].key_values(
            xs.index_select(0, rows), pos.index_select(0, rows), parts["hooks"], parts.get("attention")
        )
        if keys is None:
            keys, values = k.new_zeros((b,) + k.shape[1:]), v.new_zeros((b,) + v.shape[1:])
        keys[rows], values[rows] = k, v
    # row b's window is the last length[b] of these c tokens: move it to slots 0 .. length[b] - 1
    index = (torch.arange(c, device=s.device).unsqueeze(0) + (c - length).unsqueeze(1)).clamp(max=c - 1)
    index = index[:, None, :, None].expand_as(keys)
    layer.fill(keys.gather(2, index), values.gather(2, index), length)
    if route is not None:
        layer.init_router(b, h, s.device)
        layer.block = row_block
        layer.gate = route["gate"].index_select(0, last)
        layer.window_sum = route["sums"].index_select(0, last)
        layer.window_count = route["counts"].index_select(0, last)
        layer.prefix_sum = route["before"].index_select(0, last)
        layer.closed = route["ordinal"].index_select(0, last)


def decode_tokens(
    model,
    cache,
    input_ids: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    steps: list,
) -> torch.Tensor:
    """Final hidden states [B, n, h] of the next ``n`` tokens of every row, one at a time."""
    cfg = model.config
    if len(cache.layers) != cfg.n_prelude + len(steps) + cfg.n_coda:
        raise ValueError(
            f"this cache has {len(cache.layers)} layers, the model runs "
            f"{cfg.n_prelude + len(steps) + cfg.n_coda} at this loop budget"
        )
    ref = input_ids if input_ids is not None else inputs_embeds
    b, n = ref.shape[:2]
    if attention_mask is None:
        mask = torch.ones(b, n, dtype=torch.bool, device=ref.device)
    else:
        mask = attention_mask[:, -n:].bool()
    out = []
    for t in range(n):
        ids = input_ids[:, t] if input_ids is not None else None
        embeds = inputs_embeds[:, t] if inputs_embeds is not None else None
        out.append(decode_one(model, cache, ids, embeds, mask[:, t], steps))
    return out[0] if n == 1 else torch.cat(out, dim=1)


def decode_one(
    model, cache, ids: Optional[torch.Tensor], embeds: Optional[torch.Tensor], mask: torch.Tensor, steps: list
) -> torch.Tensor:
    """One new token per row (``ids`` [B] or ``embeds`` [B, h]); returns its final hidden state [B, 1, h]."""
    docs = cache.docs
    position = docs.seen
    new_doc = docs.advance(ids, mask, cache.eod_token_id)
    ro_index = model.router_only_index(ids)
    if ro_index is not None:  # the running router-only sums of each row's document, this token included
        docs.ro_sum = torch.where(new_doc.unsqueeze(1), 0.0, docs.ro_sum) + model.router_only_rows(ro_index)
        docs.ro_count = torch.where(new_doc, 0.0, docs.ro_count) + (ro_index >= 0).to(torch.float32)
        ids = model.layer_ids(ids, ro_index)
    s = model.embed_tokens(ids).unsqueeze(1) if embeds is None else embeds.unsqueeze(1)
    b = s.shape[0]
    positions = torch.full((b, 1), position, dtype=torch.long, device=s.device)
    # every row's new token has the same row position: RoPE's cos / sin once for all layers and rows
    rope = model.blocks[0].self_attn.rope(positions[:1], s.dtype)
    keys = torch.arange(docs.seen, device=s.device)
    in_document = (keys.unsqueeze(0) >= docs.doc_start.unsqueeze(1)).unsqueeze(1)  # [B, 1, seen]
    for i, layer in enumerate(model.prelude):
        s = layer(s, positions, in_document, cache=cache, cache_index=i, rope=rope)
    s0 = s
    for i, step in enumerate(steps):
        s = model.inject(step, s, s0)
        index = cache.n_prelude + i
        if step["attention"] in ("window", "strided"):
            s = _window_step(model, cache, index, step, s, positions, rope)
            continue
        allowed = in_document
        if step["attention"] == "sliding":
            allowed = allowed & (keys >= docs.seen - cache.window_size).view(1, 1, -1)
        s = model.blocks[step["block"]](
            s,
            positions,
            allowed,
            **_parts(model, cache, index, step, step["block"]),
            cache=cache,
            cache_index=index,
            rope=rope,
        )
    first_coda = cache.n_prelude + len(steps)
    for i, layer in enumerate(model.coda):
        s = layer(s, positions, in_document, cache=cache, cache_index=first_coda + i, rope=rope)
    return model.norm(s)


def _parts(model, cache, index: int, step: dict, block: int) -> dict:
    """A block call's keyword arguments at a step, looked up once per cache (FiLM rows, Foil's
    attention, Accordion's gates and router)."""
    parts = cache.parts.get((index, block))
    if parts is None:
        parts = cache.parts[index, block] = model.step_parts(step, block)
    return parts


def _groups(layer, step: dict, b: int) -> list:
    """``(block, first, end)`` spans of the rows sorted by their open window's block (``layer.order``
    sorts them), kept until a window opens."""
    if layer.groups is None:
        if step["block"] is not None:
            layer.groups, layer.order = [(step["block"], 0, b)], None
        else:
            blocks = layer.block.tolist()
            order = sorted(range(b), key=lambda row: blocks[row])  # stable: rows in order within a block
            spans = []
            for i, row in enumerate(order):
                if spans and spans[-1][0] == blocks[row]:
                    spans[-1][2] = i + 1
                else:
                    spans.append([blocks[row], i, i + 1])
            layer.groups = [tuple(span) for span in spans]
            layer.order = None if len(spans) == 1 else torch.tensor(order, device=layer.block.device)
            layer.gate_column = layer.gate.view(b, 1, 1)
    return layer.groups


def _window_step(model, cache, index: int, step: dict, s: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """A windowed step for one token per row: open windows where they start (and route them), then
    run each row's block with attention over its window's cached keys."""
    layer, docs = cache.layers[index], cache.docs
    depth = step["depth"]
    delta = ((depth - 1) * cache.window_shift) % cache.window_size
    opens = ((docs.doc_pos + delta) % cache.window_size == 0) | (docs.doc_pos == 0)
    routed = step["block"] is None
    flat = s[:, 0]
    if bool(opens.any()):
        layer.open_windows(opens, docs.doc_pos == 0)
        if routed:
            first = model.first_window_summary(depth, flat)
            prefix = layer.prefix_sum / layer.closed.clamp(min=1).unsqueeze(1).to(torch.float32)
            summary = torch.where((layer.closed == 0).unsqueeze(1), first, prefix)
            if docs.ro_sum is not None:
                summary = summary + docs.ro_sum / docs.ro_count.clamp(min=1).unsqueeze(1)
            choice, gate = model.decide(depth, summary)
            layer.block = torch.where(opens, choice, layer.block)
            layer.gate = torch.where(opens, gate, layer.gate)
            layer.groups = None
            if cache.routes is not None:
                rows = torch.nonzero(opens).squeeze(1)
                cache.routes.extend(
                    (
                        r,
                        depth,
                        int(docs.doc_count[r]) - 1,
                        int(layer.closed[r]),
                        docs.seen - 1,
                        int(layer.block[r]),
                        float(layer.gate[r]),
                    )
                    for r in rows.tolist()
                )
    if routed:
        layer.add_inputs(flat)
    groups = _groups(layer, step, s.shape[0])
    if len(groups) == 1:
        block = groups[0][0]
        out = model.blocks[block](
            s,
            positions,
            layer.next_mask(None),
            **_parts(model, cache, index, step, block),
            cache=cache,
            cache_index=index,
            rope=rope,
        )
        if not routed:
            return out
        update = out - s
    else:
        update = _rows_of_several_blocks(model, cache, index, step, layer, s, rope)
    # s + alpha * (E(s) - s), alpha the gate of the row's window (the full forward's update)
    return s + layer.gate_column.to(s.dtype) * update


def _block_weights(model, cache, index: int, step: dict, block: int) -> dict:
    """The tensors :func:`_rows_of_several_blocks` applies for one block at one step (looked up once
    per cache: module attribute lookups cost more than the small matrix products)."""
    key = (index, block, "weights")
    weights = cache.parts.get(key)
    if weights is None:
        layer = model.blocks[block]
        att, mlp = layer.self_attn, layer.mlp
        weights = {
            "norms": (layer.input_layernorm.weight, layer.post_attention_layernorm.weight),
            "eps": layer.input_layernorm.eps,
            "norm_parts": tuple(
                item for item in _parts(model, cache, index, step, block)["hooks"] if item[0].hook == "norm"
            ),
            "qkvo": (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight, att.o_proj.weight),
            "mlp": ((mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight) if isinstance(mlp, MLP) else mlp),
        }
        cache.parts[key] = weights
    return weights


def _norm_hooks(parts: dict) -> tuple:
    return tuple(item for item in parts["hooks"] if item[0].hook == "norm")


def _rows_of_several_blocks(model, cache, index: int, step: dict, layer, s: torch.Tensor, rope) -> torch.Tensor:
    """``E(s) - s`` of a routed step whose rows run different blocks: ``Layer.forward``'s operations
    with each block's norm weights and linear maps applied to its rows (rows sorted by block) and
    everything else (RoPE, the window cache, attention, the activation, residuals) once for all
    rows. A layer call per block would repeat all of those, and with small widths a call's fixed
    cost outweighs its arithmetic (docs/performance.md, "Decoding": batch 8 against dense)."""
    order, spans = layer.order, layer.groups
    blocks = [(_block_weights(model, cache, index, step, block), first, end) for block, first, end in spans]
    x = s.index_select(0, order)  # [B, 1, h], rows sorted by block
    h = x.shape[-1]

    def norm(t, which):
        parts = []
        for w, first, end in blocks:
            y = F.rms_norm(t[first:end], (h,), w["norms"][which].to(t.dtype), w["eps"])
            parts.append(apply_norm(y, which, w["norm_parts"]))
        return torch.cat(parts, dim=0)

    def linear(t, group: str, i: int):
        return torch.cat([F.linear(t[first:end], w[group][i]) for w, first, end in blocks], dim=0)

    attn = model.blocks[spans[0][0]].self_attn  # shapes are the same for every block
    b, heads, kv, d = x.shape[0], attn.heads, attn.kv_heads, attn.head_dim
    y = norm(x, 0)
    q = linear(y, "qkvo", 0).view(b, 1, heads, d).transpose(1, 2)
    k = linear(y, "qkvo", 1).view(b, 1, kv, d).transpose(1, 2)
    v = linear(y, "qkvo", 2).view(b, 1, kv, d).transpose(1, 2)
    cos, sin = rope
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    mask = layer.next_mask(order)
    keys, values = cache.update(k, v, index, rows=order)
    a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=kv != heads)
    h_attn = x + linear(a.transpose(1, 2).reshape(b, 1, heads * d), "qkvo", 3)
    y = norm(h_attn, 1)
    if isinstance(blocks[0][0]["mlp"], tuple):
        mlp = linear(F.silu(linear(y, "mlp", 0)) * linear(y, "mlp", 1), "mlp", 2)
    else:  # mixture of experts: tokens are routed to experts inside each block's MLP
        mlp = torch.cat([w["mlp"](y[first:end]) for w, first, end in blocks], dim=0)
    return torch.zeros_like(s).index_copy(0, order, h_attn + mlp - x)
