"""FP32 accumulation of a library block's weight gradients in BF16 training, against float64 (docs/gpu.md,
"FP32 gradient accumulation"). Shared by tests/test_gpu_first_run.py (CPU, in its process) and
tests/gpu_steps.py (the GPU test of tests/test_gpu.py).

A BF16 LoL model whose every window runs block 0 at each of 16 depths, under megatron-core's DDP (FP32 main
grads), one forward and backward, built twice: with fused accumulation (what the trainer builds: each call's
fc1 weight gradient goes into ``main_grad`` in FP32) and without (autograd sums the 16 calls in BF16 first).
Each call's (input, grad_output) of block 0's fc1 is recorded, so the exact sum of the calls' gradients is
known in float64.
"""

from __future__ import annotations

import contextlib

import torch

VOCAB, EOD, DEPTHS = 97, 0, 16


@contextlib.contextmanager
def _patched(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def library_grads(fusion: bool, record: list, device=None, grouped: bool = False):
    """``(fc1 main_grad, input-norm main_grad)`` of block 0 after one backward; ``record`` gets each call's
    (input, grad_output) of block 0's fc1 (fused runs only). ``grouped``: the routed depths run as the
    grouped core (a host layout with the batch), whose fc1 inputs and output gradients of every depth are
    recorded (every row is block 0's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import layers

    from megatron_lol.config import config_from_dict
    from megatron_lol.model import grouped_blocks
    from megatron_lol.model.core import ForcedPath
    from megatron_lol.model.host_layout import build_host_layout
    from megatron_lol.model.lol_model import LoLGPTModel

    device = device or torch.device("cpu")
    cfg = config_from_dict(
        {
            "model": dict(
                hidden_size=32,
                num_attention_heads=4,
                num_blocks=2,
                routed_depth=DEPTHS,
                window_size=8,
                window_shift=4,
                n_prelude=1,
                n_coda=1,
                params_dtype="bf16",
                use_transformer_engine=False,
            ),
            "parallel": {"routed_core": "grouped" if grouped else "reference"},  # the executor the core is built with
        }
    )
    net = (
        LoLGPTModel(cfg.model, VOCAB, EOD, parallel=cfg.parallel, init_seed=5, gradient_accumulation_fusion=fusion)
        .to(device)
        .train()
    )
    ddp = DistributedDataParallel(
        config=net.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=net
    )
    weight = net.core.block(0).mlp.linear_fc1.weight
    real = layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32

    def recording(total_input, grad_output, main_grad):
        if main_grad is weight.main_grad:
            record.append((total_input.clone(), grad_output.clone()))
        return real(total_input, grad_output, main_grad)

    real_grouped = grouped_blocks._grouped_linear

    def recording_grouped(x, weights, offsets):
        out = real_grouped(x, weights, offsets)
        if weights.shape[1] == weight.shape[0] and weights.shape[2] == weight.shape[1]:  # fc1
            call = [x.detach().clone()]
            record.append(call)
            out.register_hook(lambda grad: call.append(grad.detach().clone()))
        return out

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (2, 32), generator=g).to(device)
    forced = ForcedPath(torch.zeros(DEPTHS, 8, dtype=torch.long), torch.full((DEPTHS, 8), 0.5))
    seeds = torch.tensor([1, 2])
    extra = {}
    if grouped:
        layout = build_host_layout(tokens.cpu(), EOD, 8, 4, range(1, DEPTHS + 1), 2, seeds)
        extra = {"layout": layout.to(device)}
    ddp.zero_grad_buffer()
    with (
        _patched(layers.fused_weight_gradient_mlp_cuda, "wgrad_gemm_accum_fp32", recording),
        _patched(grouped_blocks, "_grouped_linear", recording_grouped),
    ):
        loss = ddp(tokens, labels=tokens, forced_path=forced, noise_seeds=seeds.to(device), **extra)
        (loss.float().sum() * 0.01).backward()
    return weight.main_grad.clone(), net.core.block(0).input_layernorm.weight.main_grad.clone()


def errors(device=None) -> dict:
    """Relative errors against the float64 sum of the 16 calls' fc1 gradients: ``fused`` (the trainer's
    path), ``fp32_sum`` (FP32 sums of the calls' BF16-rounded gradients), ``bf16_sum`` (autograd's BF16 sum);
    and the norm weight's main grads of both builds."""
    calls: list = []
    fused_fc1, fused_norm = library_grads(True, calls, device)
    unfused_fc1, unfused_norm = library_grads(False, [], device)
    exact = sum(go.double().t() @ x.double() for x, go in calls)
    fp32_of_bf16 = sum((go.t() @ x).to(torch.bfloat16).float() for x, go in calls)  # each call rounded once

    def error(grad):
        return float((grad.double() - exact).norm() / exact.norm())

    return {
        "calls": len(calls),
        "fused": error(fused_fc1),
        "fp32_sum": error(fp32_of_bf16),
        "bf16_sum": error(unfused_fc1),
        "fused_norm": fused_norm.cpu(),
        "unfused_norm": unfused_norm.cpu(),
    }


def grouped_errors(device=None) -> dict:
    """The grouped core's fc1 weight gradient against the float64 sum of its 16 depths' gradients, with
    fused accumulation (each depth's gradient into ``main_grad`` in FP32) and without (autograd's BF16
    sum over the depths); ``fp32_sum``: FP32 sums of the depths' BF16-rounded gradients."""
    fused_calls: list = []
    fused_fc1, _ = library_grads(True, fused_calls, device, grouped=True)
    unfused_calls: list = []
    unfused_fc1, _ = library_grads(False, unfused_calls, device, grouped=True)
    out = {"calls": len(fused_calls)}
    for name, grad, calls in (("fused", fused_fc1, fused_calls), ("bf16_sum", unfused_fc1, unfused_calls)):
        exact = sum(go.double().t() @ x.double() for x, go in calls)
        out[name] = float((grad.double() - exact).norm() / exact.norm())
        if name == "fused":
            fp32_of_bf16 = sum((go.t() @ x).to(torch.bfloat16).float() for x, go in calls)
            out["fp32_sum"] = float((fp32_of_bf16.double() - exact).norm() / exact.norm())
    return out
