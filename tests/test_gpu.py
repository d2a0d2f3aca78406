"""Tests that need a GPU (marked ``gpu``: skipped without CUDA; bench/gpu/run_all.sh runs them).

Each compares runs made in separate processes with tests/gpu_steps.py (a few trainer steps on
synthetic tokens):

* every plan on one GPU against the same steps on the CPU, in FP32 (TF32 off): the first step's loss
  within 1e-5 relative (the same weights and batch; only the order of sums differs), later steps within
  1e-3 (routing decisions near a tie may flip once weights differ in the last bits);
* the local spec against the Transformer Engine spec in BF16, 3 steps within 2e-2 relative;
* FP8 (hybrid, current scaling: the routed plan's default) against BF16: the loss after 50 steps within 2%
  relative;
* TP=2 / EP=2 / DP=2 on two GPUs against one GPU, in FP32, within 1e-4 relative per step;
* two tensor-parallel ranks agree on every routing decision over 50 BF16 steps (the agreement check runs at
  every routed depth of every step; a disagreement would stop the run);
* a library block's FP32 main gradients in BF16 training (fused accumulation on the GPU) against the float64
  sum of its calls' gradients, closer than autograd's BF16 sum;
* precision defaults on the GPU: ``params_dtype: auto`` is BF16, FP32 runs get TF32, batches are pinned;
* the attention kernels (compiled FlexAttention, SDPA ``is_causal``) for every mask kind against the masked
  softmax, in process.

TE tests need Transformer Engine; the two-GPU test needs two GPUs. CUDA alone runs the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
STEPS = str(REPO / "tests" / "gpu_steps.py")

PLANS = {
    "dense": dict(plan="dense", core_layers=2),
    "dense-sliding": dict(plan="dense", core_layers=2, dense_attention="sliding"),
    "looped": dict(plan="looped", loop_layers=2, loop_count=2, film="depth"),
    "lol": dict(plan="lol", num_blocks=3, routed_depth=4, film="depth"),
    "lol-grown-truncated": dict(plan="lol", num_blocks=3, routed_depth=4),
    "foil": dict(
        plan="foil",
        foil_layers=2,
        foil_loops=2,
        num_experts=4,
        foil_experts=8,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        moe_layers="all",
        untie_attention=True,
    ),
    "accordion": dict(
        plan="accordion",
        loop_window=3,
        num_experts=4,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        moe_layers="all",
        moe_shared_expert_intermediate_size=64,
        loop_budgets=[0, 1, 3],
    ),
}
CURRICULUM = {"lol-grown-truncated": {"initial_depth": 2, "growth_fraction": 1.0, "backprop_depth": 1}}


def _steps(runs: dict, cpu: bool = False, nproc: int = 1, timeout: int = 400) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, STEPS, json.dumps(runs)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            STEPS,
            json.dumps(runs),
        ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("GPU_STEPS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("GPU_STEPS ") :])
    for name, r in out.items():
        assert "error" not in r, f"{name}: {r['error']}"
    return out


def _te_available() -> bool:
    from megatron_lol.platform import has_transformer_engine

    return has_transformer_engine()


@pytest.fixture(scope="module")
def plan_runs():
    # FP32 on the local spec (params_dtype auto would be BF16 on the GPU; TE refuses FP32)
    runs = {
        name: {
            "model": dict(model, params_dtype="fp32", use_transformer_engine=False),
            "curriculum": CURRICULUM.get(name, {}),
            "steps": 3,
        }
        for name, model in PLANS.items()
    }
    return _steps(runs, cpu=True), _steps(runs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(PLANS))
def test_one_gpu_equals_cpu_in_fp32(plan_runs, name):
    cpu, gpu = plan_runs[0][name], plan_runs[1][name]
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    assert gpu["losses"][0] == pytest.approx(cpu["losses"][0], rel=1e-5)
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-3)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine")
def test_local_and_te_specs_agree_in_bf16():
    runs = {}
    for name in ("lol", "dense-sliding", "foil"):
        for te in (False, True):
            runs[f"{name}-{'te' if te else 'local'}"] = {
                "model": dict(PLANS[name], params_dtype="bf16", use_transformer_engine=te),
                "steps": 3,
            }
    out = _steps(runs)
    for name in ("lol", "dense-sliding", "foil"):
        local, te = out[f"{name}-local"], out[f"{name}-te"]
        assert te["use_te"] and not local["use_te"]
        assert te["losses"] == pytest.approx(local["losses"], rel=2e-2), name


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine")
def test_te_spec_runs_the_library_grouped_and_follows_the_per_block_te_core():
    """``parallel.routed_core: auto`` under the TE spec: TE prelude and coda, the library grouped (local-spec weights on
    ``torch._grouped_mm``), against the same model with every block a TE layer run per block, BF16."""
    lol = dict(PLANS["lol"], params_dtype="bf16", use_transformer_engine=True)
    out = _steps(
        {
            "grouped": {"model": lol, "parallel": {"routed_core": "auto"}, "steps": 3},
            "per-block": {"model": lol, "parallel": {"routed_core": "reference"}, "steps": 3},
        }
    )
    assert out["grouped"]["use_te"] and out["grouped"]["grouped_core"]
    assert out["per-block"]["use_te"] and not out["per-block"]["grouped_core"]
    assert out["grouped"]["losses"] == pytest.approx(out["per-block"]["losses"], rel=2e-2)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine")
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs compute capability 8.9+",
)
def test_fp8_loss_after_50_steps_is_close_to_bf16():
    model = dict(
        plan="lol",
        num_blocks=4,
        routed_depth=4,
        hidden_size=256,
        ffn_hidden_size=704,
        window_size=32,
        window_shift=16,
        film="depth",
        params_dtype="bf16",
        use_transformer_engine=True,
    )
    common = {"steps": 50, "seq_length": 256, "micro_batch_size": 8, "global_batch_size": 8, "lr": 1e-3}
    out = _steps({"bf16": dict(common, model=model), "fp8": dict(common, model=dict(model, fp8="hybrid"))})
    assert out["fp8"]["fp8_recipe"] == "tensorwise"  # current scaling: the default of a routed plan
    bf16, fp8 = out["bf16"]["losses"], out["fp8"]["losses"]
    assert bf16[-1] < bf16[0] - 0.5  # both learn
    assert fp8[-1] == pytest.approx(bf16[-1], rel=0.02)


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_tp_ep_dp_equal_one_gpu():
    layouts = {
        "tp2": {"tensor_model_parallel_size": 2},
        "ep2": {"expert_model_parallel_size": 2},
        "dp2": {},
        "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    }
    model = dict(PLANS["lol"], num_blocks=4, params_dtype="fp32", use_transformer_engine=False)
    one = _steps({"ref": {"model": model, "steps": 3}})["ref"]
    two = _steps({name: {"model": model, "parallel": par, "steps": 3} for name, par in layouts.items()}, nproc=2)
    for name in layouts:
        assert two[name]["losses"] == pytest.approx(one["losses"], rel=1e-4), name


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_tensor_parallel_ranks_agree_on_every_routing_decision_over_50_steps():
    model = dict(PLANS["lol"], num_blocks=4, params_dtype="bf16")
    run = {
        "model": model,
        "parallel": {"tensor_model_parallel_size": 2},
        "steps": 50,
        "training": {"check_routing_agreement": 1},
    }
    out = _steps({"tp2": run}, nproc=2)["tp2"]
    assert out["routing_checks"] == 50 * 4  # every routed depth of every step, no disagreement
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.timeout(600)
def test_library_main_grads_in_bf16_accumulate_in_fp32_on_the_gpu():
    out = _steps({"grads": {"kind": "library_grads"}})["grads"]
    assert out["device"].startswith("cuda") and out["calls"] == 16
    assert out["fused"] <= out["fp32_sum"] and out["fused"] < out["bf16_sum"] / 10, out
    assert out["norm_diff"] < 3e-2


@pytest.mark.timeout(600)
def test_gpu_precision_defaults_tf32_and_pinned_batches():
    out = _steps(
        {
            "auto": {"model": dict(PLANS["dense"], use_transformer_engine=False), "steps": 1},
            "fp32": {"model": dict(PLANS["dense"], params_dtype="fp32", use_transformer_engine=False), "steps": 1},
        }
    )
    assert out["auto"]["params_dtype"] == "bf16" and not out["auto"]["tf32_enabled"]
    assert out["fp32"]["tf32_enabled"]
    assert out["auto"]["pinned_batches"] and out["fp32"]["pinned_batches"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernels_on_the_gpu_equal_the_masked_softmax(megatron_env, dtype):
    """Every mask kind of tests/attention_cases.py on CUDA, in process: compiled FlexAttention (and SDPA
    ``is_causal`` for plain causal attention) against the written-out masked softmax on the CPU in FP32,
    values and gradients (FP32: 1e-5 with TF32 off; BF16: 3e-2)."""
    from attention_cases import inputs, make_cases, reference, run_case

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name, (layout, shape, allowed) in make_cases().items():
            q, k, v, up = inputs(shape)
            ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = reference(*ref_in, allowed)
            ref_grads = torch.autograd.grad(ref, ref_in, up)
            gpu_in = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
            out = run_case(layout, *gpu_in)
            grads = torch.autograd.grad(out, gpu_in, up.to("cuda", dtype))
            torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol, msg=name)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g.float().cpu(), r, rtol=tol, atol=tol, msg=name)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
