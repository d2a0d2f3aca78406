"""Windows of a routed depth (docs/model.md, "Windows"): pure functions of positions.

At routed depth ``l`` (1-based) position ``i`` of a document belongs to window
``w_l(i) = floor((i + delta_l) / W)`` with ``delta_l = ((l - 1) * S) mod W``.
Windows are clipped at both ends of a document and never wrap around; in a
packed row (several documents separated by EOD) positions, windows and window
ordinals restart at each document.

Everything here is vectorised over a whole micro-batch: the windows of a depth
are described once (:class:`WindowLayout`) and reused by the router, the
dispatcher and the attention mask of that depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lol.model.window_math import causal_pairs, window_offset, windowed_pairs


def window_ordinals(positions: torch.Tensor, depth: int, window_size: int, window_shift: int) -> torch.Tensor:
    """``w_l(i)`` for document positions ``i``."""
    return torch.div(positions + window_offset(depth, window_size, window_shift), window_size,
                     rounding_mode="floor")


def window_groups(n: int, depth: int, window_size: int, window_shift: int) -> list[tuple[int, int]]:
    """Inclusive ``[first, last]`` position ranges of the windows of one document of length n."""
    ords = window_ordinals(torch.arange(n), depth, window_size, window_shift).tolist()
    groups: list[tuple[int, int]] = []
    for i, k in enumerate(ords):
        if i == 0 or k != ords[i - 1]:
            groups.append((i, i))
        else:
            groups[-1] = (groups[-1][0], i)
    return groups


def allowed_pairs(n: int, window_size: Optional[int], offset: int = 0) -> int:
    """Number of (query, key) pairs core attention allows in one document of length n.

    ``window_size=None`` is full causal attention.
    """
    if window_size is None:
        return causal_pairs(n)
    return windowed_pairs(n, window_size, offset)


def earliest_reach(n: int, token: int, depths: int, window_size: int, window_shift: int) -> list[int]:
    """Earliest position reachable from ``token`` through core attention after depths 1..depths.

    The recurrence ``a_l(i) = min_{j <= i, w_l(j) = w_l(i)} a_{l-1}(j)``, ``a_0(i) = i``.
    """
    reach = torch.arange(n)
    out = []
    for depth in range(1, depths + 1):
        ords = window_ordinals(torch.arange(n), depth, window_size, window_shift)
        new = reach.clone()
        for i in range(n):
            same = (ords == ords[i]) & (torch.arange(n) <= i)
            new[i] = reach[same].min()
        reach = new
        out.append(int(reach[token]))
    return out


@dataclass
class DocumentLayout:
    """Where documents start in a micro-batch ``[b, s]`` of packed rows.

    ``positions`` counts from the start of each document; ``doc_index`` numbers
    the documents of the whole micro-batch 0..num_docs-1 in row-major order. A
    row always starts a new document (tokens before the row are not visible).
    """

    positions: torch.Tensor  # [b, s] long
    doc_index: torch.Tensor  # [b, s] long, global over the micro-batch
    num_docs: int

    @property
    def shape(self) -> torch.Size:
        return self.positions.shape

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod_id: Optional[int]) -> "DocumentLayout":
        """The EOD token is the last token of the document it ends (docs/model.md, "Documents")."""
        b, s = tokens.shape
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[:, 0] = True
        if eod_id is not None and s > 1:
            starts[:, 1:] = tokens[:, :-1] == eod_id
        return cls.from_starts(starts)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "DocumentLayout":
        b, s = starts.shape
        starts = starts.clone()
        starts[:, 0] = True
        flat = starts.reshape(-1)
        idx = torch.arange(flat.numel(), device=flat.device)
        start_of = torch.cummax(torch.where(flat, idx, torch.zeros_like(idx)), dim=0).values
        positions = (idx - start_of).view(b, s)
        doc_index = (torch.cumsum(flat.long(), 0) - 1).view(b, s)
        return cls(positions=positions, doc_index=doc_index, num_docs=int(flat.sum()))

    @classmethod
    def single(cls, b: int, s: int, device=None) -> "DocumentLayout":
        return cls.from_starts(torch.zeros(b, s, dtype=torch.bool, device=device))


def segment_means(states: torch.Tensor, token_segment: torch.Tensor, segment_length: torch.Tensor) -> torch.Tensor:
    """Mean of the rows of ``states`` [T, h] in each segment, fp32 [N, h] (``N = len(segment_length)``)."""
    sums = torch.zeros(segment_length.shape[0], states.shape[-1], dtype=torch.float32, device=states.device)
    sums.index_add_(0, token_segment, states.float())
    return sums / segment_length.unsqueeze(1).to(torch.float32)


@dataclass
class WindowLayout:
    """The windows of one routed depth over a flattened micro-batch (``b*s`` tokens).

    Windows are numbered 0..N-1 in row-major token order, so the tokens of a
    window are contiguous and windows of a document are consecutive.
    """

    depth: int
    token_window: torch.Tensor  # [T] window id of each token
    window_ordinal: torch.Tensor  # [N] ordinal of the window inside its document
    window_doc: torch.Tensor  # [N] document index
    window_first_token: torch.Tensor  # [N] flat index of its first token
    window_length: torch.Tensor  # [N]
    num_windows: int
    num_docs: int

    @classmethod
    def build(cls, docs: DocumentLayout, depth: int, window_size: int, window_shift: int) -> "WindowLayout":
        pos = docs.positions.reshape(-1)
        delta = window_offset(depth, window_size, window_shift)
        new_window = (pos == 0) | ((pos + delta) % window_size == 0)
        token_window = torch.cumsum(new_window.long(), 0) - 1
        first = torch.nonzero(new_window, as_tuple=False).squeeze(1)
        num_windows = first.numel()
        ordinal = torch.div(pos[first] + delta, window_size, rounding_mode="floor")
        length = torch.bincount(token_window, minlength=num_windows)
        return cls(depth=depth, token_window=token_window, window_ordinal=ordinal,
                   window_doc=docs.doc_index.reshape(-1)[first], window_first_token=first,
                   window_length=length, num_windows=num_windows, num_docs=docs.num_docs)

    def window_means(self, states: torch.Tensor) -> torch.Tensor:
        """``mu_j``: mean of each window's token states, fp32, equal weight per token. [N, h]"""
        return segment_means(states, self.token_window, self.window_length)

    def prefix_means(self, window_means: torch.Tensor) -> torch.Tensor:
        """``r_k = (1/k) sum_{j<k} mu_j`` per document (rows for k = 0 are zero). [N, h]

        The cumulative sum restarts at each document exactly: windows are laid
        out in a ``[num_docs, max_ordinal + 1, h]`` grid and summed along the
        ordinal axis, so a document's prefixes do not depend on what precedes
        it in the row (no subtraction of long running sums).
        """
        n, h = window_means.shape
        k_max = int(self.window_ordinal.max()) + 1 if n else 1
        grid = torch.zeros(self.num_docs, k_max, h, dtype=window_means.dtype, device=window_means.device)
        grid[self.window_doc, self.window_ordinal] = window_means
        exclusive = torch.cumsum(grid, dim=1) - grid
        prefix = exclusive[self.window_doc, self.window_ordinal]
        k = self.window_ordinal.clamp(min=1).unsqueeze(1).to(prefix.dtype)
        # rows with k = 0 are exactly zero already: the exclusive sum of the first ordinal is
        # x - x = 0, divided by 1 (so no masking is needed, and none is done)
        return prefix / k
