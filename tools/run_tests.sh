#!/usr/bin/env bash
# The test command of README.md: set up .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider --durations=30 "$@" tests
