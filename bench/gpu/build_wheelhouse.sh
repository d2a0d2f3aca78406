#!/usr/bin/env bash
# Build bench/gpu/wheelhouse/: the Python packages run_all.sh needs on a GPU machine without internet
# (Python 3.12, CUDA torch and transformers installed; no megatron-core, no Transformer Engine). Run it
# here, on a machine with PyPI access; the folder (git-ignored) then travels with the working tree and
# must stay under 64 MiB (it is ~6 MiB). Transformer Engine is not in it: its core wheel alone is 264 MiB
# and its torch extension is published as source only (the TE parts of run_all.sh run where TE is installed).
#
#   bash bench/gpu/build_wheelhouse.sh            # PYTHON_VERSION=3.12 by default
set -euo pipefail
cd "$(dirname "$0")"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
rm -rf wheelhouse
# megatron-core's declared dependencies (torch, numpy, packaging>=24.2) are on the GPU machine except maybe a
# new enough packaging; megatron-lol adds sentencepiece and psutil (megatron-core needs it, undeclared); the
# tests pytest (+ pluggy, iniconfig, pygments) and pytest-timeout; the NVML monitor nvidia-ml-py.
python -m pip download --python-version "$PYTHON_VERSION" --only-binary=:all: --no-deps -d wheelhouse \
  megatron-core==0.16.1 sentencepiece==0.2.1 psutil==7.2.2 "packaging==26.4" \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 nvidia-ml-py==13.615.71
size=$(du -sb wheelhouse | cut -f1)
echo "wheelhouse: $(ls wheelhouse | wc -l) wheels, $((size / 1024)) KiB"
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
  echo "wheelhouse is over 64 MiB: it cannot travel with the working tree" >&2
  exit 1
fi
