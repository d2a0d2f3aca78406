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
    return torch.div(positions + window_offset(depth, window_size, window_shift), window_size, rounding_mode="floor")


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


class DocumentLayout:
    """Where documents start in a micro-batch ``[b, s]`` of packed rows.

    ``positions`` counts from the start of each document; ``doc_index`` numbers
    the documents of the whole micro-batch 0..num_docs-1 in row-major order. A
    row always starts a new document (tokens before the row are not visible).
    ``num_docs`` is read from the device only when asked for (the routed depths'
    windows need it; a dense model's attention does not, and its step reads nothing).
    """

    def __init__(self, positions: torch.Tensor, doc_index: torch.Tensor, num_docs: Optional[int] = None):
        self.positions = positions  # [b, s] long
        self.doc_index = doc_index  # [b, s] long, global over the micro-batch
        self._num_docs = num_docs

    @property
    def num_docs(self) -> int:
        if self._num_docs is None:  # the last token's document is the last one
            self._num_docs = int(self.doc_index[-1, -1]) + 1 if self.doc_index.numel() else 0
        return self._num_docs

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
        return cls(positions=positions, doc_index=doc_index)

    @classmethod
    def single(cls, b: int, s: int, device=None) -> "DocumentLayout":
        return cls.from_starts(torch.zeros(b, s, dtype=torch.bool, device=device))


def segment_means(
    states: torch.Tensor, first_row: torch.Tensor, segment_length: torch.Tensor, max_length: int
) -> torch.Tensor:
    """Mean of the rows of ``states`` [T, h] in each segment, fp32 [N, h] (``N = len(segment_length)``).

    Segments are contiguous runs of rows (segment ``j``: ``first_row[j]`` and the
    ``segment_length[j] - 1`` rows after it), at most ``max_length`` long. Their
    sums are ordered: each segment's rows are gathered into a row of a padded
    ``[N, max_length, h]`` layout (padding slots zero) and summed along it, a
    reduction whose order is fixed by the shape. An ``index_add_`` would be one
    atomic FP32 addition per row on CUDA, in whatever order the threads run, and
    ranks that route the same windows could then disagree in the last bit.
    The padded layout is built for at most about ``T / max_length`` segments at a
    time, so it stays about the size of ``states``.
    """
    n, h = segment_length.shape[0], states.shape[-1]
    total = states.shape[0]
    if n == 0:
        return torch.zeros(0, h, dtype=torch.float32, device=states.device)
    slots = torch.arange(max_length, device=states.device)
    per_chunk = max(1, total // max_length)
    sums = []
    for start in range(0, n, per_chunk):
        first, length = first_row[start : start + per_chunk], segment_length[start : start + per_chunk]
        rows = (first.unsqueeze(1) + slots).clamp_(max=total - 1)  # [c, max_length] row of each slot
        past_end = (slots >= length.unsqueeze(1)).unsqueeze(2)
        gathered = states.index_select(0, rows.reshape(-1)).view(rows.shape[0], max_length, h)
        # masked_fill with a Python zero: one operation each way (``torch.where(valid, x, 0)`` wraps the
        # zero as a 0-dim tensor, a fill launched on a GPU, in the forward and again in the backward)
        sums.append(gathered.masked_fill(past_end, 0).sum(dim=1, dtype=torch.float32))
    total_sums = sums[0] if len(sums) == 1 else torch.cat(sums)
    return total_sums / segment_length.unsqueeze(1).to(torch.float32)


def segmented_inclusive_sum(values: torch.Tensor, ordinal: torch.Tensor, bound: int) -> torch.Tensor:
    """Running sums of ``values`` [N, ...] along dim 0 that restart wherever ``ordinal`` (the row's index
    inside its run) is 0; ``bound``: an upper bound of any ordinal + 1.

    A doubling scan (``ceil(log2(bound))`` shifted additions, each masked at run starts): sums in a
    fixed order, no atomics and no floating-point ``cumsum`` (which CUDA does not compute in a fixed
    order either), and no device-to-host read.
    """
    out = values
    n = values.shape[0]
    shape = (n,) + (1,) * (values.dim() - 1)
    step = 1
    while step < bound:
        shifted = torch.cat([out.new_zeros((min(step, n),) + tuple(out.shape[1:])), out[: max(0, n - step)]])
        out = out + shifted.masked_fill((ordinal < step).view(shape), 0)
        step *= 2
    return out


def document_prefix_means(window_means: torch.Tensor, ordinal: torch.Tensor, bound: int) -> torch.Tensor:
    """``r_k = (1/k) sum_{j<k} mu_j`` over the earlier windows of each document (rows with k = 0: 0). [N, h]

    Windows of a document are consecutive and numbered by their ``ordinal``, so
    the prefix sums are a running sum that restarts at every ordinal 0
    (:func:`segmented_inclusive_sum`; ``bound``: any upper bound of an ordinal
    + 1), shifted by one window: a document's prefixes are sums of its own
    window means only (no subtraction of long running sums), in an order that
    does not depend on the device. Extra doubling steps add exact zeros, so any
    bound gives the same bits. The backward is autograd's, through the same
    shifted additions: ordered as well. Every routed depth uses this one
    function, whatever its layout (measured on the device or built on the host).
    """
    n = window_means.shape[0]
    inclusive = segmented_inclusive_sum(window_means, ordinal, bound)
    before = torch.cat([inclusive.new_zeros((min(1, n),) + tuple(inclusive.shape[1:])), inclusive[: n - 1]])
    exclusive = before.masked_fill((ordinal < 1).unsqueeze(1), 0)
    return exclusive / ordinal.clamp(min=1).unsqueeze(1).to(exclusive.dtype)


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
    window_size: Optional[int] = None  # W: no window is longer
    max_windows_per_doc: Optional[int] = None  # an upper bound of a document's windows (from the row length)

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
        row_length = docs.shape[1]
        return cls(
            depth=depth,
            token_window=token_window,
            window_ordinal=ordinal,
            window_doc=docs.doc_index.reshape(-1)[first],
            window_first_token=first,
            window_length=length,
            num_windows=num_windows,
            num_docs=docs.num_docs,
            window_size=window_size,
            max_windows_per_doc=-(-(row_length + delta) // window_size),
        )

    def _max_length(self) -> int:
        return self.window_size if self.window_size is not None else int(self.window_length.max())
