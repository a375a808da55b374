"""Opening the SSD store's files: the LMDB environment, its identity check, disk reservation,
and the totals and slot free set rebuilt from the index (`open_files` -> `StoreFiles`).

The store's identity (format version, layout digest, payload mode with slot size) is kept in the
`info` sub-database. A store whose identity differs from the configured one cannot serve a single
block, so `stale_reason` names the difference and the store discards the files (`discard`) and
starts empty, with one warning. Nothing here reads payloads.

Damage. Files that cannot be read as a store (LMDB reports MDB_INVALID, MDB_CORRUPTED, a missing
page or another version; an index record of the wrong length; or a `data.mdb` shorter than its
last committed transaction, which LMDB would map and then die on with SIGBUS) raise
`DamagedStore`, never a crash: `check_size` reads the two meta pages before LMDB maps the file,
and `probe` walks the whole index in a child process first, since LMDB trusts its pages: a page
pointer garbled on disk makes it read past the file (SIGBUS) or through garbage, which kills the
child, not the daemon.
What to do with a damaged store (move it aside) is the caller's policy
(`kvtier.tiers.ssd.store.open_store`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import lmdb

from kvtier.core.errors import UsageError
from kvtier.core.units import format_bytes
from kvtier.tiers import blockfmt
from kvtier.tiers.ssd.read import META
from kvtier.tiers.ssd.slots import SlotFile
from kvtier.tiers.ssd.types import SsdSpec

log = logging.getLogger("kvtier.tiers.ssd.store")  # the store's messages come from one logger

STORE_FORMAT = 3
SLOT_FILE = "slots.dat"
U64 = struct.Struct("<Q")
FILES = ("data.mdb", "lock.mdb", SLOT_FILE)
LMDB_DAMAGE: tuple[type[Exception], ...] = (
    lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
    lmdb.BadValsizeError, lmdb.BadTxnError, lmdb.BadRslotError, lmdb.PanicError,
    struct.error,
)
_META_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II")  # mm_magic, mm_version at 16 bytes into a meta page
_PSIZE_AT = 16 + 24  # the free DB's md_pad holds the page size
_LAST_AT = 16 + 120  # mm_last_pg, mm_txnid


class DamagedStore(Exception):
    """The store's files cannot be read as a store; the message says what is wrong."""


