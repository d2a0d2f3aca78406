#!/usr/bin/env bash
# README set-up command (a): install, fetch the bundled corpus, train the tiny LoL model on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
megatron-lol prepare-quickstart --output-dir data/quickstart
megatron-lol train --config examples/configs/tiny-cpu.yaml "$@"
