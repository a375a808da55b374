"""The SSD store's write transactions: a put batch per payload mode, deletes, access counts.

    put_lmdb   victims, payloads and index rows in one LMDB transaction
    put_slots  payloads into free slots, fdatasync (unless "nosync"), then one transaction with
               the rows naming them; on any failure the slots go back to the free set
    delete     one transaction, then (slots mode) the freed slots to the reader quarantine

Each updates `StoreFiles.used` / `.entries` only after its transaction committed, so a failed
write changes nothing. The store's policy (eviction before a put, retries, counters, the set of
rejected keys) is `kvtier.tiers.ssd.store.SsdStore`'s; it calls these with its write lock held.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import lmdb

from kvtier.tiers import blockfmt
from kvtier.tiers.ssd.files import U64, StoreFiles
from kvtier.tiers.ssd.read import META, record
from kvtier.tiers.ssd.types import PutItem, PutResult, SsdSpec, TenantKey, split_key, stored_key

log = logging.getLogger("kvtier.tiers.ssd.store")  # the store's messages come from one logger


class Batch(NamedTuple):
    """A put batch as the store prepared it."""

    items: Sequence[PutItem]  # payloads as flat byte views
    skeys: list[bytes]  # stored keys
    sizes: list[int]  # stored bytes, header included


class PendingAccess:
    """Access counts not yet persisted: recorded from any thread, written into the next write
    transaction (lost if the process dies first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[int, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def record(self, skey: bytes, now: float) -> None:
        with self._lock:
            count, _ = self._pending.get(skey, (0, 0.0))
            self._pending[skey] = (count + 1, now)

    def flush(self, txn: Any, meta: Any) -> None:
        """Adds the counts to the rows still stored, inside the caller's write transaction."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for skey, (count, last) in pending.items():
            rec = txn.get(skey, db=meta)
            if rec is None:
                continue
            size, old, _last, stored_at, plen, slot = META.unpack_from(rec)
            head = META.pack(size, old + count, last, stored_at, plen, slot)
            txn.put(skey, head + bytes(rec[META.size :]), db=meta)


def fresh(f: StoreFiles, skeys: list[bytes]) -> list[bool]:
    """Which keys are not stored yet (a key repeated within the batch counts once)."""
    seen: set[bytes] = set()
    out: list[bool] = []
    with f.env.begin(db=f.meta) as rtxn:
        for k in skeys:
            out.append(k not in seen and rtxn.get(k) is None)
            seen.add(k)
    return out


def put_lmdb(
    f: StoreFiles, spec: SsdSpec, b: Batch, victims: list[TenantKey], access: PendingAccess,
) -> PutResult:
    """Payload mode "lmdb": victims, payloads and index rows in one transaction."""
    cap = spec.capacity_bytes
    is_fresh = fresh(f, b.skeys)
    stored: list[TenantKey] = []
    refused: list[TenantKey] = []
    evicted: list[TenantKey] = []
    written = 0
    now = time.time()
    txn = f.env.begin(write=True)
    try:
        used = f.used
        entries = f.entries
        batch = set(b.skeys)
        for ns, key in victims:
            vkey = stored_key(ns, key)
            if vkey in batch:
                continue
            rec = txn.get(vkey, db=f.meta)
            if rec is None:
                continue
            txn.delete(vkey, db=f.blocks)
            txn.delete(vkey, db=f.meta)
            used -= META.unpack_from(rec)[0]
            entries -= 1
            evicted.append((ns, key))
        for item, skey, size, is_new in zip(b.items, b.skeys, b.sizes, is_fresh, strict=True):
            tk = (item.ns, item.key)
            if not is_new:
                stored.append(tk)
                continue
            if used + size > cap:
                refused.append(tk)
                continue
            header = blockfmt.encode_header(skey, f.layout, item.payload)
            txn.put(skey, item.payload, db=f.blocks)
            txn.put(skey, record(size, now, -1, item.parent, header), db=f.meta)
            used += size
            entries += 1
            written += size
            stored.append(tk)
        access.flush(txn, f.meta)
        txn.put(b"used", U64.pack(used), db=f.info)
        txn.commit()
    except BaseException:
        txn.abort()
        raise
    f.used, f.entries = used, entries
    return PutResult(stored, refused, evicted, written)


def put_slots(f: StoreFiles, spec: SsdSpec, b: Batch, access: PendingAccess) -> PutResult:
    """Payload mode "slots": write free slots, sync them, then commit the rows naming them."""
    assert f.slots is not None
    slots, items, skeys, sizes = f.slots, b.items, b.skeys, b.sizes
    is_fresh = fresh(f, skeys)
    used = f.used
    todo: list[int] = []
    for i, (item, size, is_new) in enumerate(zip(items, sizes, is_fresh, strict=True)):
        if is_new and item.payload.nbytes <= slots.slot_size and used + size <= spec.capacity_bytes:
            todo.append(i)
            used += size
    got = slots.allocate(len(todo))
    todo = todo[: len(got)]
    placed = dict(zip(todo, got, strict=True))
    written = sum(sizes[i] for i in todo)
    now = time.time()
    try:
        payloads = [items[i].payload for i in todo]
        headers = [blockfmt.encode_header(skeys[i], f.layout, p)
                   for i, p in zip(todo, payloads, strict=True)]
        slots.write(got, payloads)
        if spec.durability != "nosync":
            slots.sync()
        with f.env.begin(write=True) as txn:
            for i, header in zip(todo, headers, strict=True):
                txn.put(skeys[i], record(sizes[i], now, placed[i], items[i].parent, header),
                        db=f.meta)
            access.flush(txn, f.meta)
            txn.put(b"used", U64.pack(f.used + written), db=f.info)
    except BaseException:
        slots.release(got)
        raise
    f.used, f.entries = f.used + written, f.entries + len(todo)
    keys = [(it.ns, it.key) for it in items]
    stored = [tk for i, tk in enumerate(keys) if i in placed or not is_fresh[i]]
    refused = [tk for i, tk in enumerate(keys) if is_fresh[i] and i not in placed]
    return PutResult(stored, refused, [], written)


def delete_prefix(f: StoreFiles, prefix: bytes) -> int:
    """Deletes every entry whose stored key starts with `prefix` (one namespace's: an operator's
    evict of a whole namespace) in one transaction, walking each sub-database with a cursor from
    the prefix on (no search per key); how many index entries went (0 on an LMDB error:
    nothing changed). Slots mode: their slots go to the reader quarantine after the commit."""
    freed: list[int] = []
    unpack = META.unpack_from
    try:
        with f.env.begin(write=True) as txn:
            used, entries = f.used, f.entries
            dbs = [f.meta] if f.slots is not None else [f.meta, f.blocks]
            for db in dbs:
                cur = txn.cursor(db=db)
                more = cur.set_range(prefix)
                while more and cur.key().startswith(prefix):
                    if db is f.meta:
                        size, *_, slot = unpack(cur.value())
                        used -= size
                        entries -= 1
                        freed.append(slot)
                    more = cur.delete()  # moves to the next entry
            txn.put(b"used", U64.pack(used), db=f.info)
    except lmdb.Error as exc:
        log.error("SSD delete failed: %s", exc)
        return 0
    gone = f.entries - entries
    f.used, f.entries = used, entries
    if f.slots is not None:
        f.slots.retire(freed)
    return gone


def delete(f: StoreFiles, skeys: list[bytes], report: bool = True) -> list[TenantKey]:
    """Commits the removals, then (slots mode) hands their slots to the reader quarantine;
    returns the keys that were stored ([] on an LMDB error: nothing changed; [] too without
    `report`). Keys go in sorted order: each B-tree page is copied once per transaction, not
    once per key (an operator's evict deletes ~10^5 at once)."""
    removed: list[TenantKey] = []
    freed: list[int] = []
    if not skeys:
        return removed
    blocks, meta = (None if f.slots is not None else f.blocks), f.meta
    unpack = META.unpack_from
    try:
        with f.env.begin(write=True) as txn:
            used, entries = f.used, f.entries
            pop, drop = txn.pop, txn.delete
            for skey in sorted(skeys):
                rec = pop(skey, db=meta)  # the record, deleted: one call
                if blocks is not None:
                    drop(skey, db=blocks)
                if rec is not None:
                    size, *_, slot = unpack(rec)
                    used -= size
                    entries -= 1
                    freed.append(slot)
                    if report:
                        with contextlib.suppress(UnicodeDecodeError):  # an undecodable entry
                            removed.append(split_key(skey))
            txn.put(b"used", U64.pack(used), db=f.info)
    except lmdb.Error as exc:
        log.error("SSD delete failed: %s", exc)
        return []
    f.used, f.entries = used, entries
    if f.slots is not None:
        f.slots.retire(freed)
    return removed
