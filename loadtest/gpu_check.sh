#!/usr/bin/env bash
# GPU check: kernel tests on CUDA, kernel microbenchmarks, offline engine benchmarks.
# Writes $OUT/gpu-check.md (or docs/benchmarks/gpu-check.md), with the date and commit. Extra arguments go to gpu_check.py,
# e.g. --sections pytest,attention or --num-seqs 128.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
# Compiled kernels on the GPU, never the CPU interpreter.
unset TRITON_INTERPRET
exec timeout 480 python -m benchmarks.gpu_check "$@"
