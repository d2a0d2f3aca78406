"""The training loop, on megatron-core's schedules, optimizer and process groups.

One step:

1. the core depth for this step (growing curriculum, the same on every rank);
2. ``get_forward_backward_func()`` over the micro-batches (1F1B / interleaved
   with pipeline parallelism, plain gradient accumulation otherwise); the loss
   is the token-mean LM loss, the balancing loss rides along in the graph;
3. the megatron optimizer step (AdamW, or Muon + AdamW: :mod:`.optimizer`;
   gradient clipping, DDP/distributed optimizer reductions) and the LR schedule;
4. the loss-free balancing-bias update, with loads summed over the ranks that
   saw different windows;
5. evaluation at ``eval_interval``; then the callbacks (:mod:`.hooks`):
   logging, checkpoints, preemption signals and time limits. A callback that
   asks the loop to stop returns a :class:`~megatron_lol.training.hooks.Stop`
   carrying the process's exit status; :meth:`Trainer.train` returns it.

What a forward observed (balancing loss, block loads, MoE routing records) is
returned by the model (``return_core=True``) and collected per step in a
:class:`StepStats`; nothing is read back from the model's attributes.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch

from megatron_lol.config.schema import ConfigError, ExperimentConfig
from megatron_lol.log import log_rank0
from megatron_lol.perf.budget import apply_flop_budget
from megatron_lol.plan import depth_at
from megatron_lol.training.heartbeat import start_heartbeat
from megatron_lol.training.hooks import NO_FAULTS, FaultHooks, default_hooks
from megatron_lol.training.preflight import config_tokenizer
from megatron_lol.training.step_stats import StepStats, loss_on_device, step_scalars
from megatron_lol.training.trainer_data import TrainerData, stack_batch  # noqa: F401 - stack_batch re-exported
from megatron_lol.training.trainer_logging import TrainerLogging
from megatron_lol.training.vocab import resolve_vocab_size


@dataclass
class TrainOutcome:
    """What :meth:`Trainer.train` ran: the steps' results and the process's exit status."""

    results: list
    exit_code: int = 0
    reason: Optional[str] = None


@dataclass
class StepResult:
    step: int  # 1-based iteration just completed
    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    depth: int
    tokens: int
    seconds: float
    skipped: bool
    utilisation: list = field(default_factory=list)  # [depth][block] share of windows
    eval_loss: Optional[float] = None  # set on evaluation steps
    budgets: list = field(default_factory=list)  # accordion: the budget of each micro-batch
    moe_routing: Optional[dict] = None  # looped/accordion MoE cores: U_t, B2, MMR (log steps only)
    # seconds from the step's start to its data-parallel gradient reduction: this rank's own work, before it
    # waits for the others (a whole step takes as long on every rank: the slowest one's time)
    compute_seconds: Optional[float] = None


class Trainer(TrainerData, TrainerLogging):
    def __init__(
        self,
        cfg: ExperimentConfig,
        tokenizer=None,
        datasets: Optional[tuple] = None,
        *,
        faults: FaultHooks = NO_FAULTS,
    ):
        """``tokenizer`` / ``datasets`` (train, valid, test) override what the
        config would build (tests, notebooks, benchmarks); ``faults`` are a test's
        injected faults (:class:`~megatron_lol.training.hooks.FaultHooks`, none by default)."""
        self.cfg = cfg
        self.faults = faults
        self._given_tokenizer = tokenizer
        self._given_datasets = datasets
        self.plan = cfg.model.execution_plan()
        self.iteration = 0  # optimizer steps completed
        self.consumed_train_samples = 0
        self.nonfinite_skipped = 0
        self.last_eval_by_budget: dict = {}
        # iterations the growing depth and the bias stop are measured against: train_iters, or a resumed
        # checkpoint's with --use-checkpoint-opt_param-scheduler (checkpointing/schedule.py)
        self.schedule_iters = cfg.training.train_iters
        self._routing_check = None
        self._step_started: Optional[float] = None  # perf_counter at the start of the running train_step
        self._compute_seconds: Optional[float] = None  # its time to the gradient reduction (StepResult)

    # ---------------------------------------------------------------- setup
    def setup(self) -> "Trainer":
        from megatron.core import parallel_state, tensor_parallel

        from megatron_lol.platform import device, init_distributed, setup_platform

        cfg = self.cfg
        self.device_kind = setup_platform()
        timeout = datetime.timedelta(minutes=cfg.training.distributed_timeout_minutes)
        init_distributed(timeout=timeout)
        self.device = device()  # the policy: cuda:LOCAL_RANK (NCCL) or cpu (gloo)
        from megatron_lol.model.precision import enable_tf32

        self.tf32 = enable_tf32(self.device, cfg.model.precision.params_dtype)  # FP32 on CUDA: TF32 matmuls
        world = torch.distributed.get_world_size()
        par = cfg.parallel
        self.dp_size = par.data_parallel_size(world)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=par.tensor_model_parallel_size,
            pipeline_model_parallel_size=par.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=par.expert_model_parallel_size,
            distributed_timeout_minutes=cfg.training.distributed_timeout_minutes,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
        torch.manual_seed(cfg.training.seed)
        # from here on a rank that stops answering ends every rank, named (heartbeat.py)
        self.stop_heartbeat()
        self.heartbeat = start_heartbeat(cfg.training.heartbeat_interval, cfg.training.stall_timeout_seconds)

        tr = cfg.training
        self.global_batch_size = tr.global_batch_size or tr.micro_batch_size * self.dp_size
        if self.global_batch_size % (tr.micro_batch_size * self.dp_size):
            raise ConfigError(
                f"training.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"micro_batch_size x data_parallel_size = {tr.micro_batch_size * self.dp_size}"
            )
        self.num_microbatches = self.global_batch_size // (tr.micro_batch_size * self.dp_size)

        self._build_tokenizer()
        self.vocab_size = resolve_vocab_size(
            cfg, self.tokenizer.vocab_size
        )  # the same at every TP; a checkpoint's wins
        self._apply_flop_budget()
        self._build_model()
        self._build_optimizer()
        self._build_data()
        self.metrics_path = tr.metrics_file or (os.path.join(tr.save, "metrics.jsonl") if tr.save else None)
        return self

    def _build_tokenizer(self) -> None:
        d = self.cfg.data
        if self._given_tokenizer is not None:
            self.tokenizer, self.eod_id = self._given_tokenizer, self._given_tokenizer.eod
            return
        self.tokenizer = config_tokenizer(d)  # as train --dry-run builds it
        self.eod_id = self.tokenizer.eod

    def _apply_flop_budget(self) -> None:
        """``training.train_flops``: the iterations it buys at this vocabulary (perf/budget.py), set as
        ``train_iters`` before the schedules, datasets and checkpoint checks read it."""
        line = apply_flop_budget(self.cfg, self.vocab_size)
        if line is not None:
            log_rank0(line)
        self.schedule_iters = self.cfg.training.train_iters

    def _build_model(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from megatron_lol.model.lol_model import LoLGPTModel
        from megatron_lol.training.optimizer import ddp_uses_distributed_optimizer

        cfg = self.cfg
        vocab = self.vocab_size
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size
        chunks = []
        for vp_stage in range(vpp or 1):
            # BF16: each layer call adds its weight gradients to DDP's FP32 main_grad (library.transformer_config)
            model = LoLGPTModel(
                cfg.model,
                vocab_size=vocab,
                eod_id=self.eod_id,
                parallel=cfg.parallel,
                max_sequence_length=cfg.training.seq_length,
                init_seed=cfg.training.seed,
                vp_stage=vp_stage if vpp else None,
                gradient_accumulation_fusion=True,
            )
            # built on the CPU (the same master weights for every layout), moved before DDP allocates
            # its gradient buffers on the device, as Megatron-LM's get_model does; a no-op on CPU
            model.to(self.device)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                use_distributed_optimizer=ddp_uses_distributed_optimizer(cfg),
            )
            chunks.append(
                DistributedDataParallel(
                    config=model.config, ddp_config=ddp_config, module=model, disable_bucketing=vp_stage > 0
                )
            )
        self.model_chunks = chunks
        self.ddp = chunks[0]
        self.model = chunks[0].module  # the first (virtual) stage's model
        self.grouped_core = self._grouped_core()
        # the schedules call this after the last backward: library sum over the pipeline
        # stages that share it, then megatron's DP / SP-norm / tied-embedding reductions
        from megatron_lol.parallel.library_sync import LibrarySync

        self.library_sync = LibrarySync(chunks, cfg.model)
        for chunk in chunks:
            chunk.module.config.finalize_model_grads_func = self._finalize_model_grads
        self.grad_readiness = None
        if cfg.parallel.overlap_grad_reduce:
            # the core's buckets are declared ready when backward leaves the core (routing-independent)
            from megatron_lol.parallel.grad_ready import CoreGradReadiness

            self.grad_readiness = CoreGradReadiness(chunks)
            for chunk in chunks:  # gradients of earlier micro-batches are not reduced (Megatron-LM's no_sync_func)
                chunk.module.config.no_sync_func = (
                    chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
                )

    def _grouped_core(self) -> bool:
        """Whether the routed depths' blocks run grouped (the executor each core chose when it was built,
        ``parallel.routed_core``; docs/gpu.md, "The routed depth on a GPU"): ``grouped`` where the model
        supports it (else a one-line error), ``auto`` on CUDA where it does, never with ``reference``."""
        mode = self.cfg.parallel.routed_core
        if not self.plan.routed:
            if mode == "grouped":
                raise ConfigError(
                    f"parallel.routed_core: grouped runs routed depths, and plan {self.plan.name!r} "
                    f"has none (use auto or reference)"
                )
            return False
        cores = [chunk.module.core for chunk in self.model_chunks if chunk.module.core is not None]
        refusals = [core.grouped_refusal for core in cores if not core.executor.grouped]
        if mode == "grouped" and refusals:
            raise ConfigError(
                f"parallel.routed_core: grouped cannot run this model: {refusals[0]} (use auto or reference)"
            )
        if refusals or not cores:
            return False
        log_rank0(" routed core: grouped (one grouped computation per depth on the host-built window layouts)")
        if getattr(self.model_chunks[0].module, "grouped_library", False):
            fp8 = "; FP8 covers the prelude and coda only" if self.cfg.model.precision.fp8 else ""
            log_rank0(
                " routed core: prelude and coda in Transformer Engine layers, the library's blocks stacked "
                f"for torch._grouped_mm in {self.cfg.model.precision.params_dtype}{fp8}"
            )
        return True

    def _finalize_model_grads(self, *args, **kwargs):
        """The schedules call this after the last backward: the library summed over the pipeline stages that
        share it, megatron's DP / SP-norm / tied-embedding reductions, then the routing parameters averaged
        over the tensor-parallel group (every TP rank routes the same windows with its own copy)."""
        from megatron_lol.parallel.routing_agreement import average_routing_grads

        if self._step_started is not None and self._compute_seconds is None:
            self._compute_seconds = time.perf_counter() - self._step_started
        out = self.library_sync.finalize_model_grads(*args, **kwargs)
        average_routing_grads(self.model_chunks)
        return out

    def _build_optimizer(self) -> None:
        from megatron_lol.training.optimizer import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(self.cfg, self.model_chunks)
        self.scheduler = build_scheduler(self.cfg, self.optimizer)

    # ---------------------------------------------------------------- steps
    def depth_at(self, step: int) -> int:
        """Core depth at 0-based ``step`` (the growing curriculum; the same on every rank)."""
        cur = self.cfg.curriculum
        return depth_at(step, self.plan.depth, cur.initial_depth, cur.growth_fraction, self.schedule_iters)

    def _forward_step(
        self, depth: int, stats: StepStats, budgets: Optional[list], record_moe: bool, data_iterator, model
    ):
        """One micro-batch forward (megatron's ``forward_step_func``); ``budgets``: each micro-batch's
        Accordion budget in schedule order, consumed one per call."""
        from megatron_lol.platform import to_device

        batch = to_device(next(data_iterator), self.device)
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"].float()
        ro_labels = self.model.router_only_index(labels)
        if ro_labels is not None:  # router-only tokens are given, not predicted (docs/model.md)
            loss_mask = loss_mask * (ro_labels < 0)
        cur = self.cfg.curriculum
        seeds = self._noise_seeds(batch["sample_ids"]) if "sample_ids" in batch else None
        layout = batch["layout"].to(self.device) if "layout" in batch else None
        budget = budgets.pop(0) if budgets else None
        if budget is not None and model.training:
            stats.budgets.append(budget)
        check = self._routing_check if model.training else None
        output, core = model(
            tokens,
            labels=labels,
            depth=depth,
            budget=budget,
            backprop_depth=cur.backprop_depth,
            first_window_full_backprop=cur.first_window_full_backprop,
            noise_seeds=seeds,
            aux_loss_scale=1.0 / self.num_microbatches,
            record_moe=record_moe,
            return_core=True,
            routing_check=check,
            layout=layout,
        )
        if model.training:
            stats.add(core)
        return output, partial(self._loss_func, loss_mask)

    @staticmethod
    def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        losses = output.float().view(-1)
        mask = loss_mask.view(-1)
        total = torch.sum(losses * mask)
        count = mask.sum().to(torch.int)
        report = torch.stack([total.detach().clone(), mask.sum().detach()])
        return total, count, {"lm loss": report}

    def _run_schedule(
        self,
        data_iterator,
        depth: int,
        forward_only: bool,
        stats: StepStats,
        budgets: Optional[list] = None,
        record_moe: bool = False,
    ):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        tr = self.cfg.training
        fb = get_forward_backward_func()
        step = partial(self._forward_step, depth, stats, list(budgets) if budgets else None, record_moe)
        seq, mbs = self.model.pipeline_shape(tr.seq_length, tr.micro_batch_size)  # packed: [b*s, 1, h]
        return fb(
            forward_step_func=step,
            data_iterator=data_iterator,
            model=self.model_chunks,
            num_microbatches=self.num_microbatches,
            seq_length=seq,
            micro_batch_size=mbs,
            decoder_seq_length=seq,
            forward_only=forward_only,
        )

    def _reduce_loss(self, outputs) -> float:
        """Token-mean LM loss over the global batch (summed over micro-batches and DP ranks)."""
        return float(loss_on_device(outputs, self.device))

    def train_step(self, data_iterator, depth: Optional[int] = None) -> StepResult:
        """One optimizer step at ``depth`` (default: the curriculum's depth at this iteration)."""
        t0 = self._step_started = time.perf_counter()
        self._compute_seconds = None
        depth = self.depth_at(self.iteration) if depth is None else depth
        for chunk in self.model_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = StepStats()
        budgets = [
            self.plan.sample_budget(self.cfg.training.seed, self.iteration, m) for m in range(self.num_microbatches)
        ]
        record_moe = self._records_moe() and (self.iteration + 1) % self.cfg.training.log_interval == 0
        self._routing_check = self._routing_agreement(self.iteration + 1)
        try:
            outputs = self._run_schedule(data_iterator, depth, False, stats, budgets, record_moe)
        finally:
            self._routing_check = None
        moe_routing = self._moe_routing_metrics(stats.moe_records) if record_moe else None
        loss, aux, utilisation = step_scalars(outputs, stats, depth, self.plan, self.device)
        finite = math.isfinite(loss)
        if finite:
            update_ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            finite = update_ok and math.isfinite(grad_norm)
        else:
            grad_norm = float("nan")
        skipped = not finite
        if skipped:
            self.nonfinite_skipped += 1
            self._discard_balancing_loads()
            if self.nonfinite_skipped > self.cfg.training.skip_nonfinite_steps:
                raise FloatingPointError(
                    f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at iteration {self.iteration + 1}; "
                    f"{self.nonfinite_skipped - 1} step(s) already skipped, training.skip_nonfinite_steps="
                    f"{self.cfg.training.skip_nonfinite_steps}"
                )
        else:
            self.scheduler.step(increment=1)
            self._update_balancing_bias(self.iteration)
        lr = self.optimizer.param_groups[0]["lr"]
        self.iteration += 1
        self.consumed_train_samples += self.global_batch_size
        tokens = self.global_batch_size * self.cfg.training.seq_length
        if stats.budgets:
            depth = self.plan.depth_for(max(stats.budgets))
        return StepResult(
            step=self.iteration,
            loss=loss,
            aux_loss=aux,
            lr=lr,
            grad_norm=grad_norm,
            depth=depth,
            tokens=tokens,
            seconds=time.perf_counter() - t0,
            skipped=skipped,
            utilisation=utilisation,
            budgets=list(stats.budgets),
            moe_routing=moe_routing,
            compute_seconds=self._compute_seconds,
        )

    def _routing_agreement(self, step: int):
        """The tensor-parallel routing check of iteration ``step`` (None: not checked then, or nothing to
        compare): see :mod:`megatron_lol.parallel.routing_agreement`."""
        if not self.plan.routed:
            return None
        from megatron_lol.parallel.routing_agreement import tensor_parallel_check

        return tensor_parallel_check(step, self.plan.num_stored_blocks, self.cfg.training.routing_agreement_interval)

    def _records_moe(self) -> bool:
        """Whether this model's core has MoE blocks whose routing is measured (U_t, B2, MMR)."""
        return self.plan.core_experts is not None and not self.plan.routed

    def _moe_routing_metrics(self, records: list) -> Optional[dict]:
        """U_t, B2 and MMR per pass of this step's micro-batches (this rank's tokens)."""
        from megatron_lol.model.moe_metrics import summarise

        if not records:
            return None
        return summarise(records, self.plan.core_experts, self.cfg.model.moe.router_topk)

    def _balancers(self):
        cores = [c.module.core for c in self.model_chunks if c.module.core is not None]
        return [b for b in (getattr(core, "balancer", None) for core in cores) if b is not None]

    def _discard_balancing_loads(self) -> None:
        for b in self._balancers():
            b.loads.zero_()

    def _update_balancing_bias(self, step: int) -> None:
        """Loads summed over local chunks, pipeline stages sharing the library and the
        data-parallel ranks (whose windows differ), so every copy of the bias moves alike."""
        from megatron.core import parallel_state

        balancers = self._balancers()
        if not balancers:
            return
        loads = sum(b.loads for b in balancers)
        loads = self.library_sync.reduce_loads(loads.clone())
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(loads, group=group)
        for b in balancers:
            b.update(step, self.schedule_iters, loads=loads.clone())

    def evaluate(self, dataset=None, iters: Optional[int] = None) -> float:
        """Validation loss; Accordion: the mean over the evaluated budgets (per budget in
        ``self.last_eval_by_budget``), the same validation batches for each budget."""
        budgets = self.plan.eval_budgets()
        losses = {k: self._evaluate_once(dataset, iters, k) for k in budgets}
        self.last_eval_by_budget = {k: v for k, v in losses.items() if k is not None}
        return sum(losses.values()) / len(losses)

    @torch.no_grad()
    def _evaluate_once(self, dataset=None, iters: Optional[int] = None, budget: Optional[int] = None) -> float:
        dataset = dataset if dataset is not None else self.valid_ds
        iters = self.cfg.training.eval_iters if iters is None else iters
        if dataset is None or iters == 0:
            return float("nan")
        for chunk in self.model_chunks:
            chunk.eval()
        it = self.data_iterator(dataset, 0)
        stat = []
        depth = self.depth_at(self.iteration)
        budgets = None if budget is None else [budget] * self.num_microbatches
        for _ in range(iters):
            outputs = self._run_schedule(it, depth, True, StepStats(), budgets)
            stat.append(self._reduce_loss(outputs))
        for chunk in self.model_chunks:
            chunk.train()
        return sum(stat) / len(stat)

    # ----------------------------------------------------------------- loop
    def train(self, callbacks: Optional[list] = None) -> TrainOutcome:
        """The loop: a step, evaluation when due, then every callback (:mod:`.hooks`); a callback
        may return a :class:`~megatron_lol.training.hooks.Stop` to end training with its exit status."""
        tr = self.cfg.training
        callbacks = default_hooks(self) if callbacks is None else callbacks
        for cb in callbacks:
            cb.on_start(self)
        data = self.data_iterator(self.train_ds, self.consumed_train_samples)
        outcome = TrainOutcome(results=[])
        log_rank0(
            f"training: {tr.train_iters} iterations, global batch {self.global_batch_size} "
            f"({self.num_microbatches} micro-batches of {tr.micro_batch_size} x {tr.seq_length} tokens, "
            f"data parallel {self.dp_size}), starting at iteration {self.iteration}"
        )
        if tr.eval_at_start and self.iteration == 0 and tr.eval_iters > 0:
            self._log_eval_only(self.evaluate())
        stop = None
        while self.iteration < tr.train_iters and stop is None:
            res = self.train_step(data)
            if res.step % tr.eval_interval == 0 or res.step == tr.train_iters:
                res.eval_loss = self.evaluate()
            outcome.results.append(res)
            for cb in callbacks:
                stop = cb.on_step_end(self, res) or stop
        for cb in callbacks:
            cb.on_end(self, stop)
        if stop is not None:
            outcome.exit_code, outcome.reason = stop.exit_code, stop.reason
        return outcome

    def stop_heartbeat(self) -> None:
        """This rank is done with collectives: its watcher stops watching it (:mod:`.heartbeat`)."""
        heartbeat, self.heartbeat = getattr(self, "heartbeat", None), None
        if heartbeat is not None:
            heartbeat.stop()
