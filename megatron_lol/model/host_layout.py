"""The document and window layout of a micro-batch, computed on the host where the batch is built.

Everything a routed depth needs to know about *where* its windows are is a
function of the token ids and the plan (docs/model.md, "Documents",
"Windows"), so it is computed here, on the CPU, once per micro-batch, and
shipped to the device with the batch (pinned, ``non_blocking``). The device
then never reads anything back to size a tensor: a GPU step stays queued
ahead of the device (docs/model.md, "The routed core";
``megatron_lol.model.static_routing`` uses this layout).

Shapes are static where that is cheap: a micro-batch ``[b, s]`` of documents
of at least ``W`` tokens has at most ``b * (ceil(s / W) + 1)`` windows at any
depth, the *window capacity*. Every per-window (and per-document: a document
has at least one window) tensor is padded to a multiple of it, the smallest
one that holds the micro-batch, so ordinary batches all get the same shapes
and only a micro-batch of many short documents gets a larger multiple.
Padding windows have length 0, are marked invalid and are never the window
of a token.

The router noise ``eps`` of every (row, depth) is drawn here too, with the
per-row seeds and generator the device-side :func:`~.router.window_noise`
uses, so the values are bit for bit the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Optional

import torch

from megatron_lol.model.router import window_noise
from megatron_lol.model.window_math import window_offset
from megatron_lol.model.windows import DocumentLayout, WindowLayout
from megatron_lol.plan.windows import windows_of


def window_capacity(rows: int, row_length: int, window_size: int) -> int:
    """``b * (ceil(s / W) + 1)``: the windows of one depth when no document is shorter than ``W``."""
    return rows * (-(-row_length // window_size) + 1)


def padded_count(count: int, capacity: int) -> int:
    """The smallest positive multiple of ``capacity`` that holds ``count``."""
    return capacity * max(1, -(-count // capacity))


def _pad(t: torch.Tensor, size: int, value) -> torch.Tensor:
    if t.shape[0] == size:
        return t
    extra = t.new_full((size - t.shape[0],) + tuple(t.shape[1:]), value)
    return torch.cat([t, extra], dim=0)


@dataclass
class DepthWindows:
    """The windows of one window offset (all depths with that offset share them), padded to ``C``.

    Windows are numbered in row-major token order (so are the tokens of a
    window, contiguously); ``0 .. num_windows - 1`` are real, the rest padding.
    """

    token_window: torch.Tensor  # [T] long: window of each token
    token_position: torch.Tensor  # [T] long: position inside its window (THD RoPE restarts per window)
    token_is_first: torch.Tensor  # [T] bool: the first token of its window
    window_ordinal: torch.Tensor  # [C] long: ordinal inside its document (padding: 0)
    window_doc: torch.Tensor  # [C] long: document index (padding: 0)
    window_first_token: torch.Tensor  # [C] long: flat index of the first token (padding: 0)
    window_length: torch.Tensor  # [C] long (padding: 0)
    window_valid: torch.Tensor  # [C] bool
    cu_seqlens: torch.Tensor  # [C + 1] int32: THD offsets of the windows in token order
    doc_window_offsets: torch.Tensor  # [C + 1] long: windows [o[d], o[d+1]) belong to document d
    num_windows: int  # real windows (host integer: never read from the device)
    max_length: int  # bound of a window's length: the padded width of the ordered window sums
    num_docs: int

    @property
    def capacity(self) -> int:
        return self.window_ordinal.shape[0]

    @property
    def ordinal_bound(self) -> int:
        """An upper bound of a window's ordinal + 1 (a document has at most ``C`` windows): a shape, no read."""
        return max(1, self.capacity)


