#!/usr/bin/env bash
# The test command of README.md: set up .venv, then run the whole test suite on one pytest-xdist
# worker per core (tests/suite_support.py: CPU slots, longest files first, launches per file).
#   bash tools/run_tests.sh                      # everything
#   bash tools/run_tests.sh -k routed            # extra arguments go to pytest
#   bash tools/run_tests.sh --update-durations   # also rewrite tests/durations.json from this run
#   TEST_WORKERS=1 bash tools/run_tests.sh       # one worker (no xdist)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
args=()
for a in "$@"; do
  if [ "$a" = "--update-durations" ]; then
    export MEGATRON_LOL_UPDATE_DURATIONS=1
  else
    args+=("$a")
  fi
done
workers=${TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
else
  parallel=(-p no:xdist)
fi
# PYTEST_RUNNER: what runs pytest (tools/coverage.sh sets "coverage run"; default plain python)
# shellcheck disable=SC2086
python -m ${PYTEST_RUNNER:-} pytest -q -p no:cacheprovider --durations=30 "${parallel[@]}" "${args[@]}" tests
