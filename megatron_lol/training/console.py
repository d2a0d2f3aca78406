"""The training console: the log line, and the metric sinks behind it.

Every logged iteration goes, in this order, to

1. ``metrics.jsonl`` (``training.metrics_file``, default ``<save>/metrics.jsonl``): one
   JSON object per logged iteration. It is the source of truth that tools and tests
   read; the other outputs are views of the same values;
2. the console line, laid out as Megatron-LM's (``name value`` fields between ``|``)::

     iteration     40/800 | samples 320 | tokens 81,920 | ms/iter 212.4 | loss 6.1234 | lr 2.988e-03 |
     grad norm 1.234 | depth 2 | tokens/s 4,821 | TFLOP/s/device 0.031 | balance loss 4.05e-04 |
     skipped 0 | nan 0 | peak mem 612 MiB | ETA 0:02:49 | blocks [0.25,0.19,0.25,0.31] [...]

   ``ms/iter`` is the mean step time since the previous line; with data parallelism
   ``min/max ms/iter`` follows: the fastest and slowest data-parallel rank (named) by the
   time from a step's start to its gradient reduction, i.e. a rank's own work before it
   waits for the others (one all-gather of a float per log line, as Megatron-LM's
   straggler detector reports it; a whole step lasts the slowest rank's time on every
   rank, so ``ms/iter`` alone cannot show a straggler); ``skipped`` / ``nan`` count
   the iterations since the previous line whose update was skipped / whose loss was not
   finite, ``peak mem`` is ``torch.cuda.max_memory_allocated`` on a GPU and the peak
   resident set size of the process on a CPU, and ``ETA`` extrapolates the wall time per
   iteration since the loop started (evaluations and checkpoints included) to
   ``train_iters``;
3. TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``,
   ``--wandb-exp-name``, ``--wandb-save-dir``), when configured, under Megatron-LM's
   scalar names (``lm loss``, ``learning-rate``, ``grad-norm``, ``batch-size``,
   ``iteration-time``, ``throughput``, ``lm loss validation``, ... and ``X vs samples``
   in TensorBoard) plus LoL's: ``depth``, ``block-utilisation/depth-D/block-B`` (the
   share of depth D's windows that block B ran), ``balance-loss``, ``bias-spread``
   (largest minus smallest balancing bias), ``routing-entropy`` (entropy of the block
   shares, nats, mean over depths, and per depth). The per-iteration scalars are
   written every ``--tensorboard-log-interval`` iterations (Megatron-LM's default 1);
   throughput, memory, validation and routing-bias scalars at the console lines.

Only global rank 0 writes. Everything it writes is reduced by the trainer first
(loss and block loads over data-parallel ranks and pipeline stages), so rank 0 of
a pipeline holds the last stage's loss too.

The sink libraries are optional (``pip install 'megatron-lol[console]'``); asking for
one that is not installed is a one-line error before any model is built
(:func:`check_sink_packages`). Nothing here imports torch at module level: the
start-up line (:func:`announce_startup`) prints before the heavy imports.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional, Sequence

from megatron_lol.errors import CliError
from megatron_lol.training.hooks import Hook, Stop

CONSOLE_EXTRA = "pip install 'megatron-lol[console]'"


# ----------------------------------------------------------------- start-up
def check_sink_packages(training_cfg) -> None:
    """A clear error when a configured sink's package is missing (no import, so cheap)."""
    from importlib.util import find_spec

    if training_cfg.tensorboard_dir and find_spec("tensorboard") is None:
        raise CliError(f"--tensorboard-dir: the tensorboard package is not installed ({CONSOLE_EXTRA})")
    if training_cfg.wandb_project and find_spec("wandb") is None:
        raise CliError(f"--wandb-project: the wandb package is not installed ({CONSOLE_EXTRA})")


def startup_line(cfg, config_path: str, world_size: int) -> str:
    from megatron_lol import __version__

    m, tr = cfg.model, cfg.training
    plan = m.execution_plan()
    shape = f"plan {plan.name}, width {m.hidden_size}, {plan.describe()}, params {m.precision.params_dtype}"
    if m.precision.fp8:
        shape += f" + FP8 {m.precision.fp8} ({m.precision.fp8_recipe})"
    sinks = [name for name, on in (("TensorBoard", tr.tensorboard_dir), ("W&B", tr.wandb_project)) if on]
    iters = (
        f"{tr.train_iters} iterations"
        if tr.train_iters is not None
        else f"a budget of {tr.train_flops:.4g} training FLOPs"
    )
    line = (
        f"megatron-lol {__version__} train: {config_path} ({shape}), {iters}, "
        f"{world_size} process{'es' if world_size != 1 else ''}"
    )
    if sinks:
        line += f", logging to metrics.jsonl + {' + '.join(sinks)}"
    return line + "; importing megatron-core and building the model ..."


