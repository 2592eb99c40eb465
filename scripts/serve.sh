#!/usr/bin/env bash
# Set up (first run only) and serve the default model on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/fuel-serve "$@"
