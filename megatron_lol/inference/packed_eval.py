"""Scoring held-out documents with the training forward: pieces packed into training-length rows.

``evaluate`` cuts every document into the pieces of lm-evaluation-harness's
rolling log-likelihood (:func:`megatron_lol.inference.evaluate.pieces`). Here
the pieces are packed, best fit by decreasing length, into rows of
``row_length`` tokens (the training sequence length), each piece its own
document of the row: a piece starts a document, and the EOD before a document's
first piece is a one-token document, exactly as a row holding that piece alone
would be laid out (:class:`~megatron_lol.model.windows.DocumentLayout`: every
part of the model restarts per document and attention never crosses one, so
the per-document losses do not depend on what shares the row; RoPE sees only
position differences). The rest of a row is padding, a document of its own that
is not scored.

The rows run through megatron-core's forward-only schedule on ``LoLGPTModel``,
the training forward (the CPU backend's fused paths, TP / PP over the process
group, data parallelism over the rest of the world), as many micro-batches of
``micro_batch_size`` rows per schedule call as keep a pipeline busy. The
per-token losses of the scored positions are summed per document (FP64) and
reduced over the data-parallel ranks.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from megatron_lol.plan.windows import windows_of


@dataclass
class Row:
    """One packed row: its pieces' tokens, labels, document starts and what is scored."""

    tokens: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    starts: list = field(default_factory=list)  # True where a document of the row starts
    doc: list = field(default_factory=list)  # document index of a scored position, else -1

    @property
    def length(self) -> int:
        return len(self.tokens)

    def add(self, doc: int, inputs: list, targets: list) -> None:
        """A piece: ``targets`` are the next tokens of the last ``len(targets)`` ``inputs``."""
        n = len(inputs)
        self.tokens.extend(inputs)
        self.labels.extend(inputs[1:] + [targets[-1]])
        self.starts.extend([True] + [False] * (n - 1))
        self.doc.extend([-1] * (n - len(targets)) + [doc] * len(targets))


def pack(pieces: list, row_length: int) -> list:
    """Rows of at most ``row_length`` tokens holding every piece ``(doc, inputs, targets)``: best fit,
    longest pieces first (a piece goes to the fullest row it fits in)."""
    rows: list = []
    free: list = []  # sorted (room left, row index)
    for doc, inputs, targets in sorted(pieces, key=lambda p: -len(p[1])):
        n = len(inputs)
        if n > row_length:
            raise ValueError(f"a piece of {n} tokens does not fit a row of {row_length}")
        i = bisect.bisect_left(free, (n, -1))
        if i == len(free):
            rows.append(Row())
            index, room = len(rows) - 1, row_length
        else:
            room, index = free.pop(i)
        rows[index].add(doc, inputs, targets)
        if room - n > 0:
            bisect.insort(free, (room - n, index))
    return rows


