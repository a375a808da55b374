"""SSD tier: a crash-safe, capacity-bounded block store indexed by LMDB.

Sub-databases of one LMDB environment, always changed in the same transaction:

    meta    stored key -> size, access count, last access, stored-at, payload slot, parent key,
            and the block's 64-byte header (kvtier.tiers.blockfmt)                   (the SSD index)
    blocks  stored key -> payload (payload mode "lmdb" only)
    info    b"format" / b"layout" / b"mode" / b"used" -> store format, layout digest,
            payload mode and slot size, used bytes

A stored key is `len(ns) | ns utf-8 | block key`, so namespaces never share entries.

Where payloads live (`SsdSpec.payload`, measured in docs/benchmarks.md, "Storage tiers"):
    "slots"  a preallocated file of fixed-size slots (`kvtier.tiers.ssd.slots`), written with
             pwritev and read with pread; LMDB holds only the index. The default whenever the spec
             names a `slot_size` (payloads up to that size; larger ones are refused).
    "lmdb"   inside LMDB values (overflow pages); any payload size.

Crash safety. "lmdb": a batch of puts is one LMDB transaction, visible whole at commit or not at
all. "slots": a batch's payloads are written into slots no committed entry references, the slot
file is fdatasynced, and only then is the transaction that references them (slot, length,
checksum in the header) committed; a crash before the commit leaves the slots unreferenced, and
the free set is rebuilt from the index at open. A delete commits first and frees its slots after
(through a reader quarantine, see `kvtier.tiers.ssd.slots`). Either way a crash (SIGKILL, power
loss) never leaves a partially written block readable. Durability modes (`SsdSpec.durability`):
    "sync"        fsync data and meta page at each commit: a commit that returned survives a crash.
    "nometasync"  (default) data fsynced, meta page not: a power loss can undo the last committed
                  transaction (never corrupt); a process crash loses nothing committed.
    "nosync"      no fsync; the OS flushes. A process crash loses nothing committed; a power loss
                  may lose recent transactions (the headers' checksums catch a payload lost then).

Reads verify everything (header checksum, format, layout digest, key digest, length, payload
checksum of the bytes actually served); a mismatch is a miss, a counter and the entry deleted.

Capacity: `capacity_bytes` bounds the stored bytes (headers included); in slots mode also the
slot count. The slot file and the LMDB map (with or without `writemap`) are reserved on disk at
open, so a full disk is a clean error at open, never a SIGBUS or ENOSPC in a write. A put that would
exceed the capacity asks the `evictor` callback for victims (leaf-first from the prefix index);
what still does not fit is refused. `lmdb.MapFullError` never escapes.

Damage (`open_store`): a store that cannot be opened — LMDB damage, a truncated `data.mdb`
(detected before LMDB maps it, so never a SIGBUS), garbled pages (found by a child process that
reads the index first) — is renamed aside to `<path>.damaged-<UTC time>` (never deleted: it may
be wanted for a post-mortem) and an empty store is created in its place, with one ERROR line
naming both paths. Index entries that cannot be decoded (a damaged
namespace name, a record of the wrong length) are skipped, counted (`Counters.undecodable`) and
deleted; the rest of the store serves on.

Format: `STORE_FORMAT` 3 (a slot number in every index record). A store of another format, layout
or payload mode (an older kvtier, a changed slot size) is discarded at open with one warning: its
files are deleted and recreated empty — it is a cache, and nothing in it could be served.

Modules: this one is the store's policy (eviction before a put, retries, counters, rejected keys)
and its API; `ssd_open` opens the files and rebuilds the totals and free set, `ssd_write` runs the
write transactions (a put per payload mode, deletes, access counts), `ssd_read` the verified reads
per payload mode, `ssd_slots` the slot file, `ssd_types` the spec and result types.

Threading: one writer at a time — writes (`put_many`, `delete_many`, `flush_stats`) are
serialized by an internal lock and are meant to come from the mover's writer thread; reads
(`get_into`, `get_many_into`, `get`, `contains`) run concurrently from any thread and never
block on writers. The `evictor` runs on the writing thread with no store lock held. Lock order:
callers may hold their own lock when they write (the daemon's cache lock, for deletes); under the
write lock the store takes only its own inner locks (the slot file's free set, the pending access
counts), never a caller's.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import lmdb

from kvtier.core.errors import UsageError
from kvtier.tiers import blockfmt
from kvtier.tiers.ssd.files import (
    LMDB_DAMAGE,
    SLOT_FILE,
    STORE_FORMAT,
    DamagedStore,
    Dropped,
    open_files,
)
from kvtier.tiers.ssd.files import preallocate as _preallocate  # noqa: F401 (tests import it here)
from kvtier.tiers.ssd.read import META as _META
from kvtier.tiers.ssd.read import Rejected, read_lmdb, read_slots
from kvtier.tiers.ssd.slots import SlotFile
from kvtier.tiers.ssd.types import (
    HEADER_SIZE,
    Counters,
    Durability,
    Evictor,
    PayloadMode,
    PutItem,
    PutResult,
    SsdEntry,
    SsdSpec,
    SsdStats,
    TenantKey,
    split_key,
    stored_key,
)
from kvtier.tiers.ssd.write import (
    Batch,
    PendingAccess,
    delete,
    delete_prefix,
    fresh,
    put_lmdb,
    put_slots,
)

__all__ = [
    "SLOT_FILE", "STORE_FORMAT", "DamagedStore", "Dropped", "Durability", "Evictor", "Opened",
    "PayloadMode", "PutItem", "PutResult", "SsdEntry", "SsdSpec", "SsdStats", "SsdStore",
    "TenantKey", "open_store", "split_key", "stored_key",
]

log = logging.getLogger(__name__)

assert HEADER_SIZE == blockfmt.HEADER_SIZE


def _raw_bytes(payload: Any) -> memoryview:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("an SSD payload must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class SsdStore:
    """The block store. Open with `SsdStore(spec)`; `entries()` is the rebuilt index."""

    def __init__(self, spec: SsdSpec, evictor: Evictor | None = None) -> None:
        if spec.capacity_bytes <= 0:
            raise UsageError("SSD capacity must be positive")
        self.mode = spec.mode()
        if self.mode == "slots" and spec.slot_count() < 1:
            raise UsageError(f"SSD capacity {spec.capacity_bytes} holds no block of "
                             f"{spec.slot_size} bytes (slot size must be positive and fit)")
        self.spec = spec
        self.evictor = evictor
        self._files = open_files(spec)
        self._slots: SlotFile | None = self._files.slots
        self._wlock = threading.Lock()
        self._access = PendingAccess()
        self._bad: set[bytes] = set()
        self.counters = Counters()
        self._closed = False

    # -- the persistent index --------------------------------------------------------------

    def entries(self) -> list[SsdEntry]:
        """Every stored block's index row, from the meta sub-database only (no payload reads).
        Rows that cannot be decoded are left out, counted (`counters.undecodable`) and deleted."""
        out: list[SsdEntry] = []
        bad: list[bytes] = []
        unpack = _META.unpack_from
        hsize = _META.size
        with self._files.env.begin(db=self._files.meta) as txn:
            for skey, rec in txn.cursor().iternext(keys=True, values=True):
                try:
                    size, count, last, stored_at, plen, _slot = unpack(rec)
                    ns, key = split_key(skey)
                except (struct.error, UnicodeDecodeError, IndexError):
                    bad.append(bytes(skey))
                    continue
                out.append(SsdEntry(ns, key, rec[hsize : hsize + plen] or None, size, count,
                                    last, stored_at))
        if bad:
            self.counters.undecodable += len(bad)
            log.warning("SSD store %s: %d index entries could not be decoded; skipped and "
                        "deleted", self.spec.path, len(bad))
            with self._wlock:
                delete(self._files, bad)
        return out

    @property
    def dropped_at_open(self) -> Dropped:
        """What opening removed from the index (a shrink's evictions, damaged entries)."""
        return self._files.dropped

    @property
    def found_slots(self) -> int:
        """Slots the payload file had before this open (more than now: the capacity shrank)."""
        return self._slots.found_slots if self._slots is not None else 0

    def record_access(self, ns: str, key: bytes, now: float | None = None) -> None:
        """Count an access; persisted with the next write transaction (lost if the daemon dies)."""
        self._access.record(stored_key(ns, key), time.time() if now is None else now)

    # -- writes (one writer) ---------------------------------------------------------------

    def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """Store a batch (one index transaction). Never raises for a full store: it refuses.

        The evictor is called before the write lock is taken (no store lock held), so it may
        take the daemon's index lock without a lock-order inversion. Payloads may be any
        C-contiguous buffer (bytes, numpy arrays of any dtype); they are stored as raw bytes.
        In slots mode a payload larger than the slot size is refused.
        """
        self._check_open()
        f = self._files
        items = [i._replace(payload=_raw_bytes(i.payload)) for i in items]
        skeys = [stored_key(i.ns, i.key) for i in items]
        batch = Batch(items, skeys, [HEADER_SIZE + i.payload.nbytes for i in items])
        is_fresh = fresh(f, skeys)
        need = sum(s for s, new in zip(batch.sizes, is_fresh, strict=True) if new)
        victims: list[TenantKey] = []
        evicted: list[TenantKey] = []  # slots mode: deleted (committed) before the puts
        for attempt in range(2):
            # a retry after MapFullError asks for room for the batch twice over
            over = f.used + need * (1 + attempt) - self.spec.capacity_bytes
            if self._slots is not None:
                short = sum(is_fresh) * (1 + attempt) - self._slots.free_count()
                over = max(over, short * (self.spec.slot_size + HEADER_SIZE))
            if over > 0 and self.evictor is not None:
                victims.extend(self.evictor(over))
            with self._wlock:
                self._check_open()
                try:
                    if self._slots is None:
                        return self._done(skeys, put_lmdb(f, self.spec, batch, victims,
                                                          self._access))
                    in_batch = set(skeys)
                    evicted += delete(
                        f, [k for k in map(stored_key, *zip(*victims, strict=True))
                            if k not in in_batch] if victims else [])
                    self.counters.evicted += len(evicted)
                    victims = []
                    r = self._done(skeys, put_slots(f, self.spec, batch, self._access))
                    return r._replace(evicted=evicted)
                except lmdb.MapFullError:
                    self.counters.map_full += 1
                    log.warning("SSD map full with %d of %d bytes used (attempt %d)",
                                f.used, self.spec.capacity_bytes, attempt + 1)
                except (lmdb.Error, OSError) as exc:
                    self.counters.io_errors += 1
                    log.error("SSD write failed: %s", exc)
                    break
        refused = [(i.ns, i.key) for i in items]
        self.counters.refused += len(refused)
        return PutResult([], refused, evicted, 0)

    def _done(self, skeys: list[bytes], r: PutResult) -> PutResult:
        self._bad.difference_update(skeys)
        c = self.counters
        c.bytes_written += r.bytes_written
        c.refused += len(r.refused)
        c.evicted += len(r.evicted)
        return r

    def delete_many(self, keys: Iterable[TenantKey]) -> list[TenantKey]:
        """Delete blocks in one transaction; returns those that were stored."""
        with self._wlock:
            self._check_open()
            return delete(self._files, [stored_key(t, k) for t, k in keys])

    def delete_ns_keys(self, ns: str, keys: list[bytes]) -> None:
        """`delete_many` of one namespace's keys (an operator's evict: ~10^5 at once), the stored
        keys built with one prefix and nothing reported back."""
        head = stored_key(ns, b"\0")[:-1]
        with self._wlock:
            self._check_open()
            delete(self._files, [head + k for k in keys], report=False)

    def delete_ns(self, ns: str) -> int:
        """Deletes every block of `ns` (a whole namespace: an operator's evict) in one
        transaction, by a cursor over its keys; how many there were."""
        head = stored_key(ns, b"\0")[:-1]
        with self._wlock:
            self._check_open()
            return delete_prefix(self._files, head)

    def flush_stats(self) -> None:
        """Persist pending access counts now (the mover calls this when idle and at close)."""
        with self._wlock:
            if self._closed or not self._access:
                return
            try:
                with self._files.env.begin(write=True) as txn:
                    self._access.flush(txn, self._files.meta)
            except lmdb.Error as exc:
                log.warning("SSD access stats not persisted: %s", exc)

    # -- reads (concurrent) ------------------------------------------------------------------

    def get_into(self, ns: str, key: bytes, out: Any) -> int | None:
        """Copy a verified payload into `out` (a writable buffer); its length, or None on a miss.

        A corrupt entry is a miss: counted, deleted, never served. `out` must hold the payload;
        if it is too small the block is a miss (and is not deleted).
        """
        return self.get_many_into([(ns, key, out)])[0]

    def get_many_into(self, reads: Sequence[tuple[str, bytes, Any]]) -> list[int | None]:
        """`get_into` for a batch in one read transaction.

        Slots mode: the headers come from one LMDB snapshot, then the payloads are read with
        preadv straight into the callers' buffers (adjacent slots in one call, the kernel told
        about all runs first). "lmdb" mode: py-lmdb pre-faults each value's pages before its
        zero-copy view is copied out. Either way the payload is checksummed in `out` after the
        copy: the bytes served are the bytes verified.
        """
        f = self._files
        skeys = [stored_key(t, k) for t, k, _ in reads]
        outs = [out for _, _, out in reads]
        results: list[int | None] = [None] * len(reads)
        rejected: Rejected = []
        if self._slots is None:
            read_lmdb(f.env, f.meta, f.blocks, f.layout, self._bad, skeys, outs, results,
                      rejected)
        else:
            try:
                with self._slots.reading():
                    read_slots(f.env, f.meta, self._slots, f.layout, self._bad, skeys, outs,
                               results, rejected)
            except OSError as exc:
                self.counters.io_errors += 1
                log.error("SSD payload read failed (%d blocks missed): %s", len(reads), exc)
        for skey, reason in rejected:
            self._reject(skey, reason)
        hits = sum(r is not None for r in results)
        self.counters.hits += hits
        self.counters.misses += len(reads) - hits - len(rejected)
        return results

    def get(self, ns: str, key: bytes) -> bytes | None:
        """A verified payload as bytes (a copy), or None."""
        skey = stored_key(ns, key)
        with self._files.env.begin(db=self._files.meta) as txn:
            rec = txn.get(skey)
        if rec is None:
            self.counters.misses += 1
            return None
        buf = bytearray(max(0, _META.unpack_from(rec)[0] - HEADER_SIZE))
        n = self.get_into(ns, key, buf)
        return None if n is None else bytes(buf[:n])

    def contains(self, ns: str, key: bytes) -> bool:
        skey = stored_key(ns, key)
        if skey in self._bad:
            return False
        with self._files.env.begin(db=self._files.meta) as txn:
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
                delete(self._files, [skey])

    # -- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> SsdStats:
        c, f = self.counters, self._files
        return SsdStats(
            f.entries, f.used, self.spec.capacity_bytes, c.bytes_written, c.hits, c.misses,
            c.corrupt, c.refused, c.map_full, c.evicted,
        )

    def free_slots(self) -> int | None:
        """Slots free for new blocks now (slots mode; None in "lmdb" mode)."""
        return None if self._slots is None else self._slots.free_count()

    def __len__(self) -> int:
        return self._files.entries

    def give_back(self) -> tuple[int, int] | None:
        """After the capacity shrank: rewrites the LMDB file without its free pages (LMDB never
        shrinks a file) and reserves only the new map, so the disk the old size held is free
        again. Returns the bytes the file held on disk before and after, or None when it held
        no more than the map. Only while nothing else uses the store (at open, before
        serving); a copy that cannot be made (no room for it) is an OSError, the store left as
        it was."""
        data = os.path.join(self.spec.path, "data.mdb")
        before = os.stat(data).st_blocks * 512
        if before <= self.spec.map_size() + (1 << 20):
            return None
        self.flush_stats()
        tmp = os.path.join(self.spec.path, "compact.tmp")
        with self._wlock:
            self._check_open()
            if os.path.isdir(tmp):
                for name in os.listdir(tmp):
                    os.unlink(os.path.join(tmp, name))
            else:
                os.mkdir(tmp, 0o700)
            try:
                self._files.env.copy(tmp, compact=True)
            except lmdb.Error as exc:
                for name in os.listdir(tmp):
                    os.unlink(os.path.join(tmp, name))
                os.rmdir(tmp)
                raise OSError(str(exc)) from None
            self._files.env.close()
            if self._slots is not None:
                self._slots.close()
            os.replace(os.path.join(tmp, "data.mdb"), data)
            os.rmdir(tmp)
            self._files = open_files(self.spec)
            self._slots = self._files.slots
        return before, os.stat(data).st_blocks * 512

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
            self._files.env.close()
            if self._slots is not None:
                self._slots.close()

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Opened(NamedTuple):
    """`open_store`'s result: the store, its index rows, and where a damaged store went."""

    store: SsdStore
    entries: list[SsdEntry]
    moved_aside: str | None
    reason: str


def open_store(spec: SsdSpec, evictor: Evictor | None = None) -> Opened:
    """Opens the store and reads its index. A store that cannot be opened or read is renamed to
    `<path>.damaged-<UTC time>` and an empty one is created at `spec.path` (one ERROR line
    naming both); other errors (no disk space, no permission) are raised as they are."""
    try:
        store = SsdStore(spec, evictor)
        try:
            return Opened(store, store.entries(), None, "")
        except LMDB_DAMAGE as exc:
            store.close()
            raise DamagedStore(f"index: {exc}") from None
    except DamagedStore as exc:
        reason = str(exc)
    aside = f"{spec.path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    n = 1
    while os.path.exists(aside if n == 1 else f"{aside}.{n}"):
        n += 1
    aside = aside if n == 1 else f"{aside}.{n}"
    os.rename(spec.path, aside)
    log.error("SSD store %s cannot be opened (%s); moved it aside to %s and created an empty "
              "store at %s", spec.path, reason, aside, spec.path)
    store = SsdStore(spec, evictor)
    return Opened(store, store.entries(), aside, reason)
