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


def prefill_window(model, layer, step: dict, s: torch.Tensor, positions: torch.Tensor, window: torch.Tensor,
                   route: Optional[dict]) -> None:
    """Fill the window cache ``layer`` of ``step`` from the full forward: ``s`` [B, n, h] is the
    step's input, ``window`` [B, n] the window id of each token, ``route`` what the routed step
    decided (None for a fixed block with strided attention)."""
    b, n, h = s.shape
    last = window[:, -1]
    length = (window == last.unsqueeze(1)).sum(dim=1)  # tokens of each row's open window
    c = int(length.max())
    xs, pos = s[:, n - c:], positions[:, n - c:]
    if route is None:
        row_block = torch.full((b,), step["block"], dtype=torch.long, device=s.device)
    else:
        row_block = route["choice"].index_select(0, last)
    keys = values = None
    for block in torch.unique(row_block).tolist():
        rows = torch.nonzero(row_block == block).squeeze(1)
        parts = model.step_parts(step, block)
        k, v = model.blocks[block].key_values(xs.index_select(0, rows), pos.index_select(0, rows), parts["film"],
                                              parts["attention"])
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


def decode_tokens(model, cache, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                  inputs_embeds: Optional[torch.Tensor], steps: list) -> torch.Tensor:
    """Final hidden states [B, n, h] of the next ``n`` tokens of every row, one at a time."""
    cfg = model.config
    if len(cache.layers) != cfg.n_prelude + len(steps) + cfg.n_coda:
        raise ValueError(f"this cache has {len(cache.layers)} layers, the model runs "
                         f"{cfg.n_prelude + len(steps) + cfg.n_coda} at this loop budget")
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


def decode_one(model, cache, ids: Optional[torch.Tensor], embeds: Optional[torch.Tensor], mask: torch.Tensor,
               steps: list) -> torch.Tensor:
    """One new token per row (``ids`` [B] or ``embeds`` [B, h]); returns its final hidden state [B, 1, h]."""
    cfg = model.config
    docs = cache.docs
    position = docs.seen
    new_doc = docs.advance(ids, mask, cfg.eod_token_id)
    s = model.embed_tokens(ids).unsqueeze(1) if embeds is None else embeds.unsqueeze(1)
    b = s.shape[0]
    positions = torch.full((b, 1), position, dtype=torch.long, device=s.device)
    keys = torch.arange(docs.seen, device=s.device)
    in_document = (keys.unsqueeze(0) >= docs.doc_start.unsqueeze(1)).unsqueeze(1)  # [B, 1, seen]
    for i, layer in enumerate(model.prelude):
        s = layer(s, positions, in_document, cache=cache, cache_index=i)
    s0 = s
    for i, step in enumerate(steps):
        s = model.inject(s, s0)
        index = cfg.n_prelude + i
        if step["attention"] in ("window", "strided"):
            s = _window_step(model, cache, index, step, s, positions, new_doc)
            continue
        allowed = in_document
        if step["attention"] == "sliding":
            allowed = allowed & (keys >= docs.seen - cfg.window_size).view(1, 1, -1)
        s = model.blocks[step["block"]](s, positions, allowed, **model.step_parts(step, step["block"]), cache=cache,
                                        cache_index=index)
    first_coda = cfg.n_prelude + len(steps)
    for i, layer in enumerate(model.coda):
        s = layer(s, positions, in_document, cache=cache, cache_index=first_coda + i)
    return model.norm(s)


def _window_step(model, cache, index: int, step: dict, s: torch.Tensor, positions: torch.Tensor,
                 new_doc: torch.Tensor) -> torch.Tensor:
    """A windowed step for one token per row: open windows where they start (and route them), then
    run each row's block with attention over its window's cached keys."""
    cfg, layer, docs = model.config, cache.layers[index], cache.docs
    depth = step["depth"]
    delta = ((depth - 1) * cfg.window_shift) % cfg.window_size
    opens = (docs.doc_pos == 0) | ((docs.doc_pos + delta) % cfg.window_size == 0)
    routed = step["block"] is None
    layer.open_windows(opens, docs.doc_pos == 0)
    flat = s[:, 0]
    if routed:
        if bool(opens.any()):
            first = model.first_window_summary(depth, flat)
            prefix = layer.prefix_sum / layer.closed.clamp(min=1).unsqueeze(1).to(torch.float32)
            choice, gate = model.decide(depth, torch.where((layer.closed == 0).unsqueeze(1), first, prefix))
            layer.block = torch.where(opens, choice, layer.block)
            layer.gate = torch.where(opens, gate, layer.gate)
            if cache.routes is not None:
                rows = torch.nonzero(opens).squeeze(1)
                cache.routes.extend(
                    (r, depth, int(docs.doc_count[r]) - 1, int(layer.closed[r]), docs.seen - 1, int(layer.block[r]),
                     float(layer.gate[r])) for r in rows.tolist())
        layer.add_inputs(flat)
        row_block = layer.block
    else:
        row_block = torch.full((s.shape[0],), step["block"], dtype=torch.long, device=s.device)
    blocks = torch.unique(row_block).tolist()
    update = torch.zeros_like(s) if routed else s
    for block in blocks:
        if len(blocks) == 1:
            rows = torch.arange(s.shape[0], device=s.device)
            x, pos = s, positions
        else:
            rows = torch.nonzero(row_block == block).squeeze(1)
            x, pos = s.index_select(0, rows), positions.index_select(0, rows)
        slots = torch.arange(cfg.window_size, device=s.device)
        allowed = (slots.unsqueeze(0) <= layer.length.index_select(0, rows).unsqueeze(1)).unsqueeze(1)
        out = model.blocks[block](x, pos, allowed, **model.step_parts(step, block), cache=cache, cache_index=index,
                                  cache_kwargs={"rows": rows})
        if not routed:
            return out
        if len(blocks) == 1:
            update = update + (out - x)
        else:
            update = update.index_copy(0, rows, out - x)
    return s + layer.gate.view(-1, 1, 1).to(s.dtype) * update
