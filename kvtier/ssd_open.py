"""Opening the SSD store's files: the LMDB environment, its identity check, disk reservation.

The store's identity (format version, layout digest, payload mode with slot size) is kept in the
`info` sub-database. A store whose identity differs from the configured one cannot serve a single
block, so `stale_reason` names the difference and the store discards the files (`discard`) and
starts empty, with one warning. Nothing here reads payloads.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Any

import lmdb

from kvtier.errors import UsageError
from kvtier.ssd_types import SsdSpec

U64 = struct.Struct("<Q")
FILES = ("data.mdb", "lock.mdb", "slots.dat")


def open_env(spec: SsdSpec) -> Any:
    """The LMDB environment at `spec.path` (0600 files); a failure is a one-line UsageError."""
    try:
        return lmdb.open(
            spec.path,
            mode=0o600,
            map_size=spec.map_size(),
            max_dbs=4,
            max_readers=spec.max_readers,
            sync=spec.durability != "nosync",
            metasync=spec.durability == "sync",
            writemap=spec.writemap,
            readahead=spec.mode() == "lmdb",  # index only: no read-ahead past the page wanted
            meminit=False,
        )
    except lmdb.Error as exc:
        raise UsageError(f"cannot open the SSD store: {exc}") from None


def stale_reason(env: Any, identity: dict[bytes, bytes], fmt: int) -> str | None:
    """Why the store in `env` cannot be used with `identity`, or None (new, or the same)."""
    info = env.open_db(b"info")
    with env.begin(db=info) as txn:
        found = {k: txn.get(k) for k in identity}
    stored = found[b"format"]
    if stored is None or found == identity:
        return None
    version = U64.unpack(stored)[0] if len(stored) == 8 else -1
    if version != fmt:
        return f"store format {version}, this kvtier reads and writes format {fmt}"
    if found[b"layout"] != identity[b"layout"]:
        return "blocks of another layout fingerprint"
    mode = (found[b"mode"] or b"?").decode(errors="replace")
    return f"payload mode {mode}, configured {identity[b'mode'].decode()}"


def discard(path: str) -> None:
    """Delete the store's files (the environment must be closed)."""
    for name in FILES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))


def preallocate(path: str, size: int) -> None:
    """Reserve the whole map on disk before LMDB maps it writable.

    With writemap, LMDB writes through a shared mapping of a sparse file; if the filesystem then
    runs out of space the write faults with SIGBUS and kills the process. Allocating the blocks
    up front turns a full disk into a clean error at open instead.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_blocks * 512 < size:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise UsageError(
            f"cannot reserve {size} bytes for the SSD store at {path}: {exc.strerror} "
            "(lower the SSD capacity or free disk space)"
        ) from None
    finally:
        os.close(fd)
