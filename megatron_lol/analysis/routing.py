"""Routing analyses on an in-memory model (docs/model.md, "Routing records", "Path forcing").

``E[U]``, the expected distinct blocks per path, is in docs/model.md, "Parameter accounting".

Everything here takes a :class:`~megatron_lol.model.lol_model.LoLGPTModel` (eval
mode, one process) and lists of token ids; nothing reads a checkpoint, so the
functions are testable on a freshly built model. The CLI (``megatron-lol
analyze``, :mod:`.cli`) wraps them.

Examples are *packed*: each example is one document (its tokens, truncated to
``seq_length - 1``, then EOD), several per row, the rest of a row filled with
EOD tokens (each a one-token document that is ignored). The model restarts
windows, window ordinals, router prefixes and attention at every document
(docs/model.md, "Documents"), so an example routes exactly as it would alone in a row. Without
an EOD id, every example gets its own row (batch of one).

Definitions used by the analyses (also in docs/model.md, "Routing records"):

* **route of an example**: per routed depth ``d`` the block chosen by each window
  ordinal ``k`` of the example (``choice[d][k]``) and the router's noise-free,
  pre-bias probabilities (``probs[d][k]``);
* **utilisation**: windows per (depth, block), each window counted once whatever
  its length (as the balancer counts them);
* **path vector** of an example: one-hot chosen block per (depth, ordinal)
  concatenated, ``D * K * L`` long (``K`` = ordinals kept; windows an example does
  not reach are all-zero);
* **token path**: the ``D`` blocks that process one token (its window at every
  depth); **distinct blocks per path** counts the distinct blocks on a token path
  and is compared with ``E[U] = L (1 - (1 - 1/L)^D)`` (uniform independent routing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from megatron_lol.analysis.mode_path import mode_path_from_records
from megatron_lol.analysis.paths import expected_distinct_blocks
from megatron_lol.progress import progress


@dataclass
class WindowRecord:
    """The windows of one example at one depth (duck-types ``DepthRecord`` for
    :func:`mode_path_from_records`)."""

    depth: int
    choice: torch.Tensor  # [K] long
    gate: torch.Tensor  # [K]
    probs: torch.Tensor  # [K, L] float32
    window_ordinal: torch.Tensor  # [K] long (0..K-1)


@dataclass
class ExampleRoute:
    length: int  # tokens of the example in the model (EOD included)
    records: list = field(default_factory=list)  # one WindowRecord per routed depth


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [b, s]
    example_of_doc: torch.Tensor  # [num_docs] example index or -1 (padding)
    example_ids: list  # examples in this batch


@torch.no_grad()
def collect_moe_records(
    model,
    token_lists: Sequence[Sequence[int]],
    seq_length: int,
    eod_id: Optional[int],
    rows_per_batch: int = 8,
    **forward_kwargs,
) -> list:
    """The core's MoE routing records (one list per packed batch) from eval-mode forwards."""
    model.eval()
    examples = prepare_examples(token_lists, seq_length, eod_id)
    device = next(model.parameters()).device
    batches = []
    for batch in progress(
        pack_examples(examples, seq_length, eod_id, rows_per_batch), desc="analyze: routing", unit="batch"
    ):
        layout = model.host_layout(batch.tokens).to(device)  # built with the batch, on the host
        _, core = model(batch.tokens.to(device), record_moe=True, return_core=True, layout=layout, **forward_kwargs)
        batches.append(core.moe_records)
    return batches


def _core_cfg(model):
    cfg = model.cfg
    if not model.plan.routed:
        raise ValueError(f"the model's plan is {cfg.plan.kind!r}: nothing is routed (routing analyses need plan: lol)")
    return cfg


def prepare_examples(token_lists: Sequence[Sequence[int]], seq_length: int, eod_id: Optional[int]) -> list:
    """Each example truncated to fit one row, EOD-terminated (when there is an EOD id).

    EOD tokens inside an example are dropped (they would split it into two documents).
    Callers drop empty examples first (an empty one would be a lone EOD)."""
    out = []
    for toks in token_lists:
        toks = [int(t) for t in toks]
        if eod_id is not None:
            if toks and toks[-1] == eod_id:
                toks = toks[:-1]
            toks = [t for t in toks if t != eod_id]
            toks = toks[: seq_length - 1] + [eod_id]
        else:
            toks = toks[:seq_length]
        out.append(toks)
    return out


