#!/usr/bin/env bash
# Prepared GPU check (NOT YET RUN: no GPU machine has been lent to this work so far).
#
# `megatron-lol profile` of a ~350M-effective LoL model (examples/configs/paper/lol-360m-L4.yaml:
# width 1024, 4 prelude + 4 coda layers, L=4 blocks over D=16 routed depths, W=128, S=64,
# context 1024) and of a dense GPT of equal executed compute (the same width and the same
# 24 executed layers, full causal attention: plan dense, num_blocks 16), each in BF16 and
# in FP8 (Transformer Engine, hybrid delayed scaling). Synthetic tokens (throughput does
# not depend on the text); 3 warm-up + 10 timed steps at micro-batch 8 on one GPU.
#
#   bash bench/gpu/profile_lol_vs_dense.sh            # results under runs/gpu_profile/
#   STEPS=20 MBS=4 bash bench/gpu/profile_lol_vs_dense.sh
#
# Needs CUDA torch, transformer-engine, nvidia-ml-py, megatron-core==0.16.1. Expect
# ~1.5 minutes per run on an H100/H200 (mostly start-up); four runs in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
OUT="${OUT:-runs/gpu_profile}"
STEPS="${STEPS:-10}"
MBS="${MBS:-8}"
CONFIG=examples/configs/paper/lol-360m-L4.yaml
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true

common=(--config "$CONFIG" --synthetic-data --steps "$STEPS" --warmup 3
        --set "training.micro_batch_size=$MBS" --set "training.global_batch_size=$MBS"
        --set curriculum.initial_depth=null --set model.params_dtype=bf16)
dense=(--set model.plan=dense --set model.num_blocks=16 --set model.dense_attention=full
       --set model.film=off)
fp8=(--set model.fp8=hybrid --set model.fp8_recipe=delayed --precision fp8)

run() {  # name, extra args...
  local name=$1; shift
  echo "=== $name"
  timeout 300 python -m megatron_lol profile "${common[@]}" "$@" --json "$OUT/$name.json" \
    2>&1 | tee "$OUT/$name.log" | grep -v -i warn || echo "($name failed: see $OUT/$name.log)"
}

run lol_bf16
run dense_bf16 "${dense[@]}"
run lol_fp8 "${fp8[@]}"
run dense_fp8 "${dense[@]}" "${fp8[@]}"

python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = {}
for name in ("lol_bf16", "dense_bf16", "lol_fp8", "dense_fp8"):
    p = os.path.join(out, name + ".json")
    if os.path.exists(p):
        rows[name] = json.load(open(p))
print(f"{'run':12s} {'step ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'mem GiB':>8s}")
for name, r in rows.items():
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    print(f"{name:12s} {r['step_time_s']['median'] * 1e3:9.1f} {r['tokens_per_s_per_device']:10,.0f} "
          f"{r['tflops_per_device']:8.1f} {mfu:>6s} {r['peak_memory']['bytes'] / 2**30:8.1f}")
for p in ("bf16", "fp8"):
    a, b = rows.get(f"lol_{p}"), rows.get(f"dense_{p}")
    if a and b:
        print(f"{p}: LoL / dense step time {a['step_time_s']['median'] / b['step_time_s']['median']:.3f} "
              f"(FLOP model predicts {a['flops_per_step'] / b['flops_per_step']:.3f})")
PY