def announce_startup(cfg, config_path: str) -> None:
    """Print :func:`startup_line` on global rank 0, before ``torch.distributed`` exists."""
    check_sink_packages(cfg.training)
    if os.environ.get("RANK", "0") == "0":
        print(startup_line(cfg, config_path, int(os.environ.get("WORLD_SIZE", "1"))), flush=True)
        note = layout_dependence_note(cfg)
        if note:
            print(note, flush=True)


def layout_dependence_note(cfg) -> Optional[str]:
    """A note when a setting makes the run depend on its parallel layout (every layout gives the same
    losses as one process otherwise): Muon's ``blockwise`` TP mode under tensor parallelism."""
    o, tp = cfg.optimizer, cfg.parallel.tensor_model_parallel_size
    if o.name == "muon" and o.muon_tp_mode == "blockwise" and tp > 1:
        return (
            f"note: optimizer.muon_tp_mode blockwise (--muon-tp-mode) orthogonalises each of the {tp} "
            f"tensor-parallel shards of a matrix on its own: the updates, and so the losses, depend on the "
            f"tensor-parallel size (duplicated, the default, gives one process's)"
        )
    return None


# ----------------------------------------------------------------- values
def routing_entropy(utilisation: Sequence[Sequence[float]]) -> list:
    """Entropy (nats) of each depth's block shares; ``ln L`` is uniform routing, 0 one block."""
    out = []
    for row in utilisation:
        total = sum(row)
        out.append(-sum(p / total * math.log(p / total) for p in row if p > 0) if total > 0 else 0.0)
    return out


def bias_spread(balancers) -> Optional[float]:
    """Largest minus smallest loss-free balancing bias (per depth row, the widest row);
    None without a balancer on this rank."""
    spreads = [float((b.bias.max(dim=-1).values - b.bias.min(dim=-1).values).max()) for b in balancers]
    return max(spreads) if spreads else None


def peak_memory() -> tuple[int, str]:
    """(bytes, kind): CUDA ``max_memory_allocated`` when CUDA is in use, else the process's peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "rss"  # Linux reports KiB


def format_bytes(n: float) -> str:
    if n >= 10 * 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB"


def format_count(n: float) -> str:
    """12,345 below a million, then 1.23M / 4.56B / 7.89T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{int(n):,}"


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(max(0.0, seconds)))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{h}:{m:02d}:{s:02d}"


def format_line(record: dict, train_iters: int) -> str:
    """The console line of one ``metrics.jsonl`` record."""
    r = record
    parts = [
        f" iteration {r['step']:6d}/{train_iters}",
        f"samples {r['consumed_samples']:,}",
        f"tokens {format_count(r['consumed_tokens'])}",
        f"ms/iter {r['ms_per_iteration']:.1f}",
    ]
    if r.get("max_ms_per_iteration") is not None:
        parts.append(
            f"min/max ms/iter {r['min_ms_per_iteration']:.1f} (rank {r['min_ms_rank']})/"
            f"{r['max_ms_per_iteration']:.1f} (rank {r['max_ms_rank']})"
        )
    parts += [
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.3e}",
        f"grad norm {r['grad_norm']:.3f}",
        f"depth {r['depth']}",
        f"tokens/s {r['tokens_per_s']:,.0f}",
        f"TFLOP/s/device {r['tflops_per_device']:.3f}",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("aux_loss"):
        parts.append(f"balance loss {r['aux_loss']:.2e}")
    parts += [
        f"skipped {r['skipped_iterations']}",
        f"nan {r['nan_iterations']}",
        f"peak mem {format_bytes(r['peak_memory_bytes'])}",
        f"ETA {format_duration(r.get('eta_s'))}",
    ]
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    if "eval_loss" in r:
        parts.append(f"eval loss {r['eval_loss']:.4f}")
    if r.get("block_utilisation"):
        parts.append(
            "blocks " + " ".join("[" + ",".join(f"{u:.2f}" for u in row) + "]" for row in r["block_utilisation"])
        )
    if r.get("budgets"):
        parts.append(f"budgets {r['budgets']}")
    if r.get("eval_loss_by_budget"):
        parts.append("eval by budget " + " ".join(f"k={k}:{v:.4f}" for k, v in r["eval_loss_by_budget"].items()))
        if r.get("eval_loss_endpoints") is not None:
            parts.append(f"eval endpoints mean {r['eval_loss_endpoints']:.4f}")
    if r.get("moe_routing"):
        m = r["moe_routing"]
        parts.append(f"U_t {m['distinct_experts_per_token']:.2f} | B2 {m['b2']:.3f} | MMR {m['mmr']:.3f}")
    return " | ".join(parts)


