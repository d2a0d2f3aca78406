"""The trainer's console: the step line, ``metrics.jsonl`` and the metric sinks, with the step's model
FLOPs, MFU against the device's peak and the data-parallel stragglers. :class:`TrainerLogging` is part
of :class:`~.trainer.Trainer`; every rank calls :meth:`TrainerLogging._log` at the same steps (the
straggler gather is a collective).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # the trainer's own record of a step (trainer.py imports this module)
    from megatron_lol.training.trainer import StepResult


class TrainerLogging:
    """The logging side of :class:`~.trainer.Trainer`."""

    def _console(self):
        """The console line, ``metrics.jsonl`` and the metric sinks (:mod:`.console`), made on first use."""
        if getattr(self, "console", None) is None:
            from megatron_lol.training.console import TrainingConsole

            self.console = TrainingConsole(
                self.cfg,
                self.metrics_path,
                self.global_batch_size,
                torch.distributed.get_world_size(),
                torch.distributed.get_rank() == 0,
            )
        return self.console

    def _log_eval_only(self, eval_loss: float) -> None:
        """The evaluation of the untrained model (``training.eval_at_start``): step 0."""
        self._console().log_eval(eval_loss, self.depth_at(0), self.last_eval_by_budget)

    def _step_flops(self, res: StepResult) -> float:
        """Model FLOPs of one step (FLOP model of :mod:`megatron_lol.perf.flops`), all ranks together;
        Accordion's micro-batches ran the depths of their sampled budgets."""
        from megatron_lol.perf.flops import training_flops_per_step

        if res.budgets:
            return training_flops_per_step(
                self.cfg,
                None,
                self.global_batch_size,
                self.cfg.training.seq_length,
                vocab_size=self.vocab_size,
                budgets=res.budgets,
            )
        return training_flops_per_step(
            self.cfg, res.depth, self.global_batch_size, self.cfg.training.seq_length, vocab_size=self.vocab_size
        )

    def _device_peak_tflops(self) -> Optional[float]:
        if not torch.cuda.is_available():
            return None  # MFU is not defined against a CPU here
        from megatron_lol.perf.peaks import peak_tflops

        m = self.cfg.model
        precision = "fp8" if m.precision.fp8 else "bf16" if m.precision.params_dtype == "bf16" else "tf32"
        return peak_tflops(torch.cuda.get_device_name(), precision)

    def _log(
        self,
        res: StepResult,
        tokens_per_s: float,
        eval_loss: Optional[float],
        tflops_per_device: float = 0.0,
        compute_ms: Optional[float] = None,
    ) -> None:
        """The console line (every rank calls this at the same steps: the straggler gather is collective)."""
        from megatron_lol.training.console import bias_spread

        peak = self._device_peak_tflops()
        self._console().log_step(
            res,
            tokens_per_s=tokens_per_s,
            tflops_per_device=tflops_per_device,
            mfu=tflops_per_device / peak if peak else None,
            eval_loss=eval_loss,
            eval_by_budget=self.last_eval_by_budget if eval_loss is not None else None,
            consumed_samples=self.consumed_train_samples,
            bias_spread=bias_spread(self._balancers()),
            stragglers=self._stragglers(compute_ms),
        )

    def _stragglers(self, compute_ms: Optional[float]) -> Optional[dict]:
        """The fastest and slowest data-parallel rank of the log interval, by ``compute_ms`` (each rank's mean
        :attr:`StepResult.compute_seconds`, in ms): one ``all_gather`` of one float per rank over the
        data-parallel group, as Megatron-LM's straggler detector reports them. None with one DP rank."""
        from megatron.core import parallel_state

        if self.dp_size < 2:
            return None
        group = parallel_state.get_data_parallel_group()
        mine = torch.tensor(
            [float("nan") if compute_ms is None else compute_ms], dtype=torch.float64, device=self.device
        )
        out = [torch.empty_like(mine) for _ in range(self.dp_size)]
        torch.distributed.all_gather(out, mine, group=group)
        times = [float(t) for t in out]
        ranks = torch.distributed.get_process_group_ranks(group)
        if any(math.isnan(t) for t in times):
            return None
        lo, hi = min(range(len(times)), key=times.__getitem__), max(range(len(times)), key=times.__getitem__)
        return {"min_ms": times[lo], "min_rank": ranks[lo], "max_ms": times[hi], "max_rank": ranks[hi]}
