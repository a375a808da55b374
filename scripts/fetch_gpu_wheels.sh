#!/usr/bin/env bash
# Downloads the Python 3.12 manylinux x86_64 wheels of scripts/gpu_wheels.txt into .whl/ (git
# ignores it), for a GPU machine that reaches no package index: carry .whl with the working tree
# and `scripts/gpu_check.sh` installs what that machine lacks. Needs pip and PyPI here; keeps
# one version of each package and the folder under 48 MiB (the tree travels in 64 MiB).
#   scripts/fetch_gpu_wheels.sh            # into .whl/
#   WHEEL_DIR=/tmp/w scripts/fetch_gpu_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${WHEEL_DIR:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
mapfile -t pins < <(grep -v '^\s*#' "$ROOT/scripts/gpu_wheels.txt" | sed '/^\s*$/d')
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$DIR" "${pins[@]}"
# one version of each package: drop wheels of the same name that are not pinned now
keep=()
for pin in "${pins[@]}"; do
    name="${pin%%==*}"; version="${pin##*==}"
    norm="$(echo "$name" | tr 'A-Z-.' 'a-z__')"
    for f in "$DIR"/*.whl; do
        base="$(basename "$f")"
        fname="$(echo "${base%%-*}" | tr 'A-Z-.' 'a-z__')"
        rest="${base#*-}"
        if [ "$fname" = "$norm" ]; then
            if [ "${rest%%-*}" = "$version" ]; then keep+=("$base"); else rm -f "$f"; fi
        fi
    done
done
bytes="$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)"
echo "fetch_gpu_wheels: ${#keep[@]} wheels, $((bytes / 1048576)) MiB in $DIR"
if [ "$bytes" -gt $((48 * 1048576)) ]; then
    echo "fetch_gpu_wheels: over 48 MiB: the working tree travels in 64 MiB" >&2
    exit 1
fi
