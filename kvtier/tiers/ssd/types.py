"""The SSD store's spec, keys and result types (re-exported by `kvtier.tiers.ssd.store`). Pure, no
I/O."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvtier.core.errors import UsageError
from kvtier.tiers.ssd.slots import PAGE, stride_of

Durability = Literal["sync", "nometasync", "nosync"]
PayloadMode = Literal["auto", "slots", "lmdb"]
TenantKey = tuple[str, bytes]
Evictor = Callable[[int], Sequence[TenantKey]]
"""Given bytes to free, return victims (ns, key) to delete, leaf-first. Runs on the writer."""

HEADER_SIZE = 64  # kvtier.tiers.blockfmt.HEADER_SIZE (asserted in kvtier.tiers.ssd.store)


def stored_key(ns: str, key: bytes) -> bytes:
    t = ns.encode()
    if len(t) > 255:
        raise UsageError("namespace name longer than 255 bytes")
    if not 1 <= len(key) <= 200:
        raise UsageError(f"block key must be 1..200 bytes, got {len(key)}")
    return bytes((len(t),)) + t + key


def split_key(skey: bytes) -> TenantKey:
    n = skey[0]
    return skey[1 : 1 + n].decode(), skey[1 + n :]


@dataclass(frozen=True)
class SsdSpec:
    """Where and how the store keeps blocks.

    `payload` says where payload bytes live: "slots" (a preallocated file of `slot_size`-byte
    slots indexed by LMDB; payloads larger than `slot_size` are refused), "lmdb" (inside LMDB
    values; any size), or "auto" (the default): "slots" when `slot_size > 0`, else "lmdb".
    In slots mode the store holds `capacity_bytes // (slot_size + 64)` blocks.
    """

    path: str
    capacity_bytes: int
    layout_fingerprint: bytes
    durability: Durability = "nometasync"
    writemap: bool = False
    map_headroom: float = 0.25
    max_readers: int = 126
    payload: PayloadMode = "auto"
    slot_size: int = 0

    def mode(self) -> Literal["slots", "lmdb"]:
        if self.payload == "auto":
            return "slots" if self.slot_size > 0 else "lmdb"
        return self.payload

    def slot_count(self) -> int:
        return self.capacity_bytes // (self.slot_size + HEADER_SIZE) if self.slot_size > 0 else 0

    def map_size(self) -> int:
        if self.mode() == "slots":
            # index only: key, parent, header and counters, < 1 KiB per block with B-tree slack
            raw = self.slot_count() * 2048 + (64 << 20)
        else:
            raw = int(self.capacity_bytes * (1 + self.map_headroom)) + (64 << 20)
        return (raw + PAGE - 1) // PAGE * PAGE

    def slot_file_bytes(self) -> int:
        return self.slot_count() * stride_of(self.slot_size) if self.mode() == "slots" else 0

    def disk_bytes(self) -> int:
        """Bytes the store reserves on disk at open: the LMDB map and the slot file. In "lmdb"
        mode that is capacity x (1 + map_headroom) + 64 MiB, rounded up to a page."""
        return self.map_size() + self.slot_file_bytes()


class SsdEntry(NamedTuple):
    """One row of the persistent SSD index (read at start without touching payloads)."""

    ns: str
    key: bytes
    parent: bytes | None
    size: int  # stored bytes, header included
    access_count: int
    last_access: float
    stored_at: float


class PutItem(NamedTuple):
    ns: str
    key: bytes
    parent: bytes | None
    payload: Any  # any buffer


class PutResult(NamedTuple):
    stored: list[TenantKey]  # now on SSD (newly written, or already there: payloads are immutable)
    refused: list[TenantKey]  # did not fit (capacity, slot size or map full) or I/O failed
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
class Counters:
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    refused: int = 0
    map_full: int = 0
    evicted: int = 0
    io_errors: int = 0
    undecodable: int = 0  # index entries skipped (and deleted) because they could not be decoded
    corrupt_by_reason: dict[str, int] = field(default_factory=dict)