def step_scalars(res, global_batch_size: int, world_size: int) -> dict:
    """The scalars of one training iteration (written every ``tensorboard_log_interval``)."""
    out = {
        "lm loss": res.loss,
        "learning-rate": res.lr,
        "grad-norm": res.grad_norm,
        "batch-size": global_batch_size,
        "world-size": world_size,
        "depth": res.depth,
    }
    if res.aux_loss:
        out["balance-loss"] = res.aux_loss
    if res.utilisation:
        entropy = routing_entropy(res.utilisation)
        out["routing-entropy"] = sum(entropy) / len(entropy)
        for d, (row, h) in enumerate(zip(res.utilisation, entropy), start=1):
            out[f"routing-entropy/depth-{d}"] = h
            for b, share in enumerate(row):
                out[f"block-utilisation/depth-{d}/block-{b}"] = share
    return out


def endpoint_mean(by_budget: Optional[dict]) -> Optional[float]:
    """Accordion: the mean validation loss of the smallest and the largest budget, the "Mean" of the
    Accordion paper's Table 1 (budget sets compared on their common endpoints k = 0 and 12); ``eval_loss``
    is the mean over every evaluated budget. None with fewer than two budgets."""
    if not by_budget or len(by_budget) < 2:
        return None
    keys = sorted(by_budget, key=int)
    return (by_budget[keys[0]] + by_budget[keys[-1]]) / 2


def validation_scalars(eval_loss: float, by_budget: Optional[dict]) -> dict:
    out = {
        "lm loss validation": eval_loss,
        "lm loss validation ppl": math.exp(min(eval_loss, 20.0)) if math.isfinite(eval_loss) else eval_loss,
    }
    for k, v in (by_budget or {}).items():
        out[f"lm loss validation k={k}"] = v
    if endpoint_mean(by_budget) is not None:
        out["lm loss validation endpoints"] = endpoint_mean(by_budget)
    return out


def log_scalars(record: dict) -> dict:
    """The scalars written at console lines (window averages, memory, validation, routing bias)."""
    out = {
        "iteration-time": record["ms_per_iteration"] / 1000.0,
        "throughput": record["tflops_per_device"],
        "tokens-per-sec": record["tokens_per_s"],
        "consumed-tokens": record["consumed_tokens"],
        "skipped-iterations": record["skipped_iterations"],
        "nan-iterations": record["nan_iterations"],
        ("mem-max-allocated-bytes" if record["peak_memory_kind"] == "cuda" else "mem-peak-rss-bytes"): record[
            "peak_memory_bytes"
        ],
    }
    if record.get("mfu") is not None:
        out["mfu"] = record["mfu"]
    if record.get("bias_spread") is not None:
        out["bias-spread"] = record["bias_spread"]
    if "eval_loss" in record:
        out.update(validation_scalars(record["eval_loss"], record.get("eval_loss_by_budget")))
    moe = record.get("moe_routing")
    if moe:
        out.update(
            {
                "moe/distinct-experts-per-token": moe["distinct_experts_per_token"],
                "moe/b2": moe["b2"],
                "moe/mmr": moe["mmr"],
            }
        )
    return out


