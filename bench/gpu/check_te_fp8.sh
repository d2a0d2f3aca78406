#!/usr/bin/env bash
# One prepared GPU check (< 8 minutes on one H200): short BF16 and FP8 training of a
# ~350M LoL model with Transformer Engine; prints step time, loss and their ratios.
# Needs: CUDA torch, transformer-engine, megatron-core==0.16.1 and this repo importable.
# Not yet run: no GPU machine has been lent to this project so far.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
timeout 450 python bench/gpu/te_fp8_compare.py --steps "${STEPS:-20}" --warmup 5 --fp8 "${FP8:-hybrid}" \
  --recipe "${RECIPE:-delayed}"
