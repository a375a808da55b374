"""SSD tier: a crash-safe, capacity-bounded block store on LMDB.

Three sub-databases in one environment, always changed in the same transaction:

    blocks  stored key -> payload (exactly the bytes given; no copy to prepend a header)
    meta    stored key -> size, access count, last access, stored-at, parent key, and the
            block's 64-byte header (kvtier.blockfmt)                           (the SSD index)
    info    b"format" / b"layout" / b"used" -> store format, layout digest, used bytes

A stored key is `len(tenant) | tenant utf-8 | block key`, so tenants never share entries. Payload
bytes live inside LMDB values (overflow pages): measured against the targets in
docs/ARCHITECTURE.md "## Storage tiers", this met them without segment files of our own.

Crash safety: a batch of puts is one LMDB transaction; LMDB's copy-on-write B-tree makes it
visible all at once at commit or not at all, so a crash (SIGKILL, power loss) never leaves a
partially written block readable. Durability modes (`SsdSpec.durability`):
    "sync"        fsync data and meta page at each commit: a commit that returned survives a crash.
    "nometasync"  (default) data fsynced, meta page not: a power loss can undo the last committed
                  transaction (never corrupt); a process crash loses nothing committed.
    "nosync"      no fsync; the OS flushes. A process crash loses nothing committed; a power loss
                  may lose recent transactions (ext4/xfs keep the store consistent).

Reads verify everything (header checksum, format, layout digest, key digest, length, payload
checksum of the bytes actually served); a mismatch is a miss, a counter and the entry deleted.

Capacity: `capacity_bytes` bounds the stored bytes (headers included); the LMDB map is sized
with headroom. Without writemap (the default) a full disk is an I/O error on commit, i.e. a
refusal; with `writemap=True` (faster writes, slower cold reads) the map is reserved on disk at
open (posix_fallocate), so a full disk is a clean error at open, never a SIGBUS in a write.
A put that would exceed the capacity asks the `evictor` callback for victims (leaf-first from
the prefix index); what still does not fit is refused. `lmdb.MapFullError` never escapes.

Threading: one writer at a time — writes (`put_many`, `delete_many`, `flush_stats`) are
serialized by an internal lock and are meant to come from the mover's writer thread; reads
(`get_into`, `get`, `contains`) run concurrently from any thread and never block on writers.
The `evictor` runs on the writing thread with no store lock held.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import lmdb
import numpy as np

from kvtier import blockfmt
from kvtier.errors import UsageError

log = logging.getLogger(__name__)

STORE_FORMAT = 2
Durability = Literal["sync", "nometasync", "nosync"]
TenantKey = tuple[str, bytes]
Evictor = Callable[[int], Sequence[TenantKey]]
"""Given bytes to free, return victims (tenant, key) to delete, leaf-first. Runs on the writer."""

_META = struct.Struct("<QQddB")
_U64 = struct.Struct("<Q")
_PAGE = 4096


def stored_key(tenant: str, key: bytes) -> bytes:
    t = tenant.encode()
    if len(t) > 255:
        raise UsageError("tenant name longer than 255 bytes")
    if not 1 <= len(key) <= 200:
        raise UsageError(f"block key must be 1..200 bytes, got {len(key)}")
    return bytes((len(t),)) + t + key


def split_key(skey: bytes) -> TenantKey:
    n = skey[0]
    return skey[1 : 1 + n].decode(), skey[1 + n :]


@dataclass(frozen=True)
class SsdSpec:
    path: str
    capacity_bytes: int
    layout_fingerprint: bytes
    durability: Durability = "nometasync"
    writemap: bool = False
    map_headroom: float = 0.25
    max_readers: int = 126

    def map_size(self) -> int:
        raw = int(self.capacity_bytes * (1 + self.map_headroom)) + (64 << 20)
        return (raw + _PAGE - 1) // _PAGE * _PAGE


class SsdEntry(NamedTuple):
    """One row of the persistent SSD index (read at start without touching payloads)."""

    tenant: str
    key: bytes
    parent: bytes | None
    size: int  # stored bytes, header included
    access_count: int
    last_access: float
    stored_at: float


class PutItem(NamedTuple):
    tenant: str
    key: bytes
    parent: bytes | None
    payload: Any  # any buffer


class PutResult(NamedTuple):
    stored: list[TenantKey]  # now on SSD (newly written, or already there: payloads are immutable)
    refused: list[TenantKey]  # did not fit (capacity or map full) or I/O failed
    evicted: list[TenantKey]  # deleted to make room; the caller drops their SSD residency
    bytes_written: int


class SsdStats(NamedTuple):
    entries: int
    used_bytes: int
    capacity_bytes: int
    bytes_written_total: int
    hits_total: int
    misses_total: int
    corrupt_total: int
    refused_total: int
    map_full_total: int
    evicted_total: int


@dataclass(slots=True)
class _Counters:
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    refused: int = 0
    map_full: int = 0
    evicted: int = 0
    corrupt_by_reason: dict[str, int] = field(default_factory=dict)


def _preallocate(path: str, size: int) -> None:
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


def _raw_bytes(payload: Any) -> memoryview:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("an SSD payload must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class SsdStore:
    """The LMDB block store. Open with `SsdStore(spec)`; `entries()` is the rebuilt index."""

    def __init__(self, spec: SsdSpec, evictor: Evictor | None = None) -> None:
        if spec.capacity_bytes <= 0:
            raise UsageError("SSD capacity must be positive")
        self.spec = spec
        self.evictor = evictor
        self._layout = blockfmt.layout_digest(spec.layout_fingerprint)
        os.makedirs(spec.path, mode=0o700, exist_ok=True)
        try:
            self._env = lmdb.open(
                spec.path,
                mode=0o600,
                map_size=spec.map_size(),
                max_dbs=4,
                max_readers=spec.max_readers,
                sync=spec.durability != "nosync",
                metasync=spec.durability == "sync",
                writemap=spec.writemap,
                readahead=True,
                meminit=False,
            )
        except lmdb.Error as exc:
            raise UsageError(f"cannot open the SSD store: {exc}") from None
        if spec.writemap:
            try:
                _preallocate(os.path.join(spec.path, "data.mdb"), spec.map_size())
            except UsageError:
                self._env.close()
                raise
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._info = self._env.open_db(b"info")
        self._wlock = threading.Lock()
        self._pending_access: dict[bytes, tuple[int, float]] = {}
        self._alock = threading.Lock()
        self._bad: set[bytes] = set()
        self.counters = _Counters()
        self._closed = False
        self._used, self._entries = self._open_info()


    def _open_info(self) -> tuple[int, int]:
        with self._env.begin(write=True) as txn:
            layout = txn.get(b"layout", db=self._info)
            fmt = txn.get(b"format", db=self._info)
            if layout != self._layout or fmt != _U64.pack(STORE_FORMAT):
                n = txn.stat(self._meta)["entries"]
                if n:
                    log.warning("SSD store %s holds %d blocks of another layout or format; "
                                "dropping them", self.spec.path, n)
                txn.drop(self._blocks, delete=False)
                txn.drop(self._meta, delete=False)
                txn.put(b"layout", self._layout, db=self._info)
                txn.put(b"format", _U64.pack(STORE_FORMAT), db=self._info)
                txn.put(b"used", _U64.pack(0), db=self._info)
            used = _U64.unpack(txn.get(b"used", db=self._info) or _U64.pack(0))[0]
            return used, txn.stat(self._meta)["entries"]

    # -- the persistent index --------------------------------------------------------------

    def entries(self) -> list[SsdEntry]:
        """Every stored block's index row, from the meta sub-database only (no payload reads)."""
        out: list[SsdEntry] = []
        unpack = _META.unpack_from
        hsize = _META.size
        with self._env.begin(db=self._meta) as txn:
            for skey, rec in txn.cursor().iternext(keys=True, values=True):
                size, count, last, stored_at, plen = unpack(rec)
                n = skey[0]
                out.append(SsdEntry(
                    skey[1 : 1 + n].decode(), skey[1 + n :], rec[hsize : hsize + plen] or None,
                    size, count, last, stored_at,
                ))
        return out

    def record_access(self, tenant: str, key: bytes, now: float | None = None) -> None:
        """Count an access; persisted with the next write transaction (lost if the daemon dies)."""
        skey = stored_key(tenant, key)
        with self._alock:
            count, _ = self._pending_access.get(skey, (0, 0.0))
            self._pending_access[skey] = (count + 1, time.time() if now is None else now)

    # -- writes (one writer) ---------------------------------------------------------------

    def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """Store a batch in one transaction. Never raises for a full store: it refuses instead.

        The evictor is called before the write lock is taken (no store lock held), so it may
        take the daemon's index lock without a lock-order inversion. Payloads may be any
        C-contiguous buffer (bytes, numpy arrays of any dtype); they are stored as raw bytes.
        """
        self._check_open()
        items = [i._replace(payload=_raw_bytes(i.payload)) for i in items]
        skeys = [stored_key(i.tenant, i.key) for i in items]
        sizes = [blockfmt.HEADER_SIZE + i.payload.nbytes for i in items]
        need = sum(s for s, f in zip(sizes, self._fresh(skeys), strict=True) if f)
        victims: list[TenantKey] = []
        for attempt in range(2):
            # a retry after MapFullError asks for room for the batch twice over
            over = self._used + need * (1 + attempt) - self.spec.capacity_bytes
            if over > 0 and self.evictor is not None:
                victims.extend(self.evictor(over))
            with self._wlock:
                self._check_open()
                try:
                    return self._put_locked(items, skeys, sizes, victims)
                except lmdb.MapFullError:
                    self.counters.map_full += 1
                    log.warning("SSD map full with %d of %d bytes used (attempt %d)",
                                self._used, self.spec.capacity_bytes, attempt + 1)
                except lmdb.Error as exc:
                    log.error("SSD write failed: %s", exc)
                    break
        refused = [(i.tenant, i.key) for i in items]
        self.counters.refused += len(refused)
        return PutResult([], refused, [], 0)

    def _put_locked(
        self,
        items: Sequence[PutItem],
        skeys: list[bytes],
        sizes: list[int],
        victims: list[TenantKey],
    ) -> PutResult:
        cap = self.spec.capacity_bytes
        fresh = self._fresh(skeys)
        stored: list[TenantKey] = []
        refused: list[TenantKey] = []
        evicted: list[TenantKey] = []
        written = 0
        now = time.time()
        txn = self._env.begin(write=True)
        try:
            used = self._used
            entries = self._entries
            batch = set(skeys)
            for tenant, key in victims:
                vkey = stored_key(tenant, key)
                if vkey in batch:
                    continue
                rec = txn.get(vkey, db=self._meta)
                if rec is None:
                    continue
                txn.delete(vkey, db=self._blocks)
                txn.delete(vkey, db=self._meta)
                used -= _META.unpack_from(rec)[0]
                entries -= 1
                evicted.append((tenant, key))
            for item, skey, size, is_new in zip(items, skeys, sizes, fresh, strict=True):
                tk = (item.tenant, item.key)
                if not is_new:
                    stored.append(tk)
                    continue
                if used + size > cap:
                    refused.append(tk)
                    continue
                header = blockfmt.encode_header(skey, self._layout, item.payload)
                txn.put(skey, item.payload, db=self._blocks)
                parent = item.parent or b""
                rec = _META.pack(size, 1, now, now, len(parent)) + parent + header
                txn.put(skey, rec, db=self._meta)
                used += size
                entries += 1
                written += size
                stored.append(tk)
            self._flush_access(txn)
            txn.put(b"used", _U64.pack(used), db=self._info)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        self._used, self._entries = used, entries
        self._bad.difference_update(skeys)
        c = self.counters
        c.bytes_written += written
        c.refused += len(refused)
        c.evicted += len(evicted)
        return PutResult(stored, refused, evicted, written)

    def _fresh(self, skeys: list[bytes]) -> list[bool]:
        """Which keys are not stored yet (a key repeated within the batch counts once)."""
        seen: set[bytes] = set()
        fresh: list[bool] = []
        with self._env.begin(db=self._meta) as rtxn:
            for k in skeys:
                fresh.append(k not in seen and rtxn.get(k) is None)
                seen.add(k)
        return fresh

    def _flush_access(self, txn: Any) -> None:
        with self._alock:
            pending, self._pending_access = self._pending_access, {}
        for skey, (count, last) in pending.items():
            rec = txn.get(skey, db=self._meta)
            if rec is None:
                continue
            size, old, _last, stored_at, plen = _META.unpack_from(rec)
            head = _META.pack(size, old + count, last, stored_at, plen)
            txn.put(skey, head + bytes(rec[_META.size :]), db=self._meta)

    def delete_many(self, keys: Iterable[TenantKey]) -> list[TenantKey]:
        """Delete blocks in one transaction; returns those that were stored."""
        with self._wlock:
            self._check_open()
            return self._delete_locked([stored_key(t, k) for t, k in keys])

    def _delete_locked(self, skeys: list[bytes]) -> list[TenantKey]:
        removed: list[TenantKey] = []
        try:
            with self._env.begin(write=True) as txn:
                used, entries = self._used, self._entries
                for skey in skeys:
                    rec = txn.get(skey, db=self._meta)
                    txn.delete(skey, db=self._blocks)
                    if rec is not None:
                        txn.delete(skey, db=self._meta)
                        used -= _META.unpack_from(rec)[0]
                        entries -= 1
                        removed.append(split_key(skey))
                txn.put(b"used", _U64.pack(used), db=self._info)
        except lmdb.Error as exc:
            log.error("SSD delete failed: %s", exc)
            return []
        self._used, self._entries = used, entries
        return removed

    def flush_stats(self) -> None:
        """Persist pending access counts now (the mover calls this when idle and at close)."""
        with self._wlock:
            if self._closed or not self._pending_access:
                return
            try:
                with self._env.begin(write=True) as txn:
                    self._flush_access(txn)
            except lmdb.Error as exc:
                log.warning("SSD access stats not persisted: %s", exc)

    # -- reads (concurrent) ------------------------------------------------------------------

    def get_into(self, tenant: str, key: bytes, out: Any) -> int | None:
        """Copy a verified payload into `out` (a writable buffer); its length, or None on a miss.

        A corrupt entry is a miss: counted, deleted, never served. `out` must hold the payload;
        if it is too small the block is a miss (and is not deleted).
        """
        return self.get_many_into([(tenant, key, out)])[0]

    def get_many_into(self, reads: Sequence[tuple[str, bytes, Any]]) -> list[int | None]:
        """`get_into` for a batch in one read transaction.

        py-lmdb pre-faults each value's pages (GIL released) before returning its zero-copy
        view; with the kernel's mmap read-ahead that is the cold-read path (measured in
        docs/ARCHITECTURE.md "## Storage tiers"). The payload is checksummed after the copy, in
        `out`: the bytes served are the bytes verified.
        """
        skeys = [stored_key(t, k) for t, k, _ in reads]
        results: list[int | None] = [None] * len(reads)
        rejected: list[tuple[bytes, blockfmt.Corruption]] = []
        with self._env.begin(buffers=True) as txn:
            for i, (skey, (_, _, out)) in enumerate(zip(skeys, reads, strict=True)):
                if skey in self._bad:
                    continue
                rec = txn.get(skey, db=self._meta)
                if rec is None:
                    continue
                value = txn.get(skey, db=self._blocks)
                try:
                    if value is None or len(rec) < _META.size + blockfmt.HEADER_SIZE:
                        raise blockfmt.BlockCorrupt(blockfmt.Corruption.SHORT)
                    header = rec[len(rec) - blockfmt.HEADER_SIZE :]
                    results[i] = self._copy_verified(
                        skey, header, value, np.frombuffer(out, np.uint8)
                    )
                except blockfmt.BlockCorrupt as exc:
                    rejected.append((skey, exc.reason))
        for skey, reason in rejected:
            self._reject(skey, reason)
        hits = sum(r is not None for r in results)
        self.counters.hits += hits
        self.counters.misses += len(reads) - hits - len(rejected)
        return results

    def _copy_verified(
        self, skey: bytes, header: memoryview, payload: memoryview, dst: np.ndarray
    ) -> int | None:
        n = len(payload)
        csum = blockfmt.check_header(skey, self._layout, header, blockfmt.HEADER_SIZE + n)
        if n > dst.nbytes:
            return None
        np.copyto(dst[:n], np.frombuffer(payload, dtype=np.uint8))
        if blockfmt.payload_checksum(dst[:n].data) != csum:
            raise blockfmt.BlockCorrupt(blockfmt.Corruption.PAYLOAD_CHECKSUM)
        return n

    def get(self, tenant: str, key: bytes) -> bytes | None:
        """A verified payload as bytes (a copy), or None."""
        skey = stored_key(tenant, key)
        with self._env.begin(db=self._meta) as txn:
            rec = txn.get(skey)
        if rec is None:
            self.counters.misses += 1
            return None
        buf = bytearray(_META.unpack_from(rec)[0] - blockfmt.HEADER_SIZE)
        n = self.get_into(tenant, key, buf)
        return None if n is None else bytes(buf[:n])

    def contains(self, tenant: str, key: bytes) -> bool:
        skey = stored_key(tenant, key)
        if skey in self._bad:
            return False
        with self._env.begin(db=self._meta) as txn:
            return txn.get(skey) is not None

    def _reject(self, skey: bytes, reason: blockfmt.Corruption) -> None:
        self._bad.add(skey)
        c = self.counters
        c.corrupt += 1
        c.misses += 1  # get_many_into leaves rejected reads out of its own miss count
        c.corrupt_by_reason[reason.value] = c.corrupt_by_reason.get(reason.value, 0) + 1
        log.warning("SSD block rejected (%s); deleting it", reason.value)
        with self._wlock:
            if not self._closed:
                self._delete_locked([skey])

    # -- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> SsdStats:
        c = self.counters
        return SsdStats(
            self._entries, self._used, self.spec.capacity_bytes, c.bytes_written, c.hits,
            c.misses, c.corrupt, c.refused, c.map_full, c.evicted,
        )

    def __len__(self) -> int:
        return self._entries

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSD store is closed")

    def close(self) -> None:
        """Persist pending access stats and close the environment. Idempotent."""
        self.flush_stats()
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._env.close()

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
