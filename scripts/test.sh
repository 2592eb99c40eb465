#!/usr/bin/env bash
# The whole test suite, set-up included: lint, types, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ -x scripts/install-prometheus.sh ]; then ./scripts/install-prometheus.sh; fi
. .venv/bin/activate
echo "== ruff"; ruff check . && ruff format --check .
echo "== mypy"; mypy
echo "== import-linter"; lint-imports
echo "== pytest"
# The Triton kernels run on the CPU interpreter in tests.
export TRITON_INTERPRET=1
exec python -m pytest -q -p no:cacheprovider "$@"
