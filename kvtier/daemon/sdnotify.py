"""systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram to the socket
named by `$NOTIFY_SOCKET`.

Under `Type=notify` systemd starts the units ordered after kvtier only once the daemon sends
`READY=1` (sent when it serves: socket bound, tiers opened); `STOPPING=1` says a drain began and
`RELOADING=1` ... `READY=1` brackets a SIGHUP reload. Without `NOTIFY_SOCKET` (not under systemd)
every call does nothing. An address starting with `@` is in the abstract namespace. A send that
fails is ignored: readiness is advisory, never a reason to stop serving.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Sends `state` (e.g. "READY=1") to systemd; whether a datagram was sent."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(target)
        s.sendall(state.encode())
        return True
    return False
