#!/usr/bin/env bash
# Line coverage of megatron_lol/ over the whole test suite, launched processes included
# (pyproject.toml [tool.coverage.run]); prints the per-file table and the total.
#   bash tools/coverage.sh              # the suite exactly as tools/run_tests.sh runs it
#   bash tools/coverage.sh -k routed    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
status=0
PYTEST_RUNNER="coverage run -m" bash tools/run_tests.sh "$@" || status=$?
. .venv/bin/activate
python -m coverage combine -q
python -m coverage report --skip-empty | tail -n 40
echo "coverage total: $(python -m coverage report --format=total)%"
exit "$status"
