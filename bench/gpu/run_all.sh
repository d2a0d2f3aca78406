#!/usr/bin/env bash
# The one-shot GPU proof (docs/gpu.md). Within 8 minutes on one GPU it
#   1. runs the `gpu` tests (tests/test_gpu.py: each plan on the GPU against the CPU in FP32; with
#      Transformer Engine also local vs TE spec in BF16 and FP8 vs BF16 after 50 steps; with 2 GPUs
#      TP/EP/DP against one GPU),
#   2. measures tokens/s per GPU and MFU of a ~350M LoL model (examples/configs/paper/lol-360m-L4.yaml)
#      and of a dense GPT of equal executed FLOPs, at sequence length 2048, in BF16 (and FP8 with TE),
#   3. writes one JSON report, $OUT/gpu_report.json, saying which parts ran and what they measured.
#
#   bash bench/gpu/run_all.sh              # on the GPU machine (OUT defaults to runs/gpu_proof)
#   bash bench/gpu/run_all.sh --dry-run    # anywhere: the same steps with a tiny model, one step each
#
# Without megatron-core (the lent GPU machine has torch, transformers and no internet), the packages come
# from bench/gpu/wheelhouse/ (built beforehand by bench/gpu/build_wheelhouse.sh) into a virtualenv that
# sees the system's torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
export OUT="${OUT:-runs/gpu_proof}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import megatron.core, sentencepiece, psutil, pytest, pytest_timeout" 2>/dev/null; then
  WHEELS=bench/gpu/wheelhouse
  if [ ! -d "$WHEELS" ]; then
    echo "run_all.sh: megatron-core (or a test package) is missing and $WHEELS does not exist:" \
         "build it with bench/gpu/build_wheelhouse.sh where PyPI is reachable" >&2
    exit 2
  fi
  VENV="${TMPDIR:-/tmp}/megatron-lol-gpu-venv"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" megatron-core==0.16.1 sentencepiece \
    psutil pytest pytest-timeout nvidia-ml-py
  PYTHON="$VENV/bin/python"
fi
exec timeout "${TIME_LIMIT:-480}" "$PYTHON" bench/gpu/run_all.py --out "$OUT" "$@"
