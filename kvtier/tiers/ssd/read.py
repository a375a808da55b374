"""Verified reads for the SSD store, one function per payload mode (called by `SsdStore`).

Both fill the callers' buffers and then checksum the bytes in those buffers, so what is served
is exactly what was verified. A block failing any check is appended to `rejected` (the store
counts and deletes it); a buffer too small for its block is a plain miss. `results[i]` becomes
the payload length of read `i` when served.
"""

from __future__ import annotations

import struct
from collections.abc import Container, Sequence
from typing import Any

import numpy as np

from kvtier.tiers import blockfmt
from kvtier.tiers.blockfmt import BlockCorrupt, Corruption
from kvtier.tiers.ssd.slots import SlotFile

META = struct.Struct("<QQddBq")  # size, access count, last access, stored at, parent len, slot
HEADER_SIZE = blockfmt.HEADER_SIZE
Rejected = list[tuple[bytes, Corruption]]


def record(size: int, now: float, slot: int, parent: bytes | None, header: bytes) -> bytes:
    """An index record: META fields, the parent key, then the 64-byte block header."""
    parent = parent or b""
    return META.pack(size, 1, now, now, len(parent), slot) + parent + header


def read_lmdb(
    env: Any, meta_db: Any, blocks_db: Any, layout: bytes, bad: Container[bytes],
    skeys: Sequence[bytes], outs: Sequence[Any], results: list[int | None], rejected: Rejected,
) -> None:
    """Payloads inside LMDB values: py-lmdb pre-faults each value's pages (GIL released) before
    its zero-copy view is copied into the caller's buffer; one read transaction per batch."""
    with env.begin(buffers=True) as txn:
        for i, (skey, out) in enumerate(zip(skeys, outs, strict=True)):
            if skey in bad:
                continue
            rec = txn.get(skey, db=meta_db)
            if rec is None:
                continue
            value = txn.get(skey, db=blocks_db)
            try:
                if value is None or len(rec) < META.size + HEADER_SIZE:
                    raise BlockCorrupt(Corruption.SHORT)
                header = rec[len(rec) - HEADER_SIZE :]
                n = len(value)
                csum = blockfmt.check_header(skey, layout, header, HEADER_SIZE + n)
                dst = np.frombuffer(out, np.uint8)
                if n > dst.nbytes:
                    continue
                np.copyto(dst[:n], np.frombuffer(value, dtype=np.uint8))
                if blockfmt.payload_checksum(dst[:n].data) != csum:
                    raise BlockCorrupt(Corruption.PAYLOAD_CHECKSUM)
                results[i] = n
            except BlockCorrupt as exc:
                rejected.append((skey, exc.reason))


def read_slots(
    env: Any, meta_db: Any, slots: SlotFile, layout: bytes, bad: Container[bytes],
    skeys: Sequence[bytes], outs: Sequence[Any], results: list[int | None], rejected: Rejected,
) -> None:
    """Payloads in the slot file: headers from one LMDB snapshot, then preadv of every slot
    straight into its buffer, in file order, each checksummed as soon as it is in (while the
    kernel reads ahead). Call inside `slots.reading()`. Raises OSError on an I/O error (the
    reads verified before it keep their results)."""
    plan: list[tuple[int, int, np.ndarray, int]] = []  # read index, slot, destination, checksum
    with env.begin(buffers=True, db=meta_db) as txn:
        for i, (skey, out) in enumerate(zip(skeys, outs, strict=True)):
            if skey in bad:
                continue
            rec = txn.get(skey)
            if rec is None:
                continue
            try:
                if len(rec) < META.size + HEADER_SIZE:
                    raise BlockCorrupt(Corruption.SHORT)
                size, *_, slot = META.unpack_from(rec)
                n = size - HEADER_SIZE
                csum = blockfmt.check_header(skey, layout, rec[len(rec) - HEADER_SIZE :], size)
                if not 0 <= slot < slots.nslots or n > slots.slot_size:
                    raise BlockCorrupt(Corruption.LENGTH)
            except BlockCorrupt as exc:
                rejected.append((skey, exc.reason))
                continue
            dst = np.frombuffer(out, np.uint8)
            if n <= dst.nbytes:
                plan.append((i, slot, dst[:n], csum))

    def verify(j: int) -> None:
        i, _, dst, csum = plan[j]
        if blockfmt.payload_checksum(dst.data) != csum:
            rejected.append((skeys[i], Corruption.PAYLOAD_CHECKSUM))
        else:
            results[i] = dst.nbytes

    slots.read_into([(slot, dst.data) for _, slot, dst, _ in plan], verify)
