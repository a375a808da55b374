"""Who may use the daemon: its user only (socket and DRAM segment 0600), or the members of the
`group` setting as well (both 0660 and of that group), for engines that run as other users.

The socket's directory must let the group through: the daemon creates a missing one 0750 and of
the group, and refuses an existing one the group cannot enter (a per-user runtime dir such as
/run/user/1000 is 0700), naming it, rather than start a socket nobody else can reach.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from kvtier.core.errors import UsageError


def gid(group: str) -> int | None:
    """The group's id, or None for no group ("")."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"group: no group named {group!r} on this machine") from None


def socket_umask(group: str) -> int:
    """The umask under which the socket file is bound: 0600, or 0660 with a group."""
    return 0o117 if group else 0o177


def prepare_socket_dir(socket: Path, group: str) -> None:
    """With a group: creates the socket's directory 0750 of the group, or checks that the group
    can enter an existing one. Without one: nothing (the server creates it 0700)."""
    g = gid(group)
    if g is None:
        return
    parent = socket.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o750)
        os.chown(parent, -1, g)
        os.chmod(parent, 0o750)
        return
    st = parent.stat()
    if not (st.st_mode & stat.S_IXOTH or (st.st_gid == g and st.st_mode & stat.S_IXGRP)):
        raise UsageError(
            f"group {group!r} cannot enter {parent} (mode {stat.S_IMODE(st.st_mode):04o}), so its "
            f"members could not reach the socket: put the socket in a directory of the group "
            f"(e.g. /run/kvtier, RuntimeDirectoryMode=0750 under systemd)"
        )


def share_socket(socket: Path, group: str) -> None:
    """Gives the bound socket its final mode: 0600, or 0660 of the group."""
    g = gid(group)
    if g is not None:
        os.chown(socket, -1, g)
    os.chmod(socket, 0o660 if g is not None else 0o600)