def _depth_windows(windows: WindowLayout, capacity: int) -> DepthWindows:
    """Pad one depth's :class:`WindowLayout` (built on the host) to ``capacity`` windows."""
    n, t = windows.num_windows, windows.token_window.shape[0]
    index = torch.arange(capacity)
    length = _pad(windows.window_length, capacity, 0)
    ordinal = _pad(windows.window_ordinal, capacity, 0)
    cu = torch.zeros(capacity + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(length, 0)
    docs_per = torch.bincount(windows.window_doc, minlength=windows.num_docs)  # host: no device involved
    doc_offsets = torch.full((capacity + 1,), n, dtype=torch.long)
    doc_offsets[0] = 0
    doc_offsets[1 : windows.num_docs + 1] = torch.cumsum(docs_per, 0)
    token_first = windows.window_first_token.index_select(0, windows.token_window)
    is_first = torch.zeros(t, dtype=torch.bool)
    is_first[windows.window_first_token] = True
    return DepthWindows(
        token_window=windows.token_window,
        token_position=torch.arange(t) - token_first,
        token_is_first=is_first,
        window_ordinal=ordinal,
        window_doc=_pad(windows.window_doc, capacity, 0),
        window_first_token=_pad(windows.window_first_token, capacity, 0),
        window_length=length,
        window_valid=index < n,
        cu_seqlens=cu.to(torch.int32),
        doc_window_offsets=doc_offsets,
        num_windows=n,
        max_length=windows._max_length(),
        num_docs=windows.num_docs,
    )


@dataclass
class HostLayout:
    """Documents, the windows of every depth and the router noise of one micro-batch ``[b, s]``.

    Built on the CPU by :func:`build_host_layout`; :meth:`pin_memory` and
    :meth:`to` ship it to the device without a synchronisation. Per-window
    and per-document tensors have ``capacity`` rows (see the module docstring).
    """

    rows: int
    row_length: int
    window_size: int
    window_shift: int
    capacity: int
    positions: torch.Tensor  # [b, s] long: document positions
    doc_index: torch.Tensor  # [b, s] long: document of each token (row-major over the micro-batch)
    num_docs: int
    doc_count: torch.Tensor  # [] float32: num_docs, for averages computed on the device
    doc_cu_seqlens: torch.Tensor  # [capacity + 1] int32: THD offsets of the documents
    windows: dict = field(default_factory=dict)  # window offset -> DepthWindows
    noise: dict = field(default_factory=dict)  # depth -> eps [capacity, L] fp32 (training with seeds only)

    def for_depth(self, depth: int) -> DepthWindows:
        offset = window_offset(depth, self.window_size, self.window_shift)
        if offset not in self.windows:
            raise KeyError(
                f"HostLayout: no windows for depth {depth} (offset {offset}); built for offsets {sorted(self.windows)}"
            )
        return self.windows[offset]

    def document_layout(self) -> DocumentLayout:
        """The :class:`~.windows.DocumentLayout` the model's ``docs=`` argument takes (no device read)."""
        return DocumentLayout(positions=self.positions, doc_index=self.doc_index, num_docs=self.num_docs)

    def _map(self, fn) -> "HostLayout":
        def tensors(obj):
            return replace(
                obj, **{f.name: fn(getattr(obj, f.name)) for f in fields(obj) if torch.is_tensor(getattr(obj, f.name))}
            )

        out = tensors(self)
        out.windows = {k: tensors(v) for k, v in self.windows.items()}
        out.noise = {k: fn(v) for k, v in self.noise.items()}
        return out

    def pin_memory(self) -> "HostLayout":
        """Page-locked copies (only with CUDA: pinning needs the driver), so :meth:`to` is asynchronous."""
        if not torch.cuda.is_available():
            return self
        return self._map(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = True) -> "HostLayout":
        """Every tensor on ``device`` (``non_blocking``: the copies queue behind the device's work)."""
        device = torch.device(device)
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def build_host_layout(tokens: torch.Tensor, eod_id: Optional[int], *layout_args, **layout_kwargs) -> HostLayout:
    """The layout of the micro-batch ``tokens`` ``[b, s]`` (on the CPU): its documents (``eod_id``), then
    :func:`layout_from_documents` with the rest (``window_size, window_shift, depths, num_blocks=None,
    row_seeds=None``), which checks them: one place for the layout's arguments and their checks."""
    if tokens.device.type != "cpu":
        raise ValueError(
            f"build_host_layout: tokens must be on the CPU (where the batch is built), got {tokens.device}"
        )
    if tokens.dim() != 2:
        raise ValueError(f"build_host_layout: tokens must be [b, s], got shape {tuple(tokens.shape)}")
    return layout_from_documents(DocumentLayout.from_tokens(tokens, eod_id), *layout_args, **layout_kwargs)


def layout_from_documents(
    docs: DocumentLayout,
    window_size: int,
    window_shift: int,
    depths: Iterable[int],
    num_blocks: Optional[int] = None,
    row_seeds: Optional[torch.Tensor] = None,
) -> HostLayout:
    """The layout of the micro-batch whose :class:`~.windows.DocumentLayout` (on the CPU) is ``docs``, for
    the routed ``depths`` (:func:`build_host_layout` starts from the token ids; the core builds it from
    ``docs`` for a caller that brought none, see ``Core.forward``).

    ``row_seeds`` ``[b]`` (with ``num_blocks``): also draw the router noise of
    every depth, as :func:`~.router.window_noise` does from those seeds
    (the trainer's seeds: ``sample_id + run_seed * 1,000,000,007``).
    """
    if docs.positions.device.type != "cpu":
        raise ValueError(f"layout_from_documents: documents must be on the CPU, got {docs.positions.device}")
    if row_seeds is not None and num_blocks is None:
        raise ValueError("host layout: row_seeds needs num_blocks (the noise has one column per block)")
    depths = sorted(set(int(d) for d in depths))
    b, s = docs.shape
    per_offset = {}
    for depth in depths:
        offset = window_offset(depth, window_size, window_shift)
        if offset not in per_offset:
            per_offset[offset] = WindowLayout.build(docs, depth, window_size, window_shift)
    most = max([w.num_windows for w in per_offset.values()] + [docs.num_docs])
    capacity = padded_count(most, window_capacity(b, s, window_size))
    windows = {offset: _depth_windows(w, capacity) for offset, w in per_offset.items()}
    noise = {}
    if row_seeds is not None:
        seeds = row_seeds.cpu()
        for depth in depths:
            w = per_offset[window_offset(depth, window_size, window_shift)]
            noise[depth] = _pad(window_noise(w, seeds, depth, num_blocks, s), capacity, 0.0)
    lengths = torch.bincount(docs.doc_index.reshape(-1), minlength=docs.num_docs)  # documents are contiguous
    doc_cu = torch.full((capacity + 1,), b * s, dtype=torch.long)
    doc_cu[0] = 0
    doc_cu[1 : docs.num_docs + 1] = torch.cumsum(lengths, 0)
    return HostLayout(
        rows=b,
        row_length=s,
        window_size=window_size,
        window_shift=window_shift,
        capacity=capacity,
        positions=docs.positions,
        doc_index=docs.doc_index,
        num_docs=docs.num_docs,
        doc_count=torch.tensor(float(docs.num_docs)),
        doc_cu_seqlens=doc_cu.to(torch.int32),
        windows=windows,
        noise=noise,
    )


def routed_depths(plan) -> list:
    """The depths of execution ``plan`` whose steps use windows (routed or strided)."""
    return sorted({step.depth for step in plan.steps() if step.windowed})


def noise_seeds(sample_ids: torch.Tensor, run_seed: int) -> torch.Tensor:
    """One router-noise seed per row: its global sample number offset by the run's seed (the same
    draw on every layout and after a resume, since both are functions of the sample)."""
    return sample_ids + run_seed * 1_000_000_007


def host_layout_for_batch(batch: dict, model_cfg, plan, eod_id: Optional[int], run_seed: int, pin: bool):
    """The layout a micro-batch carries to the device (the trainer, ``evaluate`` and the benches build
    it here): ``batch["tokens"]`` ``[b, s]`` on the CPU and, for the router noise of a training
    forward, ``batch["sample_ids"]``. ``pin``: page-locked, so the copy to a GPU is asynchronous."""
    seeds = None
    if "sample_ids" in batch and plan.routed and model_cfg.plan.routing.router_noise:
        seeds = noise_seeds(batch["sample_ids"], run_seed)
    layout = build_host_layout(
        batch["tokens"],
        eod_id,
        windows_of(model_cfg).size,
        windows_of(model_cfg).shift,
        routed_depths(plan),
        num_blocks=plan.num_stored_blocks,
        row_seeds=seeds,
    )
    return layout.pin_memory() if pin else layout
