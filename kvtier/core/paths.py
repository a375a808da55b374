"""Where a daemon and its clients meet on one machine: the runtime dir and the default socket.

Both sides derive the same path from the same environment, so a client started with no socket
argument finds the daemon `kvtier serve` started with no configuration. Pure: it reads the
mapping it is given, never the filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "kvtier.sock"


def runtime_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_RUNTIME_DIR/kvtier`, else `/tmp/kvtier-$UID` (per user, never shared)."""
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvtier"
    return Path(f"/tmp/kvtier-{os.getuid()}")


def default_socket(env: Mapping[str, str]) -> Path:
    """The daemon's socket when none is named: `$KVTIER_SOCKET`, else the runtime dir's."""
    return Path(env.get("KVTIER_SOCKET") or runtime_dir(env) / SOCKET_NAME)
