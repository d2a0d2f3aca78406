#!/usr/bin/env bash
# Create .venv (if missing) and install megatron-lol with everything its tests need.
# torch is pinned to the CPU build that pip finds locally on our dev/CI machines;
# on GPU clusters install your site's CUDA torch (and Transformer Engine) first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
pip install -q -e ".[data,hf,analysis,eval,test]"
python -c "import megatron.core, megatron_lol; print('megatron-core', megatron.core.__version__)" 2>/dev/null