def pack_examples(
    examples: Sequence[Sequence[int]], seq_length: int, eod_id: Optional[int], rows_per_batch: int = 8
) -> list:
    """Greedy packing of prepared examples into ``[rows, seq_length]`` batches."""
    from megatron_lol.model.windows import DocumentLayout

    if eod_id is None:
        # one example per row, no padding (a row always starts a new document)
        return [PackedBatch(torch.tensor([ex]), torch.tensor([i]), [i]) for i, ex in enumerate(examples)]
    rows, row_examples, cur, cur_ex = [], [], [], []
    for i, ex in enumerate(examples):
        if len(cur) + len(ex) > seq_length:
            rows.append(cur), row_examples.append(cur_ex)
            cur, cur_ex = [], []
        cur = cur + list(ex)
        cur_ex.append(i)
    if cur:
        rows.append(cur), row_examples.append(cur_ex)
    batches = []
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start : start + rows_per_batch]
        chunk_ex = row_examples[start : start + rows_per_batch]
        tokens = torch.full((len(chunk), seq_length), eod_id, dtype=torch.long)
        starts = torch.zeros(len(chunk), seq_length, dtype=torch.bool)  # example starts
        for r, row in enumerate(chunk):
            tokens[r, : len(row)] = torch.tensor(row)
            pos = 0
            for i in chunk_ex[r]:
                starts[r, pos] = True
                pos += len(examples[i])
        docs = DocumentLayout.from_tokens(tokens, eod_id)
        example_of_doc = torch.full((docs.num_docs,), -1, dtype=torch.long)
        flat_ids = [i for ex in chunk_ex for i in ex]
        first_docs = docs.doc_index[starts]  # row-major, same order as flat_ids
        example_of_doc[first_docs] = torch.tensor(flat_ids, dtype=torch.long)
        batches.append(PackedBatch(tokens, example_of_doc, flat_ids))
    return batches


@torch.no_grad()
def collect_routes(
    model,
    token_lists: Sequence[Sequence[int]],
    seq_length: int,
    eod_id: Optional[int],
    rows_per_batch: int = 8,
    forced=None,
) -> list:
    """One :class:`ExampleRoute` per (usable) example, in order, from eval-mode forwards."""
    _core_cfg(model)
    model.eval()
    examples = prepare_examples(token_lists, seq_length, eod_id)
    routes = [ExampleRoute(length=len(ex)) for ex in examples]
    device = next(model.parameters()).device
    for batch in progress(
        pack_examples(examples, seq_length, eod_id, rows_per_batch), desc="analyze: routing", unit="batch"
    ):
        layout = model.host_layout(batch.tokens).to(device)  # built with the batch, on the host
        _, core = model(batch.tokens.to(device), record=True, forced_path=forced, return_core=True, layout=layout)
        for rec in core.records:
            ex_of_window = batch.example_of_doc[rec.window_doc.cpu()]
            for i in batch.example_ids:
                sel = (ex_of_window == i).nonzero(as_tuple=True)[0]
                order = rec.window_ordinal.cpu()[sel].argsort()
                sel = sel[order]
                routes[i].records.append(
                    WindowRecord(
                        depth=rec.depth,
                        choice=rec.choice.cpu()[sel].long(),
                        gate=rec.gate.cpu()[sel].float(),
                        probs=rec.probs.cpu()[sel].float(),
                        window_ordinal=rec.window_ordinal.cpu()[sel].long(),
                    )
                )
    return routes


def utilisation_counts(routes: Sequence[ExampleRoute], depth: int, num_blocks: int) -> torch.Tensor:
    """``[D, L]`` windows per (routed depth, block)."""
    counts = torch.zeros(depth, num_blocks, dtype=torch.long)
    for r in routes:
        for rec in r.records:
            counts[rec.depth - 1] += torch.bincount(rec.choice, minlength=num_blocks)
    return counts