def row_tensors(rows: list, row_length: int, eod: Optional[int], pad: int) -> dict:
    """``tokens``, ``labels``, ``starts``, ``doc`` tensors ``[len(rows), row_length]``; the padding of a row
    is one more document, never scored. ``starts`` also marks the token after every EOD, as
    :meth:`DocumentLayout.from_tokens` does."""
    n = len(rows)
    tokens = torch.full((n, row_length), pad, dtype=torch.long)
    labels = torch.full((n, row_length), pad, dtype=torch.long)
    starts = torch.zeros((n, row_length), dtype=torch.bool)
    doc = torch.full((n, row_length), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        k = row.length
        tokens[i, :k] = torch.tensor(row.tokens, dtype=torch.long)
        labels[i, :k] = torch.tensor(row.labels, dtype=torch.long)
        starts[i, :k] = torch.tensor(row.starts, dtype=torch.bool)
        doc[i, :k] = torch.tensor(row.doc, dtype=torch.long)
        if k < row_length:
            starts[i, k] = True
    if eod is not None:
        starts[:, 1:] |= tokens[:, :-1] == eod
    return {"tokens": tokens, "labels": labels, "starts": starts, "doc": doc}


class PackedScorer:
    """Per-document summed NLL of pieces through a model built for this process's layout."""

    def __init__(
        self,
        model_chunks: list,
        micro_batch_size: int,
        row_length: int,
        eod: Optional[int],
        budget: Optional[int] = None,
    ):
        self.chunks = model_chunks
        self.model = model_chunks[0]
        self.mbs = micro_batch_size
        self.row_length = row_length
        self.eod = eod
        self.budget = budget
        self.pad = 0 if eod != 0 else 1

    def _forward_step(self, device, data_iterator, model):
        from megatron_lol.model.windows import DocumentLayout

        batch = next(data_iterator)
        docs = DocumentLayout.from_starts(batch["starts"])  # on the host, where the batch is built
        tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
        plan = self.model.plan
        if plan.routed:  # the routed depths' windows, built here too: the device reads nothing back
            from megatron_lol.model.host_layout import layout_from_documents, routed_depths

            cfg = self.model.cfg
            layout = layout_from_documents(docs, windows_of(cfg).size, windows_of(cfg).shift, routed_depths(plan))
            output = model(tokens, labels=labels, layout=layout.to(device), budget=self.budget)
        else:
            docs = DocumentLayout(docs.positions.to(device), docs.doc_index.to(device), docs.num_docs)
            output = model(tokens, labels=labels, docs=docs, budget=self.budget)
        return output, self._loss

    @staticmethod
    def _loss(output):
        losses = output.float()
        return losses.sum(), {"losses": losses.detach()}

    @torch.no_grad()
    def score(self, pieces: list, num_docs: int, progress: Optional[Callable] = None) -> tuple:
        """``(nll per document [num_docs] float64, seconds of the forward passes)``; ``progress(tokens)``
        is called after each schedule call with the targets it scored (all ranks together)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_lol.platform import device as device_policy

        device = device_policy()
        rows = pack(pieces, self.row_length)
        data = row_tensors(rows, self.row_length, self.eod, self.pad)
        dp = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        per_call = max(8, 2 * pp)  # micro-batches per schedule call: a full pipeline, progress between calls
        rows_per_rank = math.ceil(len(rows) / dp)
        calls = math.ceil(rows_per_rank / (self.mbs * per_call))
        mine = list(range(dp_rank, len(rows), dp))
        nll = torch.zeros(num_docs, dtype=torch.float64)
        seconds = 0.0
        for chunk in self.chunks:
            chunk.eval()
        fb = get_forward_backward_func()
        seq, mbs = self.model.pipeline_shape(self.row_length, self.mbs)
        last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        counted = parallel_state.get_tensor_model_parallel_rank() == 0 and last_stage
        for call in range(calls):
            take = mine[call * self.mbs * per_call : (call + 1) * self.mbs * per_call]
            # every rank runs the same number of micro-batches: a short rank repeats a row, not counted
            batches, index = [], []
            for m in range(per_call):
                sel = take[m * self.mbs : (m + 1) * self.mbs]
                if not sel and m:
                    break
                sel = sel + [sel[-1] if sel else 0] * (self.mbs - len(sel))
                idx = torch.tensor(sel)
                batches.append({k: data[k].index_select(0, idx) for k in ("tokens", "labels", "starts")})
                index.append((idx, len(take[m * self.mbs : (m + 1) * self.mbs])))
            n_micro = torch.tensor([len(batches)], device=device)
            if dp > 1:  # the same micro-batch count on every rank of the pipeline and data-parallel groups
                torch.distributed.all_reduce(n_micro, op=torch.distributed.ReduceOp.MAX)
            while len(batches) < int(n_micro):
                batches.append(batches[-1])
                index.append((index[-1][0], 0))
            t0 = time.perf_counter()
            outputs = fb(
                forward_step_func=partial(self._forward_step, device),
                data_iterator=iter(batches),
                model=self.chunks,
                num_microbatches=len(batches),
                seq_length=seq,
                micro_batch_size=mbs,
                decoder_seq_length=seq,
                forward_only=True,
            )
            seconds += time.perf_counter() - t0
            scored = 0
            if counted:
                for out, (idx, real) in zip(outputs, index):
                    if not real:
                        continue
                    losses = out["losses"].view(-1, self.row_length)[:real].double().cpu()
                    docs = data["doc"].index_select(0, idx[:real])
                    keep = docs >= 0
                    nll.index_add_(0, docs[keep], losses[keep])
                    scored += int(keep.sum())
            if progress is not None:
                total = torch.tensor([scored], dtype=torch.long, device=device)
                if torch.distributed.get_world_size() > 1:
                    torch.distributed.all_reduce(total)
                progress(int(total))
        if torch.distributed.get_world_size() > 1:
            summed = nll.to(device)
            torch.distributed.all_reduce(summed)
            nll = summed.cpu()
        return nll, seconds


def build_model(
    cfg, vocab_size: int, eod_id: Optional[int], path: str, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> list:
    """``LoLGPTModel`` of ``cfg`` for this process's rank of a TP x PP (x DP) layout, with the weights of
    the ``torch_dist`` checkpoint ``path`` (any layout saved it); the process group must exist."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp

    from megatron_lol.model.lol_model import LoLGPTModel
    from megatron_lol.platform import device
    from megatron_lol.training.checkpointing.safe_load import load_sharded
    from megatron_lol.training.checkpointing.state import KEY_PREFIX, model_sharded_state_dict

    cfg.parallel.tensor_model_parallel_size = tensor_parallel
    cfg.parallel.pipeline_model_parallel_size = pipeline_parallel
    cfg.parallel.virtual_pipeline_model_parallel_size = None
    cfg.parallel.expert_model_parallel_size = 1
    cfg.parallel.sequence_parallel = False
    cfg.parallel.recompute_granularity = cfg.parallel.recompute_method = None
    cfg.parallel.data_parallel_size(torch.distributed.get_world_size())  # one-line error for a bad layout
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    mtp.model_parallel_cuda_manual_seed(cfg.training.seed)
    model = LoLGPTModel(
        cfg.model,
        vocab_size=vocab_size,
        eod_id=eod_id,
        parallel=cfg.parallel,
        max_sequence_length=cfg.training.seq_length,
        init_seed=None,
    )
    model.to(device())
    state = load_sharded({"model": model_sharded_state_dict(model, KEY_PREFIX)}, path)["model"]
    model.load_state_dict({k[len(KEY_PREFIX) :]: v for k, v in state.items() if k.startswith(KEY_PREFIX)}, strict=True)
    return [model.eval()]
