#!/usr/bin/env bash
# Line coverage of megatron_lol/ over the whole test suite, launched processes included
# (pyproject.toml [tool.coverage.run]); prints the per-file table and the total.
#   bash tools/coverage.sh              # the suite as tools/run_tests.sh runs it
#   bash tools/coverage.sh -k routed    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
rm -f .coverage .coverage.*
workers=${TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
else
  parallel=(-p no:xdist)
fi
status=0
python -m coverage run -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@" tests || status=$?
python -m coverage combine -q
python -m coverage report --skip-empty | tail -n 40
echo "coverage total: $(python -m coverage report --format=total)%"
exit "$status"