def path_vectors(
    routes: Sequence[ExampleRoute], depth: int, num_blocks: int, max_windows: Optional[int] = None
) -> torch.Tensor:
    """``[N, D * K * L]`` one-hot chosen block per (depth, window ordinal), concatenated."""
    k_max = max(
        (int(rec.window_ordinal.max()) + 1 for r in routes for rec in r.records if rec.window_ordinal.numel()),
        default=1,
    )
    K = k_max if max_windows is None else min(max_windows, k_max)
    out = torch.zeros(len(routes), depth, K, num_blocks)
    for n, r in enumerate(routes):
        for rec in r.records:
            keep = rec.window_ordinal < K
            out[n, rec.depth - 1, rec.window_ordinal[keep], rec.choice[keep]] = 1.0
    return out.reshape(len(routes), -1)


def pca(x: torch.Tensor, k: int = 2) -> tuple:
    """``(coords [N, k], explained_variance_ratio [k])`` by SVD of the centred matrix
    (columns beyond the rank are zero)."""
    x = x.double()
    xc = x - x.mean(0, keepdim=True)
    _, s, vh = torch.linalg.svd(xc, full_matrices=False)
    coords = xc @ vh[:k].T
    var = s**2
    total = var.sum()
    ratio = var[:k] / total if total > 0 else torch.zeros(min(k, var.numel()), dtype=var.dtype)
    if coords.shape[1] < k:
        coords = torch.cat([coords, coords.new_zeros(coords.shape[0], k - coords.shape[1])], 1)
        ratio = torch.cat([ratio, ratio.new_zeros(k - ratio.numel())])
    return coords.float(), ratio.float()


def nearest_centroid_accuracy(x: torch.Tensor, labels: Sequence) -> Optional[float]:
    """Leave-one-out nearest-centroid accuracy of ``labels`` from path vectors (None with
    fewer than two labels): how well a path names its label (chance ~ 1 / #labels)."""
    names = sorted(set(labels), key=str)
    if len(names) < 2:
        return None
    idx = torch.tensor([names.index(lab) for lab in labels])
    x = x.double()
    sums = torch.zeros(len(names), x.shape[1], dtype=x.dtype).index_add_(0, idx, x)
    counts = torch.bincount(idx, minlength=len(names)).to(x.dtype)
    correct = 0
    for n in range(x.shape[0]):
        s, c = sums.clone(), counts.clone()
        s[idx[n]] -= x[n]
        c[idx[n]] -= 1
        valid = c > 0
        cent = s / c.clamp(min=1).unsqueeze(1)
        d = ((cent - x[n]) ** 2).sum(1)
        d[~valid] = float("inf")
        correct += int(d.argmin() == idx[n])
    return correct / x.shape[0]


def token_paths(routes: Sequence[ExampleRoute], depth: int, window_size: int, window_shift: int) -> torch.Tensor:
    """``[T, D]`` block chosen for every token of every example at each routed depth."""
    from megatron_lol.model.windows import window_ordinals

    out = []
    for r in routes:
        if len(r.records) != depth:
            raise ValueError(f"an example recorded {len(r.records)} depths, expected {depth}")
        pos = torch.arange(r.length)
        cols = []
        for rec in r.records:
            ords = window_ordinals(pos, rec.depth, window_size, window_shift)
            grid = torch.full((int(ords.max()) + 1,), -1, dtype=torch.long)
            grid[rec.window_ordinal] = rec.choice
            cols.append(grid[ords])
        out.append(torch.stack(cols, 1))
    return torch.cat(out) if out else torch.zeros(0, depth, dtype=torch.long)


