#!/usr/bin/env bash
# Build bench/gpu/wheelhouse/: the Python packages run_all.sh needs on a GPU machine without internet
# (Python 3.12, CUDA torch and transformers installed; no megatron-core, no Transformer Engine). Run it
# here, on a machine with PyPI access. The folder is git-ignored: a copy of the tracked tree (git clone,
# git archive, a runner that copies tracked files) arrives without it, so it must be sent along by name
# (docs/gpu.md, "The one-shot proof"); it must stay under 64 MiB (docs/performance.md has its size).
# Transformer Engine is not in it: its core wheel alone is 264 MiB and its torch extension is published
# as source only (the TE parts of run_all.sh run where TE is installed).
#
#   bash bench/gpu/build_wheelhouse.sh            # PYTHON_VERSION=3.12 by default
set -euo pipefail
cd "$(dirname "$0")"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
rm -rf wheelhouse
# the list (and why each is there): bench/gpu/wheelhouse.txt; wheels only, no dependency resolution, so the
# list names every package the GPU machine lacks (tests/test_gpu_first_run.py checks it)
python -m pip download --python-version "$PYTHON_VERSION" --only-binary=:all: --no-deps -d wheelhouse \
  -r wheelhouse.txt
size=$(du -sb wheelhouse | cut -f1)
echo "wheelhouse: $(ls wheelhouse | wc -l) wheels, $((size / 1024)) KiB"
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
  echo "wheelhouse is over 64 MiB: it cannot travel with the working tree" >&2
  exit 1
fi
