"""The training loop, on megatron-core's schedules, optimizer and process groups.

One step:

1. the core depth for this step (growing curriculum, the same on every rank);
2. ``get_forward_backward_func()`` over the micro-batches (1F1B / interleaved
   with pipeline parallelism, plain gradient accumulation otherwise); the loss
   is the token-mean LM loss, the balancing loss rides along in the graph;
3. the megatron optimizer step (AdamW, gradient clipping, DDP/distributed
   optimizer reductions) and the LR schedule;
4. the loss-free balancing-bias update, with loads summed over the ranks that
   saw different windows;
5. logging (console + ``metrics.jsonl``), evaluation, checkpoints.

Cross-cutting concerns (checkpoints, signals) live in their own modules and are
called at step boundaries.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator, Optional

import torch

from megatron_lol.config.schema import ConfigError, ExperimentConfig
from megatron_lol.log import log_rank0


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
    budgets: list = field(default_factory=list)  # accordion: the budget of each micro-batch
    moe_routing: Optional[dict] = None  # looped/accordion MoE cores: U_t, B2, MMR (log steps only)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, tokenizer=None, datasets: Optional[tuple] = None):
        """``tokenizer`` / ``datasets`` (train, valid, test) override what the
        config would build (tests, notebooks, benchmarks)."""
        self.cfg = cfg
        self._given_tokenizer = tokenizer
        self._given_datasets = datasets
        self.iteration = 0  # optimizer steps completed
        self.consumed_train_samples = 0
        self.nonfinite_skipped = 0
        self._step_loads: Optional[torch.Tensor] = None
        self._step_aux: list = []
        self._step_budgets: list = []  # accordion: budgets of this step's micro-batches
        self._microbatch = 0  # index of the next micro-batch within the current schedule
        self._eval_budget: Optional[int] = None
        self.last_eval_by_budget: dict = {}

    # ---------------------------------------------------------------- setup
    def setup(self) -> "Trainer":
        from megatron.core import parallel_state, tensor_parallel

        from megatron_lol.platform import init_distributed, setup_platform

        cfg = self.cfg
        self.device_kind = setup_platform()
        init_distributed()
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
        )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
        torch.manual_seed(cfg.training.seed)

        tr = cfg.training
        self.global_batch_size = tr.global_batch_size or tr.micro_batch_size * self.dp_size
        if self.global_batch_size % (tr.micro_batch_size * self.dp_size):
            raise ConfigError(
                f"training.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"micro_batch_size x data_parallel_size = {tr.micro_batch_size * self.dp_size}")
        self.num_microbatches = self.global_batch_size // (tr.micro_batch_size * self.dp_size)

        self._build_tokenizer()
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
        from megatron_lol.data.tokenizers import build_tokenizer

        self.tokenizer = build_tokenizer(d.tokenizer_type, tokenizer_model=d.tokenizer_model,
                                         vocab_file=d.vocab_file, merge_file=d.merge_file)
        self.eod_id = self.tokenizer.eod

    def _build_model(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from megatron_lol.model.lol_model import LoLGPTModel, padded_vocab_size

        cfg = self.cfg
        vocab = cfg.model.vocab_size or padded_vocab_size(
            self.tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by,
            cfg.parallel.tensor_model_parallel_size)
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab} is smaller than the tokenizer's {self.tokenizer.vocab_size}")
        self.vocab_size = vocab
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size
        chunks = []
        for vp_stage in range(vpp or 1):
            model = LoLGPTModel(cfg.model, vocab_size=vocab, eod_id=self.eod_id, parallel=cfg.parallel,
                                max_sequence_length=cfg.training.seq_length, init_seed=cfg.training.seed,
                                vp_stage=vp_stage if vpp else None)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
            chunks.append(DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                                  disable_bucketing=vp_stage > 0))
        self.model_chunks = chunks
        self.ddp = chunks[0]
        self.model = chunks[0].module  # the first (virtual) stage's model
        # the schedules call this after the last backward: library sum over the pipeline
        # stages that share it, then megatron's DP / SP-norm / tied-embedding reductions
        from megatron_lol.parallel.library_sync import LibrarySync

        self.library_sync = LibrarySync(chunks, cfg.model)
        for chunk in chunks:
            chunk.module.config.finalize_model_grads_func = self.library_sync.finalize_model_grads

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig as MOptConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o, tr = self.cfg.optimizer, self.cfg.training
        bf16 = self.cfg.model.params_dtype == "bf16"
        mcfg = MOptConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                          adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                          clip_grad=o.clip_grad, bf16=bf16,
                          params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(mcfg, self.model_chunks)
        wsd = o.lr_wsd_decay_iters if o.lr_decay_style == "WSD" else None
        if o.lr_decay_style == "WSD" and wsd is None:
            wsd = max(1, tr.train_iters // 5)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_iters else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=tr.train_iters,
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=tr.train_iters, wd_incr_style="constant", wsd_decay_steps=wsd,
            lr_wsd_decay_style=o.lr_wsd_decay_style)

    def _build_data(self) -> None:
        tr, d = self.cfg.training, self.cfg.data
        if self._given_datasets is not None:
            self.train_ds, self.valid_ds, self.test_ds = self._given_datasets
            return
        from megatron_lol.data.datasets import build_train_valid_test_datasets

        evals = (tr.train_iters // tr.eval_interval + 1) * tr.eval_iters * self.global_batch_size
        num_samples = (tr.train_iters * self.global_batch_size, evals, tr.eval_iters * self.global_batch_size)
        self.train_ds, self.valid_ds, self.test_ds = build_train_valid_test_datasets(
            d.paths, d.split, tr.seq_length, tr.seed, d.cache_dir, num_samples, self.tokenizer,
            vocab_size=self.vocab_size)  # every token id checked against the embedding once, here

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
        while True:
            base = sample + dp_rank * per_rank
            for m in range(self.num_microbatches):
                idx = [(base + m * mbs + j) % n for j in range(mbs)]
                items = [dataset[i] for i in idx]
                batch = {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in ("tokens", "labels", "loss_mask")}
                # global sample numbers: router noise is drawn per sample from them
                batch["sample_ids"] = torch.tensor([base + m * mbs + j for j in range(mbs)], dtype=torch.long)
                yield batch
            sample += self.global_batch_size

    def data_iterator(self, dataset, start_sample: int):
        """What the schedule consumes: one iterator, or one per virtual pipeline chunk
        (the interleaved schedule pulls each chunk's micro-batches separately)."""
        if len(self.model_chunks) == 1:
            return self._batches(dataset, start_sample)
        return [self._batches(dataset, start_sample) for _ in self.model_chunks]

    # ---------------------------------------------------------------- steps
    def depth_at(self, step: int) -> int:
        cur, full = self.cfg.curriculum, self.cfg.model.core_depth
        if cur.initial_depth is None:
            return full
        from megatron_lol.model.schedule import depth_at_step

        growth_iters = math.floor(cur.growth_fraction * self.cfg.training.train_iters)
        return depth_at_step(step, growth_iters, cur.initial_depth, full)

    def budget_for(self, iteration: int, microbatch: int) -> Optional[int]:
        """Accordion: the budget of one training micro-batch (None for other plans).

        Drawn uniformly from ``loop_budgets`` by a generator seeded with (seed,
        iteration, micro-batch index): every rank of a step — data, tensor and
        expert parallel alike — draws the same budget without communicating, and
        a resumed run draws what the uninterrupted one would have.
        """
        m = self.cfg.model
        if m.plan != "accordion":
            return None
        if m.loop_budget is not None:
            return m.loop_budget
        import numpy as np

        rng = np.random.default_rng([self.cfg.training.seed, iteration, microbatch])
        return int(m.loop_budgets[int(rng.integers(len(m.loop_budgets)))])

    def _forward_step(self, depth: int, data_iterator, model):
        batch = next(data_iterator)
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"].float()
        cur = self.cfg.curriculum
        seeds = batch["sample_ids"] + self.cfg.training.seed * 1_000_000_007 if "sample_ids" in batch else None
        kwargs = {}
        if self.cfg.model.plan == "accordion":
            if model.training:
                budget = self.budget_for(self.iteration, self._microbatch)
                self._step_budgets.append(budget)
            else:
                budget = self._eval_budget
            kwargs["budget"] = budget
        self._microbatch += 1
        output = model(tokens, labels=labels, depth=depth, backprop_depth=cur.backprop_depth,
                       first_window_full_backprop=cur.first_window_full_backprop, noise_seeds=seeds, **kwargs)
        core = getattr(model, "module", model).last_core
        if core is not None and model.training:
            if core.block_loads is not None:
                loads = core.block_loads.double()
                self._step_loads = loads if self._step_loads is None else self._step_loads + loads
            if core.aux_loss is not None:
                self._step_aux.append(float(core.aux_loss.detach()))
        return output, partial(self._loss_func, loss_mask)

    @staticmethod
    def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        losses = output.float().view(-1)
        mask = loss_mask.view(-1)
        total = torch.sum(losses * mask)
        count = mask.sum().to(torch.int)
        report = torch.stack([total.detach().clone(), mask.sum().detach()])
        return total, count, {"lm loss": report}

    def _run_schedule(self, data_iterator, depth: int, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_lol.model.lol_model import AuxLossAttach

        tr = self.cfg.training
        AuxLossAttach.scale = 1.0 / self.num_microbatches
        self._microbatch = 0
        fb = get_forward_backward_func()
        return fb(forward_step_func=partial(self._forward_step, depth), data_iterator=data_iterator,
                  model=self.model_chunks, num_microbatches=self.num_microbatches,
                  seq_length=tr.seq_length, micro_batch_size=tr.micro_batch_size,
                  decoder_seq_length=tr.seq_length, forward_only=forward_only)

    def _reduce_loss(self, outputs) -> float:
        """Token-mean LM loss over the global batch (summed over micro-batches and DP ranks)."""
        from megatron.core import parallel_state

        stat = torch.zeros(2, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for out in outputs:
                stat += out["lm loss"].double()
        torch.distributed.all_reduce(stat, group=parallel_state.get_data_parallel_group())
        # the last pipeline stage holds the loss: share it with every stage
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(stat, group=parallel_state.get_pipeline_model_parallel_group())
        return float(stat[0] / stat[1].clamp(min=1))

    def train_step(self, data_iterator) -> StepResult:
        from megatron.core import parallel_state

        t0 = time.perf_counter()
        depth = self.depth_at(self.iteration)
        for chunk in self.model_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._step_loads, self._step_aux, self._step_budgets = None, [], []
        record_moe = self._moe_cores() and (self.iteration + 1) % self.cfg.training.log_interval == 0
        for core in self._moe_cores() if record_moe else ():
            core.moe_records = []
        outputs = self._run_schedule(data_iterator, depth, forward_only=False)
        moe_routing = self._moe_routing_metrics() if record_moe else None
        loss = self._reduce_loss(outputs)
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
                    f"{self.cfg.training.skip_nonfinite_steps}")
        else:
            self.scheduler.step(increment=1)
            self._update_balancing_bias(self.iteration)
        lr = self.optimizer.param_groups[0]["lr"]
        utilisation = []
        if self.cfg.model.plan == "lol":
            loads = (self._step_loads.clone() if self._step_loads is not None
                     else torch.zeros(self.cfg.model.core_depth, self.cfg.model.num_blocks, dtype=torch.float64))
            torch.distributed.all_reduce(loads, group=parallel_state.get_data_parallel_group())
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # depths live on several stages
                torch.distributed.all_reduce(loads, group=parallel_state.get_pipeline_model_parallel_group())
            loads = loads[:depth]
            utilisation = (loads / loads.sum(dim=1, keepdim=True).clamp(min=1)).tolist()
        aux = sum(self._step_aux) / max(1, len(self._step_aux))
        self.iteration += 1
        self.consumed_train_samples += self.global_batch_size
        tokens = self.global_batch_size * self.cfg.training.seq_length
        if self._step_budgets:
            depth = self.cfg.model.num_blocks + max(self._step_budgets)
        return StepResult(step=self.iteration, loss=loss, aux_loss=aux, lr=lr, grad_norm=grad_norm,
                          depth=depth, tokens=tokens, seconds=time.perf_counter() - t0, skipped=skipped,
                          utilisation=utilisation, budgets=list(self._step_budgets), moe_routing=moe_routing)

    def _moe_cores(self) -> list:
        """Cores whose fixed-plan blocks are MoE layers (Foil, Accordion): their routing is measured."""
        m = self.cfg.model
        if m.plan == "lol" or m.core_experts is None:
            return []
        return [c.module.core for c in self.model_chunks if c.module.core is not None]

    def _moe_routing_metrics(self) -> Optional[dict]:
        """U_t, B2 and MMR per pass of this step's micro-batches (this rank's tokens)."""
        from megatron_lol.analysis.moe_routing import summarise

        records = []
        for core in self._moe_cores():
            records.extend(core.moe_records or [])
            core.moe_records = None
        if not records:
            return None
        return summarise(records, self.cfg.model.core_experts, self.cfg.model.moe_router_topk)

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
            b.update(step, self.cfg.training.train_iters, loads=loads.clone())

    def eval_budgets(self) -> list:
        """Accordion: the budgets evaluated (the fixed one, else every one); [None] otherwise."""
        m = self.cfg.model
        if m.plan != "accordion":
            return [None]
        return [m.loop_budget] if m.loop_budget is not None else list(m.loop_budgets)

    def evaluate(self, dataset=None, iters: Optional[int] = None) -> float:
        """Validation loss; Accordion: the mean over the evaluated budgets (per budget in
        ``self.last_eval_by_budget``), the same validation batches for each budget."""
        budgets = self.eval_budgets()
        losses = {k: self._evaluate_once(dataset, iters, k) for k in budgets}
        self.last_eval_by_budget = {k: v for k, v in losses.items() if k is not None}
        return sum(losses.values()) / len(losses)

    @torch.no_grad()
    def _evaluate_once(self, dataset=None, iters: Optional[int] = None, budget: Optional[int] = None) -> float:
        self._eval_budget = budget
        dataset = dataset if dataset is not None else self.valid_ds
        iters = self.cfg.training.eval_iters if iters is None else iters
        if dataset is None or iters == 0:
            return float("nan")
        for chunk in self.model_chunks:
            chunk.eval()
        it = self.data_iterator(dataset, 0)
        stat = []
        depth = self.depth_at(self.iteration)
        for _ in range(iters):
            outputs = self._run_schedule(it, depth, forward_only=True)
            stat.append(self._reduce_loss(outputs))
        for chunk in self.model_chunks:
            chunk.train()
        return sum(stat) / len(stat)

    # ----------------------------------------------------------------- loop
    def train(self) -> list[StepResult]:
        tr = self.cfg.training
        hooks = self._hooks()
        for hook in hooks:
            hook.on_start(self)
        data = self.data_iterator(self.train_ds, self.consumed_train_samples)
        results = []
        log_rank0(f"training: {tr.train_iters} iterations, global batch {self.global_batch_size} "
                  f"({self.num_microbatches} micro-batches of {tr.micro_batch_size} x {tr.seq_length} tokens, "
                  f"data parallel {self.dp_size}), starting at iteration {self.iteration}")
        if tr.eval_at_start and self.iteration == 0 and tr.eval_iters > 0:
            self._log_eval_only(self.evaluate())
        window_tokens, window_time, window_flops = 0, 0.0, 0.0
        while self.iteration < tr.train_iters:
            res = self.train_step(data)
            results.append(res)
            window_tokens += res.tokens
            window_time += res.seconds
            eval_loss = None
            if res.step % tr.eval_interval == 0 or res.step == tr.train_iters:
                eval_loss = self.evaluate()
            window_flops += self._step_flops(res)
            if res.step % tr.log_interval == 0 or res.step == tr.train_iters or eval_loss is not None:
                tps = window_tokens / max(window_time, 1e-9)
                tflops = window_flops / max(window_time, 1e-9) / torch.distributed.get_world_size() / 1e12
                self._log(res, tps, eval_loss, tflops)
                window_tokens, window_time, window_flops = 0, 0.0, 0.0
            stop = False
            for hook in hooks:
                stop = hook.on_step_end(self, res) or stop
            if stop:
                break
        for hook in hooks:
            hook.on_end(self)
        return results

    def _hooks(self) -> list:
        from megatron_lol.training.hooks import default_hooks

        return default_hooks(self)

    def _log_eval_only(self, eval_loss: float) -> None:
        """The evaluation of the untrained model (``training.eval_at_start``): step 0."""
        if torch.distributed.get_rank() != 0:
            return
        print(f" iteration {0:6d}/{self.cfg.training.train_iters} | eval loss {eval_loss:.4f} "
              f"(initial model)", flush=True)
        if self.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as f:
                record = {"step": 0, "eval_loss": eval_loss, "depth": self.depth_at(0), "consumed_samples": 0}
                if self.last_eval_by_budget:
                    record["eval_loss_by_budget"] = {str(k): v for k, v in self.last_eval_by_budget.items()}
                f.write(json.dumps(record) + "\n")

    def _step_flops(self, res: StepResult) -> float:
        """Model FLOPs of one step (FLOP model of :mod:`megatron_lol.perf.flops`), all ranks together;
        Accordion's micro-batches ran the depths of their sampled budgets."""
        from megatron_lol.perf.flops import training_flops_per_step

        if res.budgets:
            return training_flops_per_step(self.cfg, None, self.global_batch_size, self.cfg.training.seq_length,
                                           vocab_size=self.vocab_size, budgets=res.budgets)
        return training_flops_per_step(self.cfg, res.depth, self.global_batch_size, self.cfg.training.seq_length,
                                       vocab_size=self.vocab_size)

    def _device_peak_tflops(self) -> Optional[float]:
        if not torch.cuda.is_available():
            return None  # MFU is not defined against a CPU here
        from megatron_lol.perf.peaks import peak_tflops

        m = self.cfg.model
        precision = "fp8" if m.fp8 else "bf16" if m.params_dtype == "bf16" else "tf32"
        return peak_tflops(torch.cuda.get_device_name(), precision)

    def _log(self, res: StepResult, tokens_per_s: float, eval_loss: Optional[float],
             tflops_per_device: float = 0.0) -> None:
        rank0 = torch.distributed.get_rank() == 0
        if not rank0:
            return
        peak = self._device_peak_tflops()
        mfu = tflops_per_device / peak if peak else None
        util = " ".join("[" + ",".join(f"{u:.2f}" for u in row) + "]" for row in res.utilisation)
        msg = (f" iteration {res.step:6d}/{self.cfg.training.train_iters} | loss {res.loss:.4f} | "
               f"lr {res.lr:.3e} | grad norm {res.grad_norm:.3f} | depth {res.depth} | "
               f"tokens/s {tokens_per_s:,.0f} | TFLOP/s/device {tflops_per_device:.3f}")
        if mfu is not None:
            msg += f" | MFU {100 * mfu:.1f}%"
        if res.aux_loss:
            msg += f" | balance loss {res.aux_loss:.2e}"
        if res.skipped:
            msg += " | SKIPPED (non-finite)"
        if eval_loss is not None:
            msg += f" | eval loss {eval_loss:.4f}"
        if util:
            msg += f" | blocks {util}"
        if res.budgets:
            msg += f" | budgets {res.budgets}"
        by_budget = self.last_eval_by_budget if eval_loss is not None else None
        if by_budget:
            msg += " | eval by budget " + " ".join(f"k={k}:{v:.4f}" for k, v in by_budget.items())
        if res.moe_routing:
            r = res.moe_routing
            msg += (f" | U_t {r['distinct_experts_per_token']:.2f} | B2 {r['b2']:.3f} | MMR {r['mmr']:.3f}")
        print(msg, flush=True)
        if self.metrics_path:
            record = {"step": res.step, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
                      "tokens_per_s": tokens_per_s, "tflops_per_device": tflops_per_device,
                      "mfu": mfu, "depth": res.depth, "aux_loss": res.aux_loss,
                      "block_utilisation": res.utilisation, "skipped": res.skipped,
                      "consumed_samples": self.consumed_train_samples}
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
                if by_budget:
                    record["eval_loss_by_budget"] = {str(k): v for k, v in by_budget.items()}
            if res.budgets:
                record["budgets"] = res.budgets
            if res.moe_routing:
                record["moe_routing"] = res.moe_routing
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