def distinct_per_path(paths: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Distinct blocks on each path (``[P, D]`` -> ``[P]``)."""
    if paths.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    onehot = torch.zeros(paths.shape[0], num_blocks).scatter_(1, paths, 1.0)
    return onehot.sum(1).long()


def distinct_summary(
    routes: Sequence[ExampleRoute], depth: int, num_blocks: int, window_size: int, window_shift: int
) -> dict:
    """Histogram of distinct blocks per token path against ``E[U]``, plus the unique paths."""
    paths = token_paths(routes, depth, window_size, window_shift)
    u = distinct_per_path(paths, num_blocks)
    hist = torch.bincount(u, minlength=min(num_blocks, depth) + 1)[: min(num_blocks, depth) + 1]
    unique, counts = torch.unique(paths, dim=0, return_counts=True) if paths.numel() else (paths, paths)
    top = counts.argsort(descending=True)[:10] if paths.numel() else []
    return {
        "num_blocks": num_blocks,
        "depth": depth,
        "tokens": int(paths.shape[0]),
        "mean_distinct": float(u.float().mean()) if u.numel() else 0.0,
        "expected_distinct_uniform": expected_distinct_blocks(num_blocks, depth),
        "histogram": {str(k): int(v) for k, v in enumerate(hist.tolist())},
        "unique_paths": int(unique.shape[0]),
        "top_paths": [{"path": unique[i].tolist(), "tokens": int(counts[i])} for i in top],
    }


def mode_path(routes: Sequence[ExampleRoute]) -> tuple:
    """The mode path (docs/model.md, "Path forcing") ``(ids [D, K], gates [D, K])`` over the examples' routes."""
    return mode_path_from_records([r.records for r in routes])


def forced_path(ids: torch.Tensor, gates: torch.Tensor):
    from megatron_lol.model.core import ForcedPath

    return ForcedPath(ids=ids.long(), gates=gates.float())


@torch.no_grad()
def lm_loss(
    model,
    token_lists: Sequence[Sequence[int]],
    seq_length: int,
    eod_id: Optional[int],
    rows_per_batch: int = 8,
    forced=None,
    per_example: bool = False,
    **forward_kwargs,
):
    """Mean next-token cross entropy over the examples' tokens (EOD as the last target),
    routed normally or under ``forced``. With ``per_example`` also the list of per-example means.
    ``forward_kwargs`` go to the model (e.g. Accordion's ``budget``)."""
    model.eval()
    examples = prepare_examples(token_lists, seq_length, eod_id)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    ex_loss = [0.0] * len(examples)
    ex_count = [0] * len(examples)
    for batch in progress(
        pack_examples(examples, seq_length, eod_id, rows_per_batch), desc="analyze: loss", unit="batch"
    ):
        from megatron_lol.model.windows import DocumentLayout

        tokens = batch.tokens.to(device)
        layout = model.host_layout(batch.tokens).to(device)  # built with the batch, on the host
        logits = model.gather_logits(model(tokens, forced_path=forced, layout=layout, **forward_kwargs))
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        nll = -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1).cpu()
        docs = DocumentLayout.from_tokens(batch.tokens, eod_id)
        ex = batch.example_of_doc[docs.doc_index]  # [b, s]
        same = (ex[:, :-1] == ex[:, 1:]) & (ex[:, :-1] >= 0)  # target inside the same example
        total += float(nll[same].sum())
        count += int(same.sum())
        if per_example:
            flat_ex, flat_nll = ex[:, :-1][same], nll[same]
            for i in batch.example_ids:
                m = flat_ex == i
                ex_loss[i] += float(flat_nll[m].sum())
                ex_count[i] += int(m.sum())
    mean = total / max(1, count)
    if per_example:
        return mean, [lv / max(1, c) for lv, c in zip(ex_loss, ex_count)]
    return mean


@torch.no_grad()
def greedy_generate(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    eod_id: Optional[int] = None,
    forced=None,
    stop_at_eod: bool = True,
    **forward_kwargs,
) -> list:
    """Greedy continuation of ``prompt`` (full re-forward per token, no KV cache), routed or
    under a forced path (windows beyond the path's ordinals are routed normally)."""
    model.eval()
    device = next(model.parameters()).device
    host_seq = torch.tensor([list(prompt)], dtype=torch.long)  # the batch is built on the host, with its layout
    new = []
    for _ in progress(range(max_new_tokens), desc="analyze: generating", unit="token"):
        seq = host_seq.to(device)
        logits = model(seq, forced_path=forced, layout=model.host_layout(host_seq).to(device), **forward_kwargs)
        logits = model.gather_logits(logits[:, -1:])[0, -1]
        nxt = int(logits.argmax())
        new.append(nxt)
        if stop_at_eod and eod_id is not None and nxt == eod_id:
            break
        host_seq = torch.cat([host_seq, torch.tensor([[nxt]])], 1)
    return new


def group_by_label(labels: Sequence, items: Iterable) -> dict:
    out: dict = {}
    for lab, it in zip(labels, items):
        out.setdefault(lab, []).append(it)
    return out
