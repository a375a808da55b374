#!/bin/sh
# Installs kvtier from a built wheel into a virtual environment (the image's install step):
#   sh deploy/install.sh WHEEL_DIR PREFIX      e.g. sh deploy/install.sh dist /opt/kvtier
# PREFIX/bin/kvtier is then the CLI. An existing venv at PREFIX is reused. Extra pip arguments
# (e.g. --no-index for an offline install from what the venv already sees) in $KVTIER_PIP_ARGS.
set -eu
wheels=$1
prefix=$2
[ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
set -- "$wheels"/kvtier-*.whl
[ -f "$1" ] || { echo "install.sh: no kvtier wheel in $wheels (python -m build --wheel)" >&2; exit 2; }
# shellcheck disable=SC2086  # KVTIER_PIP_ARGS is a list of arguments
"$prefix/bin/python" -m pip install --no-cache-dir --disable-pip-version-check -q \
    ${KVTIER_PIP_ARGS:-} "$1"
"$prefix/bin/kvtier" --version
