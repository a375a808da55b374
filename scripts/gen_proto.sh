#!/usr/bin/env bash
# Regenerates kvtier/_proto/ from protos/kvtier/v1/kvtier.proto (the source of truth).
# The generated modules are committed; tests/test_service_proto.py regenerates them into a temporary
# directory and fails when the committed copies differ, so run this after editing the .proto.
#   scripts/gen_proto.sh [OUT_DIR]      (default: kvtier/_proto)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${KVTIER_VENV:-$ROOT/.venv}/bin/python"
[ -x "$PY" ] || PY=python3
OUT="${1:-$ROOT/kvtier/_proto}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m grpc_tools.protoc -I "$ROOT/protos" --python_out="$TMP" --pyi_out="$TMP" \
    --grpc_python_out="$TMP" "$ROOT/protos/kvtier/v1/kvtier.proto"
mkdir -p "$OUT"
for f in kvtier_pb2.py kvtier_pb2.pyi kvtier_pb2_grpc.py; do
    sed -e 's/^from kvtier\.v1 import kvtier_pb2 as/from kvtier._proto import kvtier_pb2 as/' \
        "$TMP/kvtier/v1/$f" > "$OUT/$f"
done
[ -f "$OUT/__init__.py" ] || printf '"""Generated from protos/kvtier/v1/kvtier.proto by scripts/gen_proto.sh; do not edit."""\n' > "$OUT/__init__.py"
