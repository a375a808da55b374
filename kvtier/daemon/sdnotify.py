"""systemd's readiness and file-descriptor store protocols (sd_notify(3), sd_listen_fds(3))
without libsystemd: datagrams to the socket named by `$NOTIFY_SOCKET`, fds handed back from fd 3.

Under `Type=notify` systemd starts the units ordered after kvtier only once the daemon sends
`READY=1` (sent when it serves: socket bound, tiers opened); `STOPPING=1` says a drain began and
`RELOADING=1` ... `READY=1` brackets a SIGHUP reload. Without `NOTIFY_SOCKET` (not under systemd)
every call does nothing. An address starting with `@` is in the abstract namespace. A send that
fails is ignored: readiness is advisory, never a reason to stop serving.

The fd store (`FdStore`): `FDSTORE=1` + `FDNAME=<name>` with the fds as SCM_RIGHTS ancillary
data hands systemd a copy to keep while the service restarts (a unit with
`FileDescriptorStoreMax=`); `FDSTOREREMOVE=1` + `FDNAME` drops them. At the next start they come
back as fds 3.. with `LISTEN_FDS`, `LISTEN_FDNAMES` and `LISTEN_PID` (`listen_fds`). systemd
keeps the store across restarts (a crash with `Restart=`, `systemctl restart`) and empties it when
the unit stops. It sets `$FDSTORE` to the unit's `FileDescriptorStoreMax=` (systemd 254 and
later): `fd_store_size`. The daemon keeps a pool with tenants there (`kvtier.tiers.dram_keep`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3


def _address(env: Mapping[str, str] | None) -> str | None:
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr


def notify(state: str, env: Mapping[str, str] | None = None, fds: Sequence[int] = ()) -> bool:
    """Sends `state` (e.g. "READY=1") to systemd, with `fds` as SCM_RIGHTS; whether a datagram
    was sent."""
    target = _address(env)
    if target is None:
        return False
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)  # a full queue at the manager is a failed send, never a stall
        s.connect(target)
        if fds:
            socket.send_fds(s, [state.encode()], list(fds))
        else:
            s.send(state.encode())
        return True
    return False


def fd_store_size(env: Mapping[str, str] | None = None) -> int:
    """How many fds the manager's store keeps for this service (`$FDSTORE`, set by systemd 254
    and later to `FileDescriptorStoreMax=`); 0 without `$NOTIFY_SOCKET` or `$FDSTORE`."""
    e = os.environ if env is None else env
    if _address(e) is None:
        return 0
    try:
        return max(0, int(e.get("FDSTORE", "0")))
    except ValueError:
        return 0


class FdStore:
    """The service manager's fd store, as a holder of the pool's memfds
    (`kvtier.tiers.dram_keep.Holder`). Best effort: a failed send is one warning per name."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.size = fd_store_size(self.env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FdStore | None:
        """The store when a manager listens on `$NOTIFY_SOCKET`, else None."""
        return cls(env) if _address(env) is not None else None

    def keep(self, name: str, fd: int) -> None:
        if not notify(f"FDSTORE=1\nFDPOLL=0\nFDNAME={name}", self.env, [fd]):
            log.warning("the service manager did not take fd %s: it does not survive a restart",
                        name)

    def forget(self, name: str) -> None:
        notify(f"FDSTOREREMOVE=1\nFDNAME={name}", self.env)


def listen_fds(env: MutableMapping[str, str] | None = None) -> list[tuple[str, int]]:
    """The fds the service manager passed this process (`LISTEN_FDS` from fd 3, named by
    `LISTEN_FDNAMES`, for `LISTEN_PID` == this process), made close-on-exec, as (name, fd);
    [] when none. The variables are removed from the environment so that no child takes them."""
    e = os.environ if env is None else env
    try:
        pid, count = int(e.get("LISTEN_PID", "0")), int(e.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    names = e.get("LISTEN_FDNAMES", "").split(":")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        e.pop(var, None)
    if pid != os.getpid() or count <= 0:
        return []
    out: list[tuple[str, int]] = []
    for i in range(count):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open: nothing to take
        out.append((names[i] if i < len(names) else "unknown", fd))
    return out