# ----------------------------------------------------------------- sinks
class MetricSinks:
    """TensorBoard's ``SummaryWriter`` and a W&B run, each optional; rank 0 only.

    TensorBoard also gets Megatron-LM's ``X vs samples`` variant of the main scalars
    (x = consumed samples); W&B gets ``samples vs steps`` instead (its charts can use
    any logged value as the x axis).
    """

    VS_SAMPLES = ("lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation")

    def __init__(self, cfg):
        tr = cfg.training
        check_sink_packages(tr)
        self.tensorboard = None
        self.wandb = None
        if tr.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            try:
                os.makedirs(tr.tensorboard_dir, exist_ok=True)
            except OSError as err:
                raise CliError(f"--tensorboard-dir {tr.tensorboard_dir}: cannot create it ({err.strerror})") from None
            self.tensorboard = SummaryWriter(log_dir=tr.tensorboard_dir)
            self.tensorboard.add_text("config", "```\n" + json.dumps(cfg.to_dict(), indent=1) + "\n```", 0)
            print(
                f" tensorboard: writing to {tr.tensorboard_dir} (view: tensorboard --logdir {tr.tensorboard_dir})",
                flush=True,
            )
        if tr.wandb_project:
            import wandb

            save_dir = tr.wandb_save_dir or (os.path.join(tr.save, "wandb") if tr.save else "wandb")
            try:
                os.makedirs(save_dir, exist_ok=True)
                self.wandb = wandb.init(
                    project=tr.wandb_project, name=tr.wandb_exp_name, dir=save_dir, config=cfg.to_dict()
                )
            except (OSError, wandb.errors.Error) as err:
                self.close()
                raise CliError(
                    f"--wandb-project {tr.wandb_project}: W&B did not start ({err}); log in with "
                    f"`wandb login`, or set WANDB_MODE=offline to keep the run on disk"
                ) from None

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def write(self, scalars: dict, step: int, samples: Optional[int] = None) -> None:
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
                if samples is not None and key in self.VS_SAMPLES:
                    self.tensorboard.add_scalar(f"{key} vs samples", value, samples)
        if self.wandb is not None:
            payload = dict(scalars)
            if samples is not None:
                payload["samples vs steps"] = samples
            self.wandb.log(payload, step=step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


# ----------------------------------------------------------------- the console
class TrainingConsole(Hook):
    """Counters, the console line, ``metrics.jsonl`` and the sinks of one training run.

    A callback of the training loop: :meth:`on_step_end` sees every iteration (the
    skipped / NaN counters and the per-iteration sink scalars need them) and sums
    tokens, seconds and model FLOPs since the previous line; every ``log_interval``
    steps, on evaluation steps and at the end it asks the trainer for the line's
    values (``Trainer._log``), which calls :meth:`log_step` with plain values.
    """

    def __init__(self, cfg, metrics_path: Optional[str], global_batch_size: int, world_size: int, rank0: bool):
        self.cfg = cfg
        self.metrics_path = metrics_path
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank0 = rank0
        self.sinks: Optional[MetricSinks] = None
        self._last_seen = -1
        self.skipped = 0  # since the last console line
        self.nan = 0
        self._start: Optional[tuple[float, int]] = None  # (monotonic time, iteration) of the loop start
        self._window = [0, 0.0, 0.0]  # tokens, seconds, model FLOPs since the previous line
        self._compute = [0.0, 0]  # this rank's compute seconds (StepResult.compute_seconds), steps with one

    # callback protocol --------------------------------------------------
    def on_start(self, trainer) -> None:
        self._start = (time.monotonic(), trainer.iteration)
        self._open_sinks()

    def on_step_end(self, trainer, result) -> Optional[Stop]:
        self.observe(result, trainer.consumed_train_samples)
        tr = self.cfg.training
        self._window[0] += result.tokens
        self._window[1] += result.seconds
        self._window[2] += trainer._step_flops(result)
        if getattr(result, "compute_seconds", None) is not None:
            self._compute[0] += result.compute_seconds
            self._compute[1] += 1
        if result.step % tr.log_interval == 0 or result.step == tr.train_iters or result.eval_loss is not None:
            tokens, seconds, flops = self._window
            compute, n = self._compute
            trainer._log(
                result,
                tokens / max(seconds, 1e-9),
                result.eval_loss,
                flops / max(seconds, 1e-9) / self.world_size / 1e12,
                compute_ms=1000.0 * compute / n if n else None,
            )
            self._window = [0, 0.0, 0.0]
            self._compute = [0.0, 0]
        return None

    def on_end(self, trainer, stop: Optional[Stop]) -> None:
        self.close()

    # ------------------------------------------------------------------
    def _open_sinks(self) -> None:
        if self.rank0 and self.sinks is None:
            tr = self.cfg.training
            if tr.tensorboard_dir or tr.wandb_project:
                self.sinks = MetricSinks(self.cfg)

    def observe(self, res, consumed_samples: int) -> None:
        """Count one finished iteration (once, whoever calls first) and write its sink scalars."""
        if res.step <= self._last_seen:
            return
        self._last_seen = res.step
        self.skipped += int(bool(res.skipped))
        self.nan += int(not math.isfinite(res.loss))
        if self.rank0 and res.step % self.cfg.training.tensorboard_log_interval == 0:
            self._open_sinks()
            if self.sinks is not None:
                self.sinks.write(step_scalars(res, self.global_batch_size, self.world_size), res.step, consumed_samples)

    def _eta(self, step: int, ms_per_iteration: float) -> Optional[float]:
        remaining = self.cfg.training.train_iters - step
        if self._start is not None and step > self._start[1]:
            per_iter = (time.monotonic() - self._start[0]) / (step - self._start[1])
        else:
            per_iter = ms_per_iteration / 1000.0
        return remaining * per_iter if math.isfinite(per_iter) else None

    def log_step(
        self,
        res,
        *,
        tokens_per_s: float,
        tflops_per_device: float,
        mfu: Optional[float],
        eval_loss: Optional[float],
        eval_by_budget: Optional[dict],
        consumed_samples: int,
        bias_spread: Optional[float] = None,
        stragglers: Optional[dict] = None,
    ) -> Optional[dict]:
        """One console line (rank 0): ``metrics.jsonl`` record, printed line, sink scalars. ``stragglers``:
        the fastest and slowest data-parallel rank's compute ms/iter (``Trainer._stragglers``)."""
        self.observe(res, consumed_samples)
        skipped, nan = self.skipped, self.nan
        self.skipped = self.nan = 0
        if not self.rank0:
            return None
        ms = 1000.0 * res.tokens / tokens_per_s if tokens_per_s > 0 else float("nan")
        memory, kind = peak_memory()
        record = {
            "step": res.step,
            "loss": res.loss,
            "lr": res.lr,
            "grad_norm": res.grad_norm,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops_per_device,
            "mfu": mfu,
            "depth": res.depth,
            "aux_loss": res.aux_loss,
            "block_utilisation": res.utilisation,
            "skipped": res.skipped,
            "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * self.cfg.training.seq_length,
            "ms_per_iteration": ms,
            "skipped_iterations": skipped,
            "nan_iterations": nan,
            "peak_memory_bytes": memory,
            "peak_memory_kind": kind,
            "eta_s": self._eta(res.step, ms),
        }
        if res.utilisation:
            record["routing_entropy"] = routing_entropy(res.utilisation)
        if bias_spread is not None:
            record["bias_spread"] = bias_spread
        if stragglers is not None:
            record.update(
                min_ms_per_iteration=stragglers["min_ms"],
                min_ms_rank=stragglers["min_rank"],
                max_ms_per_iteration=stragglers["max_ms"],
                max_ms_rank=stragglers["max_rank"],
            )
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
            if eval_by_budget:
                record["eval_loss_by_budget"] = {str(k): v for k, v in eval_by_budget.items()}
                record["eval_loss_endpoints"] = endpoint_mean(eval_by_budget)
        if res.budgets:
            record["budgets"] = res.budgets
        if res.moe_routing:
            record["moe_routing"] = res.moe_routing
        self._append(record)
        print(format_line(record, self.cfg.training.train_iters), flush=True)
        self._open_sinks()
        if self.sinks is not None:
            self.sinks.write(log_scalars(record), res.step, consumed_samples)
            self.sinks.flush()
        return record

    def log_eval(
        self,
        eval_loss: float,
        depth: int,
        eval_by_budget: Optional[dict] = None,
        step: int = 0,
        consumed_samples: int = 0,
    ) -> None:
        """An evaluation outside a training line: the initial model's (``training.eval_at_start``)."""
        if not self.rank0:
            return
        print(
            f" iteration {step:6d}/{self.cfg.training.train_iters} | eval loss {eval_loss:.4f} (initial model)",
            flush=True,
        )
        record = {"step": step, "eval_loss": eval_loss, "depth": depth, "consumed_samples": consumed_samples}
        if eval_by_budget:
            record["eval_loss_by_budget"] = {str(k): v for k, v in eval_by_budget.items()}
            record["eval_loss_endpoints"] = endpoint_mean(eval_by_budget)
        self._append(record)
        self._open_sinks()
        if self.sinks is not None:
            self.sinks.write(validation_scalars(eval_loss, eval_by_budget), step, consumed_samples)
            self.sinks.flush()

    def _append(self, record: dict) -> None:
        if self.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
