"""What the trainer feeds the schedule: datasets, this rank's micro-batches and their host-built layouts.

Global batch ``i`` holds samples ``[i*G, (i+1)*G)``; each data-parallel rank
takes a contiguous slice, cut into micro-batches, so a resumed run sees exactly
the samples it would have. Batches are stacked into page-locked memory on a GPU
machine (the copy to the device is then asynchronous) and, when the routed
depths run grouped, carry the layout built here on the host while the device
runs the previous micro-batch. :class:`TrainerData` is part of
:class:`~.trainer.Trainer`.
"""

from __future__ import annotations

from typing import Iterator

import torch


class TrainerData:
    """The data side of :class:`~.trainer.Trainer` (its attributes: ``cfg``, ``tokenizer``, ``device``,
    ``global_batch_size``, ``dp_size``, ``num_microbatches``, ``model_chunks``, ``plan``)."""

    def _build_data(self) -> None:
        tr, d = self.cfg.training, self.cfg.data
        if self._given_datasets is not None:
            self.train_ds, self.valid_ds, self.test_ds = self._given_datasets
            return
        from megatron_lol.data.datasets import build_train_valid_test_datasets

        evals = (tr.train_iters // tr.eval_interval + 1) * tr.eval_iters * self.global_batch_size
        num_samples = (tr.train_iters * self.global_batch_size, evals, tr.eval_iters * self.global_batch_size)
        self.train_ds, self.valid_ds, self.test_ds = build_train_valid_test_datasets(
            d.paths,
            d.split,
            tr.seq_length,
            tr.seed,
            d.cache_dir,
            num_samples,
            self.tokenizer,
            vocab_size=self.vocab_size,
        )  # every token id checked against the embedding once, here

    # ----------------------------------------------------------------- data
    def _batches(self, dataset, start_sample: int) -> Iterator[dict]:
        """Micro-batches of this data-parallel rank, from global sample ``start_sample`` on.

        Global batch ``i`` holds samples ``[i*G, (i+1)*G)``; each DP rank takes a
        contiguous slice, cut into micro-batches. Deterministic in
        ``start_sample``, so a resumed run sees exactly the samples it would have.
        """
        from megatron.core import parallel_state

        mbs = self.cfg.training.micro_batch_size
        dp_rank = parallel_state.get_data_parallel_rank()
        per_rank = self.global_batch_size // self.dp_size
        sample = start_sample
        n = len(dataset)
        pin = self.device.type == "cuda"  # page-locked, so the forward's non_blocking copy does not wait
        while True:
            base = sample + dp_rank * per_rank
            for m in range(self.num_microbatches):
                idx = [(base + m * mbs + j) % n for j in range(mbs)]
                items = [dataset[i] for i in idx]
                batch = {
                    k: stack_batch([torch.as_tensor(it[k]) for it in items], pin)
                    for k in ("tokens", "labels", "loss_mask")
                }
                # global sample numbers: router noise is drawn per sample from them
                batch["sample_ids"] = stack_batch(
                    [torch.tensor(base + m * mbs + j, dtype=torch.long) for j in range(mbs)], pin
                )
                if self.plan.routed:  # every routed depth reads its windows and noise from it
                    batch["layout"] = self._host_layout(batch, pin)
                yield batch
            sample += self.global_batch_size

    def _host_layout(self, batch: dict, pin: bool):
        """The micro-batch's documents, windows of every depth and router noise, built here on the host
        while the device runs the previous micro-batch: the routed depths read no layout value back."""
        from megatron_lol.model.host_layout import host_layout_for_batch

        return host_layout_for_batch(batch, self.cfg.model, self.plan, self.eod_id, self.cfg.training.seed, pin)

    def _noise_seeds(self, sample_ids: torch.Tensor) -> torch.Tensor:
        from megatron_lol.model.host_layout import noise_seeds

        return noise_seeds(sample_ids, self.cfg.training.seed)

    def data_iterator(self, dataset, start_sample: int):
        """What the schedule consumes: one iterator, or one per virtual pipeline chunk
        (the interleaved schedule pulls each chunk's micro-batches separately)."""
        if len(self.model_chunks) == 1:
            return self._batches(dataset, start_sample)
        return [self._batches(dataset, start_sample) for _ in self.model_chunks]


def stack_batch(rows: list, pin: bool) -> torch.Tensor:
    """``torch.stack(rows)``; with ``pin`` into page-locked host memory, so that the copy to the GPU
    (``platform.to_device``, ``non_blocking=True``) is asynchronous: from pageable memory CUDA first
    copies to a staging buffer, synchronously."""
    if not pin:
        return torch.stack(rows)
    out = torch.empty((len(rows),) + tuple(rows[0].shape), dtype=rows[0].dtype, pin_memory=True)
    return torch.stack(rows, out=out)
