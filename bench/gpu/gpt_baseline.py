"""The dense baseline of the GPU proof: megatron-core's ``GPTModel`` with megatron-lol's layer spec.

    python bench/gpu/gpt_baseline.py --config YAML '--set model.plan={kind: dense, layers: N}' ... \
        [--steps 10] [--warmup 3] [--precision fp8] --json OUT

The config (with its ``--set`` overrides) must describe a dense plan: its width, heads, FFN, prelude, core
and coda layer counts, vocabulary, precision and batch shape are the baseline's. The model is
megatron-core's own ``GPTModel`` (its ``TransformerBlock``, embedding, RoPE, final norm and LM head) built
from ``library.block_spec``, the spec every LoL layer uses (local: megatron-core's local layer with
megatron-lol's attention, fused on GPUs; Transformer Engine where it imports), trained by megatron-core's
DDP, optimizer (the config's: AdamW or Muon) and schedule, on synthetic tokens. Step times are CUDA events
around whole steps (``perf.timing.StepTimer``), then the host synchronisations of a step counted in untimed
steps after them (``perf.host_syncs``, as ``megatron-lol profile`` does); FLOPs are the FLOP model's for the dense plan
(``perf.flops``), so run_all.py can match them to a LoL run's executed FLOPs. Writes a JSON report with the
fields run_all.py reads from ``megatron-lol profile``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _config(path: str, sets: list, precision):
    import yaml

    from megatron_lol.config import load_config

    overrides = [(k, yaml.safe_load(v), "--set") for k, v in (s.split("=", 1) for s in sets)]
    if precision == "fp8" and not any(k == "model.precision.fp8" for k, _, _ in overrides):
        overrides.append(("model.precision.fp8", "hybrid", "--precision fp8"))
    cfg = load_config(path, overrides, check_data=False)
    if cfg.model.plan.kind != "dense":
        raise SystemExit(f"gpt_baseline.py: the config must describe a dense plan (got plan {cfg.model.plan.kind})")
    return cfg


def build(cfg, vocab: int):
    """``(DDP-wrapped GPTModel, its TransformerConfig, whether the spec is Transformer Engine's)``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from megatron_lol.model.library import block_spec, transformer_config, use_te_for
    from megatron_lol.platform import device

    m = cfg.model
    use_te = use_te_for(m)
    layers = m.n_prelude + m.execution_plan().num_stored_blocks + m.n_coda
    tconfig = transformer_config(m, cfg.parallel, num_layers=layers, use_te=use_te, gradient_accumulation_fusion=True)
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=block_spec(use_te),
        vocab_size=vocab,
        max_sequence_length=cfg.training.seq_length,
        position_embedding_type="rope",
        rotary_base=int(m.rotary_base),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
    )
    model.to(device())
    ddp = DistributedDataParallel(
        config=tconfig, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    tconfig.finalize_model_grads_func = finalize_model_grads
    return ddp, tconfig, use_te


def run(args) -> dict:
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lol.model.lol_model import padded_vocab_size
    from megatron_lol.model.precision import enable_tf32
    from megatron_lol.perf import flops as fl
    from megatron_lol.perf.host_syncs import count_step_syncs
    from megatron_lol.perf.peaks import mfu, peak_tflops
    from megatron_lol.perf.timing import StepTimer
    from megatron_lol.platform import device, init_distributed, setup_platform, to_device
    from megatron_lol.training.optimizer import build_optimizer, build_scheduler
    from megatron_lol.training.profile import SyntheticDataset, _device_info, _peak_memory_bytes, _precision
    from megatron_lol.training.trainer import stack_batch

    cfg = _config(args.config, args.overrides, args.precision)
    setup_platform()
    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)
    torch.manual_seed(cfg.training.seed)
    enable_tf32(device(), cfg.model.precision.params_dtype)
    tr = cfg.training
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)
    # a step-time benchmark: the schedule only has to cover the timed steps (a FLOP budget is not derived here)
    cfg.training.train_iters, cfg.training.train_flops = max(tr.train_iters or 0, args.warmup + args.steps), None
    model, tconfig, use_te = build(cfg, vocab)
    optimizer = build_optimizer(cfg, [model])
    scheduler = build_scheduler(cfg, optimizer)
    data = SyntheticDataset(tr.seq_length, vocab, 0, seed=tr.seed)
    gbs = tr.global_batch_size or tr.micro_batch_size
    micro = gbs // tr.micro_batch_size
    pin = device().type == "cuda"
    position_ids = torch.arange(tr.seq_length, device=device()).unsqueeze(0).expand(tr.micro_batch_size, -1)

    def batches():
        sample = 0
        while True:
            items = [data[sample + j] for j in range(tr.micro_batch_size)]
            sample += tr.micro_batch_size
            yield to_device({k: stack_batch([it[k] for it in items], pin) for k in ("tokens", "labels", "loss_mask")})

    def forward_step(iterator, net):
        batch = next(iterator)
        output = net(batch["tokens"], position_ids, None, labels=batch["labels"])

        def loss_func(out):
            losses = out.float().view(-1)
            mask = batch["loss_mask"].view(-1)
            total = torch.sum(losses * mask)
            return total, mask.sum().to(torch.int), {"lm loss": torch.stack([total.detach(), mask.sum()])}

        return output, loss_func

    fb = get_forward_backward_func()
    iterator = batches()
    losses = []

    def step(data_iterator=iterator):
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = fb(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=[model],
            num_microbatches=micro,
            seq_length=tr.seq_length,
            micro_batch_size=tr.micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
        scheduler.step(increment=1)
        total = sum(o["lm loss"] for o in out)
        return total

    for _ in range(args.warmup):
        step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timer = StepTimer(cuda)
    for _ in range(args.steps):
        timer.start()
        losses.append(step())
        timer.stop()
    times = timer.seconds()
    losses = [float(x[0] / x[1]) for x in losses]
    # the host reads of a step, counted in untimed steps after the timed ones (megatron_lol/perf/host_syncs.py)
    host_syncs = count_step_syncs(step, iterator, args.count_steps, device(), optimizer) if args.count_steps else None
    median = statistics.median(times)
    tokens = gbs * tr.seq_length
    model_flops = fl.training_flops_per_step(cfg, None, gbs, tr.seq_length, vocab_size=vocab)
    exec_flops = fl.training_flops(cfg.model, vocab, tr.seq_length, gbs, attention_pairs="executed").total
    dev = _device_info()
    prec = _precision(cfg, args.precision)
    peak = peak_tflops(dev["name"] if dev["kind"] == "cuda" else None, prec)
    tflops = model_flops / median / 1e12
    return {
        "model": "megatron.core.models.gpt.GPTModel",
        "spec": "transformer_engine" if use_te else "local",
        "num_layers": tconfig.num_layers,
        "device": dev,
        "precision": prec,
        "timing": {"steps": timer.method, "section_timers": False},
        "step_time_s": {"median": median, "mean": sum(times) / len(times), "all": times},
        "tokens_per_step": tokens,
        "tokens_per_s_per_device": tokens / median,
        "flops_per_step": model_flops,
        "flops_per_step_executed": exec_flops,
        "tflops_per_device": tflops,
        "tflops_per_device_executed": exec_flops / median / 1e12,
        "peak_tflops": peak,
        "mfu": mfu(tflops, peak),
        "peak_memory": _peak_memory_bytes(),
        "host_syncs": host_syncs,
        "loss": losses,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", default=None, choices=("bf16", "fp8", "tf32"))
    ap.add_argument("--count-steps", type=int, default=2, help="untimed steps whose host syncs are counted")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", required=True)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(
        f"GPTModel baseline: {report['num_layers']} layers, {report['tokens_per_s_per_device']:,.0f} tokens/s, "
        f"{report['tflops_per_device']:.4g} TFLOP/s, step {report['step_time_s']['median'] * 1e3:.1f} ms "
        f"({report['timing']['steps']})"
        + (f", {report['host_syncs']['per_step']:g} host syncs per step" if report["host_syncs"] else "")
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.exit(main())
