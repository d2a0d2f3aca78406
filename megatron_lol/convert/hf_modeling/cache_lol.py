"""The decoding cache of a Library-of-Layers (LoL) model: one definition for every plan.

A :class:`LoLCache` is a transformers ``Cache`` with one layer per layer *execution*
of the plan at the cache's loop budget: the prelude layers, every core step (a block
run twice has two entries), then the coda. What a layer keeps depends on what its
attention may see:

* document-wide attention (prelude, coda, fixed core steps with ``full`` or
  ``sliding`` attention): transformers' ``DynamicLayer``, the keys / values of every
  token of the row; the model masks out keys of earlier documents;
* windowed attention (a routed depth, or a fixed block with ``strided`` attention):
  a :class:`WindowLayer`, the keys / values of the tokens of the row's *current*
  window only. Attention in the core never crosses a window, so this is ``O(W)`` per
  depth and row whatever the context. At a routed depth it also keeps the router's
  state (docs/model.md, "The routed core"): the block and gate chosen for the current
  window, the running sum and count of the current window's inputs, and the sum of
  the means of the document's earlier windows with their count. The block of window
  ``k`` depends only on the first token of window 0 (with the depth's vector) or on
  the means of windows ``j < k``, all known when window ``k``'s first token arrives:
  the decision is made then, exactly as the full forward makes it. When a window
  closes its mean joins the prefix sum and its keys / values are dropped.

:class:`DocumentState` follows each row's current document: an EOD token (the last
token of its document) or a change of the attention mask (padding) starts a new one,
which restarts windows, router prefixes and the attention span, as in training. Rows
are aligned (every row has seen the same number of tokens, padding included), so the
row position of the next token, which RoPE reads, is the same for every row.

An Accordion cache is made for one loop budget (the number of core steps it holds);
calls with another budget are refused by the model. Plain PyTorch and transformers:
shipped next to ``modeling_lol.py`` in every export.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer


def _select(t: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t.index_select(0, index.to(t.device))


class DocumentState:
    """Per row: the current document's start (row position), the position of the last token
    inside it, the last token id and mask value, and how many documents the row has started."""

    FIELDS = ("doc_start", "doc_pos", "last_id", "last_mask", "doc_count", "ro_sum", "ro_count")

    def __init__(self):
        self.seen = 0  # tokens of every row so far (padding included)
        self.doc_start: Optional[torch.Tensor] = None  # [B] long
        self.doc_pos: Optional[torch.Tensor] = None  # [B] long: position of the newest token in its document
        self.last_id: Optional[torch.Tensor] = None  # [B] long (-1: unknown, from inputs_embeds)
        self.last_mask: Optional[torch.Tensor] = None  # [B] bool
        self.doc_count: Optional[torch.Tensor] = None  # [B] long
        # router-only tokens of the current document so far: sum of their router rows [B, h] fp32, count [B]
        self.ro_sum: Optional[torch.Tensor] = None
        self.ro_count: Optional[torch.Tensor] = None

    def fill(self, starts: torch.Tensor, ids: Optional[torch.Tensor], mask: torch.Tensor) -> None:
        """After a prefill of ``[B, n]`` tokens whose document starts are ``starts``."""
        b, n = starts.shape
        idx = torch.arange(n, device=starts.device).expand(b, n)
        self.doc_start = torch.where(starts, idx, torch.zeros_like(idx)).max(dim=1).values
        self.doc_pos = (n - 1) - self.doc_start
        self.last_id = ids[:, -1].clone() if ids is not None else torch.full((b,), -1, device=starts.device)
        self.last_mask = mask[:, -1].clone()
        self.doc_count = starts.long().sum(dim=1)
        self.seen = n

    def advance(self, ids: Optional[torch.Tensor], mask: torch.Tensor, eod_token_id) -> torch.Tensor:
        """One new token per row (``ids`` [B] or None, ``mask`` [B] bool); returns where it starts a document."""
        new_doc = mask != self.last_mask
        if eod_token_id is not None:
            new_doc |= self.last_id == eod_token_id
        self.doc_start = torch.where(new_doc, torch.full_like(self.doc_start, self.seen), self.doc_start)
        self.doc_pos = torch.where(new_doc, torch.zeros_like(self.doc_pos), self.doc_pos + 1)
        self.doc_count = self.doc_count + new_doc.long()
        self.last_id = ids.clone() if ids is not None else torch.full_like(self.last_id, -1)
        self.last_mask = mask.clone()
        self.seen += 1
        return new_doc

    def select(self, index: torch.Tensor) -> None:
        for name in self.FIELDS:
            setattr(self, name, _select(getattr(self, name), index))


class WindowLayer(CacheLayerMixin):
    """A windowed core step: per row, the keys / values of its current window's tokens
    (``[B, kv_heads, W, d]``, slots ``0 .. length - 1`` in use) and, at a routed depth, the
    router's running state (fp32, whatever the model dtype)."""

    is_sliding = True  # bounded: transformers never offloads it
    ROUTER_FIELDS = ("block", "gate", "window_sum", "window_count", "prefix_sum", "closed")

    def __init__(self, window_size: int, routed: bool):
        super().__init__()
        self.window_size = window_size
        self.routed = routed
        self.groups: Optional[list] = None  # (block, rows or None = all) of the open windows; None: to compute
        self.length: Optional[torch.Tensor] = None  # [B] long
        self.block: Optional[torch.Tensor] = None  # [B] long: the block of the current window
        self.gate: Optional[torch.Tensor] = None  # [B] fp32: its gate (the unbiased probability)
        self.window_sum: Optional[torch.Tensor] = None  # [B, h] fp32: sum of the current window's inputs
        self.window_count: Optional[torch.Tensor] = None  # [B] fp32
        self.prefix_sum: Optional[torch.Tensor] = None  # [B, h] fp32: sum of the means of the closed windows
        self.closed: Optional[torch.Tensor] = None  # [B] long: closed windows of the document (= ordinal)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, kv, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, kv, self.window_size, d)
        self.values = value_states.new_zeros(b, kv, self.window_size, d)
        self.length = torch.zeros(b, dtype=torch.long, device=key_states.device)
        self.slots = torch.arange(self.window_size, device=key_states.device)
        self.all_rows = torch.arange(b, device=key_states.device)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.groups = None
        self.is_initialized = True

    def init_router(self, batch: int, hidden: int, device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.block = torch.zeros(batch, dtype=torch.long, device=device)
        self.gate = torch.zeros(batch, **f32)
        self.window_sum = torch.zeros(batch, hidden, **f32)
        self.window_count = torch.zeros(batch, **f32)
        self.prefix_sum = torch.zeros(batch, hidden, **f32)
        self.closed = torch.zeros(batch, dtype=torch.long, device=device)

    def fill(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor) -> None:
        """After a prefill: ``keys`` / ``values`` [B, kv_heads, c, d], row ``b``'s window in its first ``length[b]``."""
        self.lazy_initialization(keys, values)
        c = keys.shape[2]
        self.keys[:, :, :c] = keys
        self.values[:, :, :c] = values
        self.length = length.clone()

    def open_windows(self, opens: torch.Tensor, new_doc: torch.Tensor) -> None:
        """Rows where a window starts: the previous window closes (its mean joins the prefix sum; a
        new document restarts the prefix) and its keys / values are dropped."""
        self.length = torch.where(opens, torch.zeros_like(self.length), self.length)
        if not self.routed:
            return
        closing = (opens & ~new_doc).unsqueeze(1)
        mean = self.window_sum / self.window_count.clamp(min=1).unsqueeze(1)
        prefix = torch.where(closing, self.prefix_sum + mean, self.prefix_sum)
        self.prefix_sum = torch.where(new_doc.unsqueeze(1), torch.zeros_like(prefix), prefix)
        closed = torch.where(opens & ~new_doc, self.closed + 1, self.closed)
        self.closed = torch.where(new_doc, torch.zeros_like(closed), closed)
        self.window_sum = torch.where(opens.unsqueeze(1), torch.zeros_like(self.window_sum), self.window_sum)
        self.window_count = torch.where(opens, torch.zeros_like(self.window_count), self.window_count)

    def add_inputs(self, states: torch.Tensor) -> None:
        """The new token's input of every row [B, h] joins its window's running sum."""
        self.window_sum = self.window_sum + states.float()
        self.window_count = self.window_count + 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, rows: Optional[torch.Tensor] = None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one token's keys / values [r, kv_heads, 1, d] for ``rows`` (all rows when None);
        returns the current windows' keys / values of those rows [r, kv_heads, W, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] != 1:
            raise ValueError("a window cache layer takes one token per row at a time")
        every = rows is None
        rows = self.all_rows if every else rows
        # a window holds at most W tokens: decoding opens the next one (length 0) before it would overflow
        slot = self.length if every else self.length.index_select(0, rows)
        self.keys[rows, :, slot] = key_states[:, :, 0]
        self.values[rows, :, slot] = value_states[:, :, 0]
        if every:
            self.length = self.length + 1
            return self.keys, self.values
        self.length = self.length.index_add(0, rows, torch.ones_like(slot))
        return self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def next_mask(self, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """``[r, 1, W]``: the slots a new token of ``rows`` (all when None) attends to: the open
        window's tokens and itself (the slot :meth:`update` writes next)."""
        length = self.length if rows is None else self.length.index_select(0, rows)
        return (self.slots.unsqueeze(0) <= length.unsqueeze(1)).unsqueeze(1)

    def get_seq_length(self) -> int:
        return 0 if self.length is None else int(self.length.max())

    def get_max_length(self) -> int:
        return self.window_size

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window_size, 0

    def memory_bytes(self) -> int:
        tensors = [self.keys, self.values, self.length] + [getattr(self, f) for f in self.ROUTER_FIELDS]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def reset(self) -> None:
        self.keys = self.values = self.length = None
        for name in self.ROUTER_FIELDS:
            setattr(self, name, None)
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a LoL window cache cannot be cropped (a closed window's keys are gone)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in ("keys", "values", "length") + self.ROUTER_FIELDS:
            setattr(self, name, _select(getattr(self, name), indices))
        if self.length is not None:
            self.all_rows = torch.arange(self.length.shape[0], device=self.length.device)
        self.groups = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length is not None:
            self.batch_select_indices(torch.arange(self.length.shape[0]).repeat_interleave(repeats))


def cache_steps(config, loop_budget: Optional[int] = None) -> tuple[Optional[int], list]:
    """``(budget, steps)``: the loop budget a cache is made for (Accordion; None otherwise) and
    the core steps it holds."""
    budget = config.resolve_budget(loop_budget)
    steps = config.steps
    return budget, steps[: config.depth_for_budget(budget)] if budget is not None else steps


class LoLCache(Cache):
    """Decoding cache of a LoL model at one loop budget (see the module docstring).

    ``LoLCache(model.config)`` (or ``loop_budget=k`` for Accordion) can be passed to
    ``generate(cache=...)``; ``generate`` makes one itself otherwise. With
    ``record_routes=True`` every routed window's decision is appended to :attr:`routes`
    as ``(row, depth, document, window, start, block, gate)``: the row's document
    number (0 = the first of the row), the window's ordinal in it, the row position of
    its first token, the chosen block and its gate.
    """

    def __init__(self, config, loop_budget: Optional[int] = None, record_routes: bool = False):
        self.loop_budget, steps = cache_steps(config, loop_budget)
        layers = [DynamicLayer() for _ in range(config.n_prelude)]
        for step in steps:
            windowed = step["attention"] in ("window", "strided")
            layers.append(WindowLayer(config.window_size, routed=step["block"] is None) if windowed else DynamicLayer())
        layers += [DynamicLayer() for _ in range(config.n_coda)]
        super().__init__(layers=layers)
        self.docs = DocumentState()
        self.routes: Optional[list] = [] if record_routes else None
        # read once: decoding needs them for every token (config attribute reads are slow)
        self.eod_token_id, self.window_size, self.window_shift = (
            config.eod_token_id,
            config.window_size,
            config.window_shift,
        )
        self.n_prelude = config.n_prelude
        self.parts: dict = {}  # (layer index, block) -> a block call's keyword arguments, filled by decoding

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.docs.seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.docs.seen

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a LoL cache cannot be cropped (closed windows are summarised, not kept)")

    def reset(self) -> None:
        super().reset()
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.keys = layer.values = None
                layer.is_initialized = False
        self.docs = DocumentState()
        if self.routes is not None:
            self.routes = []

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.docs.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.docs.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.docs.doc_start is not None:
            self.docs.select(torch.arange(self.docs.doc_start.shape[0]).repeat_interleave(repeats))

    def memory_bytes(self) -> dict:
        """Bytes held: ``documents`` (document-wide layers, grow with the context) and ``windows``
        (windowed core steps, bounded by the window size)."""
        out = {"documents": 0, "windows": 0}
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                out["windows"] += layer.memory_bytes()
            elif layer.keys is not None:
                out["documents"] += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return out
