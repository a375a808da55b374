"""SSD tier: a crash-safe, capacity-bounded block store indexed by LMDB.

Sub-databases of one LMDB environment, always changed in the same transaction:

    meta    stored key -> size, access count, last access, stored-at, payload slot, parent key,
            and the block's 64-byte header (kvtier.blockfmt)                   (the SSD index)
    blocks  stored key -> payload (payload mode "lmdb" only)
    info    b"format" / b"layout" / b"mode" / b"used" -> store format, layout digest,
            payload mode and slot size, used bytes

A stored key is `len(tenant) | tenant utf-8 | block key`, so tenants never share entries.

Where payloads live (`SsdSpec.payload`, measured in docs/ARCHITECTURE.md "## Storage tiers"):
    "slots"  a preallocated file of fixed-size slots (`kvtier.ssd_slots`), written with pwritev
             and read with pread; LMDB holds only the index. The default whenever the spec
             names a `slot_size` (payloads up to that size; larger ones are refused).
    "lmdb"   inside LMDB values (overflow pages); any payload size.

Crash safety. "lmdb": a batch of puts is one LMDB transaction, visible whole at commit or not at
all. "slots": a batch's payloads are written into slots no committed entry references, the slot
file is fdatasynced, and only then is the transaction that references them (slot, length,
checksum in the header) committed; a crash before the commit leaves the slots unreferenced, and
the free set is rebuilt from the index at open. A delete commits first and frees its slots after
(through a reader quarantine, see `kvtier.ssd_slots`). Either way a crash (SIGKILL, power loss)
never leaves a partially written block readable. Durability modes (`SsdSpec.durability`):
    "sync"        fsync data and meta page at each commit: a commit that returned survives a crash.
    "nometasync"  (default) data fsynced, meta page not: a power loss can undo the last committed
                  transaction (never corrupt); a process crash loses nothing committed.
    "nosync"      no fsync; the OS flushes. A process crash loses nothing committed; a power loss
                  may lose recent transactions (the headers' checksums catch a payload lost then).

Reads verify everything (header checksum, format, layout digest, key digest, length, payload
checksum of the bytes actually served); a mismatch is a miss, a counter and the entry deleted.

Capacity: `capacity_bytes` bounds the stored bytes (headers included); in slots mode also the
slot count. The slot file (and with `writemap=True` the LMDB map) is reserved on disk at open,
so a full disk is a clean error at open, never a SIGBUS or ENOSPC in a write. A put that would
exceed the capacity asks the `evictor` callback for victims (leaf-first from the prefix index);
what still does not fit is refused. `lmdb.MapFullError` never escapes.

Format: `STORE_FORMAT` 3 (a slot number in every index record). A store of another format, layout
or payload mode (an older kvtier, a changed slot size) is discarded at open with one warning: its
files are deleted and recreated empty — it is a cache, and nothing in it could be served.

Threading: one writer at a time — writes (`put_many`, `delete_many`, `flush_stats`) are
serialized by an internal lock and are meant to come from the mover's writer thread; reads
(`get_into`, `get_many_into`, `get`, `contains`) run concurrently from any thread and never
block on writers. The `evictor` runs on the writing thread with no store lock held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import lmdb

from kvtier import blockfmt
from kvtier.errors import UsageError
from kvtier.ssd_open import U64 as _U64
from kvtier.ssd_open import discard, open_env, stale_reason
from kvtier.ssd_open import preallocate as _preallocate
from kvtier.ssd_read import META as _META
from kvtier.ssd_read import Rejected, read_lmdb, read_slots, record
from kvtier.ssd_slots import SlotFile
from kvtier.ssd_types import (
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

__all__ = [
    "STORE_FORMAT", "Durability", "Evictor", "PayloadMode", "PutItem", "PutResult", "SsdEntry",
    "SsdSpec", "SsdStats", "SsdStore", "TenantKey", "split_key", "stored_key",
]

log = logging.getLogger(__name__)

STORE_FORMAT = 3
SLOT_FILE = "slots.dat"
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
        self._layout = blockfmt.layout_digest(spec.layout_fingerprint)
        mode_tag = b"slots:%d" % spec.slot_size if self.mode == "slots" else b"lmdb"
        self._identity = {b"format": _U64.pack(STORE_FORMAT), b"layout": self._layout,
                          b"mode": mode_tag}
        os.makedirs(spec.path, mode=0o700, exist_ok=True)
        self._env = open_env(spec)
        stale = stale_reason(self._env, self._identity, STORE_FORMAT)
        if stale:
            log.warning("SSD store %s: %s; discarding it and starting empty", spec.path, stale)
            self._env.close()
            discard(spec.path)
            self._env = open_env(spec)
        self._slots: SlotFile | None = None
        try:
            if spec.writemap:
                _preallocate(os.path.join(spec.path, "data.mdb"), spec.map_size())
            if self.mode == "slots":
                self._slots = SlotFile(os.path.join(spec.path, SLOT_FILE), spec.slot_size,
                                       spec.slot_count())
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
        self.counters = Counters()
        self._closed = False
        self._used, self._entries = self._open_info()

    def _open_info(self) -> tuple[int, int]:
        """Used bytes and entry count; in slots mode also the free set, rebuilt from the index
        (a read transaction; a write one only for a new store or entries naming a bad slot)."""
        with self._env.begin(buffers=True) as txn:
            new = txn.get(b"format", db=self._info) is None
            used = _U64.unpack(txn.get(b"used", db=self._info) or _U64.pack(0))[0]
            entries = txn.stat(self._meta)["entries"]
            doomed = self._claim_slots(txn) if self._slots is not None else []
        if new or doomed:
            with self._env.begin(write=True) as txn:
                for k, v in self._identity.items():
                    txn.put(k, v, db=self._info)
                for skey, size in doomed:
                    txn.delete(skey, db=self._meta)
                    used -= size
                    entries -= 1
                txn.put(b"used", _U64.pack(used), db=self._info)
        return used, entries

    def _claim_slots(self, txn: Any) -> list[tuple[bytes, int]]:
        """Mark every slot named by the index used; entries naming a bad or shared slot."""
        assert self._slots is not None
        mark = self._slots.mark_used
        unpack = _META.unpack_from
        doomed: list[tuple[bytes, int]] = []
        for skey, rec in txn.cursor(db=self._meta).iternext(keys=True, values=True):
            size, _, _, _, _, slot = unpack(rec)
            if not mark(slot):
                doomed.append((bytes(skey), size))
        if doomed:
            log.warning("SSD store %s: %d entries named a slot out of range or already used; "
                        "dropped", self.spec.path, len(doomed))
        return doomed

    # -- the persistent index --------------------------------------------------------------

    def entries(self) -> list[SsdEntry]:
        """Every stored block's index row, from the meta sub-database only (no payload reads)."""
        out: list[SsdEntry] = []
        unpack = _META.unpack_from
        hsize = _META.size
        with self._env.begin(db=self._meta) as txn:
            for skey, rec in txn.cursor().iternext(keys=True, values=True):
                size, count, last, stored_at, plen, _slot = unpack(rec)
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
        """Store a batch (one index transaction). Never raises for a full store: it refuses.

        The evictor is called before the write lock is taken (no store lock held), so it may
        take the daemon's index lock without a lock-order inversion. Payloads may be any
        C-contiguous buffer (bytes, numpy arrays of any dtype); they are stored as raw bytes.
        In slots mode a payload larger than the slot size is refused.
        """
        self._check_open()
        items = [i._replace(payload=_raw_bytes(i.payload)) for i in items]
        skeys = [stored_key(i.tenant, i.key) for i in items]
        sizes = [HEADER_SIZE + i.payload.nbytes for i in items]
        fresh = self._fresh(skeys)
        need = sum(s for s, f in zip(sizes, fresh, strict=True) if f)
        victims: list[TenantKey] = []
        evicted: list[TenantKey] = []  # slots mode: deleted (committed) before the puts
        for attempt in range(2):
            # a retry after MapFullError asks for room for the batch twice over
            over = self._used + need * (1 + attempt) - self.spec.capacity_bytes
            if self._slots is not None:
                short = sum(fresh) * (1 + attempt) - self._slots.free_count()
                over = max(over, short * (self.spec.slot_size + HEADER_SIZE))
            if over > 0 and self.evictor is not None:
                victims.extend(self.evictor(over))
            with self._wlock:
                self._check_open()
                try:
                    if self._slots is None:
                        return self._put_lmdb(items, skeys, sizes, victims)
                    batch = set(skeys)
                    evicted += self._delete_locked(
                        [k for k in map(stored_key, *zip(*victims, strict=True)) if k not in batch]
                        if victims else [])
                    self.counters.evicted += len(evicted)
                    victims = []
                    r = self._put_slots(items, skeys, sizes)
                    return r._replace(evicted=evicted)
                except lmdb.MapFullError:
                    self.counters.map_full += 1
                    log.warning("SSD map full with %d of %d bytes used (attempt %d)",
                                self._used, self.spec.capacity_bytes, attempt + 1)
                except (lmdb.Error, OSError) as exc:
                    self.counters.io_errors += 1
                    log.error("SSD write failed: %s", exc)
                    break
        refused = [(i.tenant, i.key) for i in items]
        self.counters.refused += len(refused)
        return PutResult([], refused, evicted, 0)

    def _put_lmdb(
        self,
        items: Sequence[PutItem],
        skeys: list[bytes],
        sizes: list[int],
        victims: list[TenantKey],
    ) -> PutResult:
        """Payload mode "lmdb": victims, payloads and index rows in one transaction."""
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
                txn.put(skey, record(size, now, -1, item.parent, header), db=self._meta)
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
        return self._done(skeys, stored, refused, evicted, written)

    def _put_slots(
        self, items: Sequence[PutItem], skeys: list[bytes], sizes: list[int]
    ) -> PutResult:
        """Payload mode "slots": write free slots, sync them, then commit the rows naming them."""
        assert self._slots is not None
        slots = self._slots
        fresh = self._fresh(skeys)
        used = self._used
        todo: list[int] = []
        cap = self.spec.capacity_bytes
        for i, (item, size, is_new) in enumerate(zip(items, sizes, fresh, strict=True)):
            if is_new and item.payload.nbytes <= slots.slot_size and used + size <= cap:
                todo.append(i)
                used += size
        got = slots.allocate(len(todo))
        todo = todo[: len(got)]
        placed = dict(zip(todo, got, strict=True))
        now = time.time()
        try:
            payloads = [items[i].payload for i in todo]
            headers = [blockfmt.encode_header(skeys[i], self._layout, p)
                       for i, p in zip(todo, payloads, strict=True)]
            slots.write(got, payloads)
            if self.spec.durability != "nosync":
                slots.sync()
            with self._env.begin(write=True) as txn:
                for i, header in zip(todo, headers, strict=True):
                    rec = record(sizes[i], now, placed[i], items[i].parent, header)
                    txn.put(skeys[i], rec, db=self._meta)
                self._flush_access(txn)
                used = self._used + sum(sizes[i] for i in todo)
                txn.put(b"used", _U64.pack(used), db=self._info)
        except BaseException:
            slots.release(got)
            raise
        self._used, self._entries = used, self._entries + len(todo)
        keys = [(it.tenant, it.key) for it in items]
        stored = [tk for i, tk in enumerate(keys) if i in placed or not fresh[i]]
        refused = [tk for i, tk in enumerate(keys) if fresh[i] and i not in placed]
        return self._done(skeys, stored, refused, [], sum(sizes[i] for i in todo))

    def _done(self, skeys: list[bytes], stored: list[TenantKey], refused: list[TenantKey],
              evicted: list[TenantKey], written: int) -> PutResult:
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
            size, old, _last, stored_at, plen, slot = _META.unpack_from(rec)
            head = _META.pack(size, old + count, last, stored_at, plen, slot)
            txn.put(skey, head + bytes(rec[_META.size :]), db=self._meta)

    def delete_many(self, keys: Iterable[TenantKey]) -> list[TenantKey]:
        """Delete blocks in one transaction; returns those that were stored."""
        with self._wlock:
            self._check_open()
            return self._delete_locked([stored_key(t, k) for t, k in keys])

    def _delete_locked(self, skeys: list[bytes]) -> list[TenantKey]:
        """Commit the removals, then (slots mode) hand their slots to the reader quarantine."""
        removed: list[TenantKey] = []
        freed: list[int] = []
        if not skeys:
            return removed
        try:
            with self._env.begin(write=True) as txn:
                used, entries = self._used, self._entries
                for skey in skeys:
                    rec = txn.get(skey, db=self._meta)
                    if self._slots is None:
                        txn.delete(skey, db=self._blocks)
                    if rec is not None:
                        txn.delete(skey, db=self._meta)
                        size, *_, slot = _META.unpack_from(rec)
                        used -= size
                        entries -= 1
                        freed.append(slot)
                        removed.append(split_key(skey))
                txn.put(b"used", _U64.pack(used), db=self._info)
        except lmdb.Error as exc:
            log.error("SSD delete failed: %s", exc)
            return []
        self._used, self._entries = used, entries
        if self._slots is not None:
            self._slots.retire(freed)
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

        Slots mode: the headers come from one LMDB snapshot, then the payloads are read with
        preadv straight into the callers' buffers (adjacent slots in one call, the kernel told
        about all runs first). "lmdb" mode: py-lmdb pre-faults each value's pages before its
        zero-copy view is copied out. Either way the payload is checksummed in `out` after the
        copy: the bytes served are the bytes verified.
        """
        skeys = [stored_key(t, k) for t, k, _ in reads]
        outs = [out for _, _, out in reads]
        results: list[int | None] = [None] * len(reads)
        rejected: Rejected = []
        if self._slots is None:
            read_lmdb(self._env, self._meta, self._blocks, self._layout, self._bad, skeys, outs,
                      results, rejected)
        else:
            try:
                with self._slots.reading():
                    read_slots(self._env, self._meta, self._slots, self._layout, self._bad,
                               skeys, outs, results, rejected)
            except OSError as exc:
                self.counters.io_errors += 1
                log.error("SSD payload read failed (%d blocks missed): %s", len(reads), exc)
        for skey, reason in rejected:
            self._reject(skey, reason)
        hits = sum(r is not None for r in results)
        self.counters.hits += hits
        self.counters.misses += len(reads) - hits - len(rejected)
        return results

    def get(self, tenant: str, key: bytes) -> bytes | None:
        """A verified payload as bytes (a copy), or None."""
        skey = stored_key(tenant, key)
        with self._env.begin(db=self._meta) as txn:
            rec = txn.get(skey)
        if rec is None:
            self.counters.misses += 1
            return None
        buf = bytearray(max(0, _META.unpack_from(rec)[0] - HEADER_SIZE))
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

    def free_slots(self) -> int | None:
        """Slots free for new blocks now (slots mode; None in "lmdb" mode)."""
        return None if self._slots is None else self._slots.free_count()

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
            if self._slots is not None:
                self._slots.close()

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
