#!/usr/bin/env bash
# The one-shot GPU proof (docs/gpu.md). Within 8 minutes on one GPU, the wheelhouse install included, it
#   1. runs the `gpu` tests (tests/test_gpu.py: each plan on the GPU against the CPU in FP32; with
#      Transformer Engine also local vs TE spec in BF16 and FP8 vs BF16 after 50 steps; with 2 GPUs
#      TP/EP/DP against one GPU),
#   2. measures tokens/s per GPU and MFU of a ~350M LoL model (examples/configs/paper/lol-360m-L4.yaml)
#      and of megatron-core's GPTModel with the same layer spec at equal executed FLOPs, at sequence length
#      2048, in BF16 (and FP8 with TE), whole steps timed with CUDA events; then the LoL run's section
#      breakdown as a separate, labelled run,
#   3. writes one JSON report, $OUT/gpu_report.json, after every part: which parts ran, what they measured,
#      which timed out.
#
#   bash bench/gpu/run_all.sh              # on the GPU machine (OUT defaults to runs/gpu_proof)
#   bash bench/gpu/run_all.sh --dry-run    # anywhere: the same steps with a tiny model, one step each
#   bash bench/gpu/run_all.sh --dry-run --part-timeout lol_bf16_breakdown=2   # ... and see that part killed
#
# The time limit and every part's budget are run_all.py's (BUDGET_S): `run_all.py --print-budget` checks that
# they add up and prints the limit and the install's budget, which this script's `timeout`s use.
#
# Without megatron-core (the lent GPU machine has torch, transformers and no internet), the packages of
# bench/gpu/wheelhouse.txt come from bench/gpu/wheelhouse/ (built beforehand by bench/gpu/build_wheelhouse.sh;
# git-ignored, so it must be sent with the tree: docs/gpu.md), installed by bench/gpu/install_wheelhouse.py into
# a virtualenv that sees the system's torch (checked: torch imports there), or otherwise into a directory put
# on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
export OUT="${OUT:-runs/gpu_proof}"
PYTHON="${PYTHON:-python3}"
budget=$("$PYTHON" bench/gpu/run_all.py --print-budget "$@")  # exits 2 with one line if they do not fit
read -r LIMIT INSTALL_S <<<"$budget"
if ! [[ "$LIMIT" =~ ^[0-9]+$ ]]; then echo "$budget"; exit 0; fi  # --help
if ! "$PYTHON" -c "import megatron.core, sentencepiece, psutil, pytest, pytest_timeout, emerging_optimizers, absl" \
    2>/dev/null; then
  WHEELS=bench/gpu/wheelhouse
  if [ ! -d "$WHEELS" ]; then
    echo "run_all.sh: megatron-core (or a package it needs) is missing and $WHEELS does not exist:" \
         "build it with bench/gpu/build_wheelhouse.sh where PyPI is reachable and send it with the tree" >&2
    exit 2
  fi
  if ! installed=$(timeout "$INSTALL_S" "$PYTHON" bench/gpu/install_wheelhouse.py --wheels "$WHEELS" \
      --requirements bench/gpu/wheelhouse.txt --target "${TMPDIR:-/tmp}/megatron-lol-gpu-env"); then
    echo "run_all.sh: installing $WHEELS failed or took over its budget of $INSTALL_S s" >&2
    exit 2
  fi
  setting=$(tail -n 1 <<<"$installed")
  case "$setting" in
    PYTHON=*) PYTHON="${setting#PYTHON=}" ;;
    PYTHONPATH=*) export PYTHONPATH="${setting#PYTHONPATH=}:$PYTHONPATH" ;;
    *) echo "run_all.sh: install_wheelhouse.py printed '$setting'" >&2; exit 2 ;;
  esac
fi
# what is left of the limit; run_all.py ends its parts before it, the kill after it is the backstop
spent=$SECONDS
exec timeout --kill-after=10 "$((LIMIT - spent))" "$PYTHON" bench/gpu/run_all.py --out "$OUT" \
  --time-limit "$LIMIT" --started-after "$spent" "$@"