def check_size(path: str) -> None:
    """Raises `DamagedStore` when `path`/data.mdb is shorter than the pages its newest meta page
    says are committed (a truncated file: mapping it would end in SIGBUS at the first read)."""
    data = os.path.join(path, "data.mdb")
    try:
        with open(data, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(2 * 65536)
    except FileNotFoundError:
        return
    if size == 0:
        return  # LMDB initialises an empty file
    if len(head) < 16 + 136:
        raise DamagedStore(f"{data} is {size} bytes, shorter than one LMDB meta page")
    magic, _ = _META.unpack_from(head, 16)
    if magic != _META_MAGIC:
        raise DamagedStore(f"{data} is not an LMDB file (bad magic {magic:#x})")
    psize = struct.unpack_from("<I", head, _PSIZE_AT)[0]
    if not 512 <= psize <= 65536 or len(head) < psize + 16 + 136:
        raise DamagedStore(f"{data} is {size} bytes: truncated within its meta pages")
    metas = [struct.unpack_from("<QQ", head, off + _LAST_AT) for off in (0, psize)
             if _META.unpack_from(head, off + 16)[0] == _META_MAGIC]
    last_pg, _ = max(metas, key=lambda m: m[1])
    need = (last_pg + 1) * psize
    if size < need:
        raise DamagedStore(f"{data} is {size} bytes but its last committed transaction uses "
                           f"{need} (truncated)")


_PROBE = """
import sys
import lmdb
damage = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
          lmdb.VersionMismatchError, lmdb.BadValsizeError, lmdb.BadTxnError, lmdb.PanicError)
try:
    env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        tables = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
    if env.info()["last_txnid"] > 0 and b"info" not in tables:
        print(f"the index lost its tables (found {tables[:4]})", file=sys.stderr)
        sys.exit(3)  # every store any kvtier committed to has one
    for name in (b"info", b"meta", b"blocks"):
        if name in tables:
            with env.begin() as txn:
                db = env.open_db(name, txn=txn, create=False)
                for _ in txn.cursor(db=db).iternext(keys=True, values=name != b"blocks"):
                    pass
except damage as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
except Exception:
    sys.exit(4)  # not damage (permissions...): opening it here reports that properly
"""


def probe(path: str, timeout: float = 300.0) -> None:
    """Raises `DamagedStore` when reading every index page of the store at `path` fails with
    LMDB damage or kills the reading process (a child: `python -c`, lmdb only)."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DamagedStore(f"reading the index took over {timeout:.0f} s") from None
    if proc.returncode < 0:
        raise DamagedStore("reading the index killed the reader with "
                           f"{signal.Signals(-proc.returncode).name}")
    if proc.returncode == 3:
        raise DamagedStore(" ".join(proc.stderr.split()) or "LMDB reported damage")


class Dropped(NamedTuple):
    shrunk_blocks: int  # entries beyond a reduced slot count
    shrunk_bytes: int
    damaged: int  # entries of the wrong length, or naming a slot another entry holds


@dataclass(slots=True)
class StoreFiles:
    """An open store: the environment, its sub-databases (`kvtier.tiers.ssd.store` docstring), the
    slot file (slots mode), the layout digest every header carries, and the index totals. `used`
    and `entries` change only with a committed write transaction, under the store's write lock.
    `dropped` says what the open removed from the index: entries whose slot a smaller capacity
    no longer has (a shrink), and entries that could not be decoded or shared a slot."""

    env: Any
    blocks: Any
    meta: Any
    info: Any
    slots: SlotFile | None
    layout: bytes
    used: int = 0
    entries: int = 0
    dropped: Dropped = field(default_factory=lambda: Dropped(0, 0, 0))


def identity(spec: SsdSpec) -> dict[bytes, bytes]:
    """What the `info` sub-database must hold for this spec: format, layout digest, mode."""
    mode = b"slots:%d" % spec.slot_size if spec.mode() == "slots" else b"lmdb"
    return {b"format": U64.pack(STORE_FORMAT),
            b"layout": blockfmt.layout_digest(spec.layout_fingerprint), b"mode": mode}


def open_files(spec: SsdSpec) -> StoreFiles:
    """Opens the store at `spec.path` (created, or discarded and recreated when stale), reserves
    its disk space, and rebuilds the totals (and the slot free set) from the index."""
    ident = identity(spec)
    os.makedirs(spec.path, mode=0o700, exist_ok=True)
    check_size(spec.path)
    check_room(spec)
    probe(spec.path)
    env = open_env(spec)
    try:
        stale = stale_reason(env, ident, STORE_FORMAT)
    except LMDB_DAMAGE as exc:
        env.close()
        raise DamagedStore(f"info: {exc}") from None
    if stale:
        log.warning("SSD store %s: %s; discarding it and starting empty", spec.path, stale)
        env.close()
        discard(spec.path)
        env = open_env(spec)
    slots: SlotFile | None = None
    try:
        preallocate(os.path.join(spec.path, "data.mdb"), spec.map_size())
        if spec.mode() == "slots":
            slots = SlotFile(os.path.join(spec.path, SLOT_FILE), spec.slot_size,
                             spec.slot_count())
    except UsageError:
        env.close()
        raise
    try:
        f = StoreFiles(env, env.open_db(b"blocks"), env.open_db(b"meta"),
                       env.open_db(b"info"), slots, ident[b"layout"])
        _load_totals(f, ident, spec.path)
    except LMDB_DAMAGE as exc:
        env.close()
        if slots is not None:
            slots.close()
        raise DamagedStore(f"index: {exc}") from None
    return f


def _load_totals(f: StoreFiles, ident: dict[bytes, bytes], path: str) -> None:
    """Used bytes and entry count; in slots mode also the free set, rebuilt from the index
    (a read transaction; a write one only for a new store or entries naming a bad slot)."""
    with f.env.begin(buffers=True) as txn:
        new = txn.get(b"format", db=f.info) is None
        used = U64.unpack(txn.get(b"used", db=f.info) or U64.pack(0))[0]
        entries = txn.stat(f.meta)["entries"]
        doomed, f.dropped = (_claim_slots(f.slots, f.meta, txn, path) if f.slots is not None
                             else ([], Dropped(0, 0, 0)))
    if new or doomed:
        with f.env.begin(write=True) as txn:
            for k, v in ident.items():
                txn.put(k, v, db=f.info)
            for skey, size in doomed:
                txn.delete(skey, db=f.meta)
                used -= size
                entries -= 1
            txn.put(b"used", U64.pack(used), db=f.info)
    f.used, f.entries = used, entries


def _claim_slots(slots: SlotFile, meta: Any, txn: Any, path: str
                 ) -> tuple[list[tuple[bytes, int]], Dropped]:
    """Mark every slot named by the index used; returns the entries to drop (key, size): those
    beyond the slot count (the capacity shrank), undecodable ones, and those sharing a slot."""
    mark = slots.mark_used
    unpack = META.unpack_from
    doomed: list[tuple[bytes, int]] = []
    shrunk = shrunk_bytes = damaged = 0
    for skey, rec in txn.cursor(db=meta).iternext(keys=True, values=True):
        if len(rec) < META.size:
            doomed.append((bytes(skey), 0))
            damaged += 1
            continue
        size, _, _, _, _, slot = unpack(rec)
        if slot >= slots.nslots:
            shrunk += 1
            shrunk_bytes += size
            doomed.append((bytes(skey), size))
        elif not mark(slot):
            damaged += 1
            doomed.append((bytes(skey), size))
    if damaged:
        log.warning("SSD store %s: %d index entries were undecodable or shared a slot; dropped",
                    path, damaged)
    return doomed, Dropped(shrunk, shrunk_bytes, damaged)


def check_room(spec: SsdSpec) -> None:
    """Refuses, before anything is opened or mapped, a store larger than the disk can hold: the
    bytes it reserves (the LMDB map, and the slot file in slots mode) less what its files
    already hold, against the filesystem's free space. (`preallocate` checks each file again.)"""
    files = [("data.mdb", spec.map_size())]
    if spec.mode() == "slots":
        files.append((SLOT_FILE, spec.slot_size * spec.slot_count()))
    want = held = 0
    for name, size in files:
        want += size
        with contextlib.suppress(FileNotFoundError):
            held += min(size, os.stat(os.path.join(spec.path, name)).st_blocks * 512)
    st = os.statvfs(spec.path)
    free = st.f_bavail * st.f_frsize
    if want - held > free:
        raise UsageError(
            f"the SSD tier (its blocks and their LMDB index) needs {format_bytes(want)} at "
            f"{spec.path}, but its filesystem has "
            f"{format_bytes(free + held)} for it (lower ssd_bytes, or free disk space)")


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
    except LMDB_DAMAGE as exc:
        raise DamagedStore(str(exc)) from None
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
    """Reserve the whole map on disk at open, so a full disk is found at start.

    With writemap, LMDB writes through a shared mapping of a sparse file; if the filesystem then
    runs out of space the write faults with SIGBUS and kills the process. Without it, a sparse
    file would fail a write-back with ENOSPC hours later, against a tier the daemon sized at
    start. Allocating the blocks up front turns a full disk into a clean error at open instead.
    The free space is checked first (nothing is allocated when it cannot all fit), and an
    allocation that still fails gives back what it took.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        missing = size - st.st_blocks * 512
        if missing <= 0:
            return
        free = os.statvfs(path)
        if free.f_bavail * free.f_frsize < missing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, st.st_size)  # give back a partial allocation
            raise
    except OSError as exc:
        raise UsageError(
            f"cannot reserve {size} bytes for the SSD store at {path}: {exc.strerror} "
            "(lower the SSD capacity or free disk space)"
        ) from None
    finally:
        os.close(fd)
