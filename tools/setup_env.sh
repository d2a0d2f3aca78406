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
pip install -q -e ".[data,hf,analysis,console,eval,test]"
# megatron-core's Muon (--optimizer muon) runs on emerging-optimizers 0.3.0, the one release on PyPI.
# Its metadata asks for Python >= 3.12, where pyproject.toml installs it; older Pythons get the same
# wheel, pinned by its sha256, without that check (megatron_lol/training/muon_compat.py: why and how).
if python -c 'import sys; sys.exit(0 if sys.version_info < (3, 12) else 1)'; then
  pip install -q --no-deps --ignore-requires-python --require-hashes -r tools/requirements-muon.txt
fi
python -c "import megatron.core, megatron_lol; print('megatron-core', megatron.core.__version__)" 2>/dev/null
