#!/usr/bin/env bash
# The whole GPU check in one command on a CUDA machine (docs/gpu.md): installs what the
# interpreter lacks from .whl/ (scripts/fetch_gpu_wheels.sh), runs pytest -m gpu and the GPU
# benchmarks within 8 minutes, writes gpu_check.json and gpu_check.log to $OUT (else
# bench/results) and prints a table. `--dry-run` checks every step's setup on a CPU.
# Runs under $PYTHON, else python3 (on the GPU machine: the one that holds torch and CuPy).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m bench.gpu_check "$@"
