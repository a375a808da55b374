"""Claiming the daemon's Unix socket path: a user's files are never touched.

`claim(path)` runs before the server binds. It refuses (UsageError, one line) a path Linux cannot
bind (over `kvtier.core.paths.SOCKET_PATH_MAX` bytes, a directory that cannot be created or
written, e.g. under /proc), anything at the path that is not a socket (a regular file, a
directory, a symlink: never removed), and a socket a process listens on (another daemon). Only a
stale socket — one nothing listens on (connect is refused), a crashed daemon's leftover — is
removed, and `claim` returns a line saying so for the log.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from kvtier.core.errors import UsageError
from kvtier.core.paths import socket_path_problem


def claim(path: Path) -> str | None:
    """Makes `path` free for the daemon's socket (its directory created 0700); returns a log line
    when it removed a stale socket. Raises UsageError for every reason it cannot."""
    problem = socket_path_problem(path)
    if problem:
        raise UsageError(problem)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UsageError(f"socket {path}: cannot create its directory {path.parent}: "
                         f"{exc.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        _try_bind(path)
        return None
    except OSError as exc:
        raise UsageError(f"socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise UsageError(f"socket {path}: a {_kind(mode)} is there, not a socket; kvtier never "
                         "removes it (choose another socket path)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        pass  # nobody listens: a dead daemon's leftover
    except OSError as exc:
        raise UsageError(f"socket {path}: cannot tell whether a daemon listens on it: "
                         f"{exc.strerror}") from None
    else:
        raise UsageError(f"another daemon is listening on {path}")
    finally:
        probe.close()
    try:
        path.unlink()
    except OSError as exc:
        raise UsageError(f"socket {path}: cannot remove the stale socket: {exc.strerror}") from None
    _try_bind(path)
    return f"removed stale socket {path} (nothing listened on it)"


def _try_bind(path: Path) -> None:
    """Binds and removes a socket at `path`, so a path the server could not bind fails here
    with the reason (gRPC only says that binding failed)."""
    trial = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        trial.bind(str(path))
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno in (errno.ENOENT, errno.EACCES, errno.EROFS, errno.EPERM):
            why += f" (the directory {path.parent} does not take new files)"
        raise UsageError(f"socket {path}: cannot create a socket there: {why}") from None
    finally:
        trial.close()
    path.unlink(missing_ok=True)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "regular file"
    return "special file"
