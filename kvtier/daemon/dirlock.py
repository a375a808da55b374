"""One daemon per data dir: an exclusive `flock` on `<data_dir>/daemon.lock`, held for the
daemon's life.

Two daemons on one data dir would resize and write each other's SSD files. The lock is taken
before anything in the data dir is opened; a second daemon is refused with a message naming the
holder (its pid and socket, which the holder writes into the lock file). The kernel drops the
lock when its holder exits in any way (SIGKILL included), so a dead daemon never blocks the next
one, and the lock file itself is left in place (removing it would race a starting daemon).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from kvtier.core.errors import UsageError

LOCK_FILE = "daemon.lock"


class DataDirLock:
    """Held from `acquire` to `release` (or process exit)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path, socket: Path) -> DataDirLock:
        """Locks `data_dir` (created 0700 if missing) or raises UsageError naming the holder."""
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise UsageError(f"data dir {data_dir} is in use by another kvtier daemon ({holder}); "
                             "give each daemon its own --data-dir") from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "socket": str(socket)}).encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the flock
            self._fd = None


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        return f"pid {int(info['pid'])}, socket {info['socket']}"
    except (ValueError, KeyError, TypeError):
        return "pid and socket unknown"
