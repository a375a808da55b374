"""The keep file and adoption of a kept DRAM pool, in-process (`kvtier.tiers.dram_keep`,
`DramPool` with `keep`, `PageTable.adopt`). The real daemons' restarts are
tests/test_daemon_keep.py; here the parts a daemon cannot be steered into at will: page moves
between the records, a torn record, another tenant's record in a region, page tables rebuilt
exactly."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.dram import DramPool, DramSpec
from kvtier.tiers.dram_keep import (
    BODY,
    BODY_AT,
    NAME,
    Keeper,
    KeepFile,
    keep_path,
    token_key,
)
from kvtier.tiers.dram_pages import PageTable
from kvtier.tiers.dram_regions import TenantShare

KiB = 1 << 10


@pytest.mark.parametrize("seed", range(40))
def test_adopted_page_table_is_the_live_one(seed: int) -> None:
    """A table rebuilt from the allocated slots and their classes has the same pages, classes,
    slots, locations and room as the one that allocated them (link rows and rows wider than a
    page included)."""
    rng = random.Random(seed)
    pb = rng.choice([64 * KiB, 96 * KiB, 128 * KiB])
    live = PageTable(pb, rng.randint(2, 24), 4096)
    classes = [live.stride_for(n) for n in (4096, 8192, 20000, 70000, 150000, 300000)
               if n <= pb * live.page_count]
    held: dict[int, int] = {}
    for _ in range(rng.randint(1, 80)):
        c = rng.choice(classes)
        for s in live.alloc_many(rng.randint(1, 4), c) or []:
            held[s] = c
        if held and rng.random() < 0.4:
            s = rng.choice(list(held))
            live.free(s)
            del held[s]
    table = PageTable(pb, live.page_count, 4096)
    assert table.adopt(held) == []
    assert table.classes() == live.classes() and table.free_pages == live.free_pages
    assert [table.location(s) for s in sorted(held)] == [live.location(s) for s in sorted(held)]
    assert all(table.room(c) == live.room(c) for c in classes)


def test_adopt_leaves_out_slots_that_are_no_row_of_their_page() -> None:
    t = PageTable(64 * KiB, 4, 4096)
    ids = t.ids_per_page
    bad_row = 4  # a 16 KiB class has 4 rows a page: its row j=4 would start on page 1
    got = t.adopt({0: 16 * KiB, bad_row: 16 * KiB, ids: 8 * KiB, ids + 1: 16 * KiB})
    assert got == [bad_row, ids + 1]  # and a second class on page 1 is refused
    assert t.used == 2 and t.is_allocated(0) and t.is_allocated(ids)


def spec(tmp: Path, **kw: object) -> DramSpec:
    return DramSpec(name="pool", slot_size=16 * KiB, slot_count=64, shm_dir=str(tmp),
                    max_block=256 * KiB, page_bytes=128 * KiB, keep=True, **kw)  # type: ignore


def block(key: bytes, n: int) -> np.ndarray:
    return np.frombuffer((key * -(-n // len(key)))[:n], dtype=np.uint8)


def put(pool: DramPool, key: bytes, n: int, tenant: str = "default") -> int:
    slot = pool.alloc(pool.class_bytes(n, tenant))
    assert slot is not None
    pool.write(slot, block(key, n))
    pool.record(slot, tenant, b"L" * 32, key, None, n)
    return slot


def test_named_pool_is_adopted_with_moved_blocks_where_they_moved(tmp_path: Path) -> None:
    pool = DramPool(spec(tmp_path))
    small = {bytes([i]) * 32: put(pool, bytes([i]) * 32, 16 * KiB) for i in range(10)}
    big = put(pool, b"B" * 32, 200 * KiB)
    gone = put(pool, b"G" * 32, 16 * KiB)
    pool.free(gone)  # freed: its record cleared first
    # empty a page of the small class: its blocks move to free slots of the class elsewhere
    for s in list(small.values())[:3]:
        pool.free(s)
    for k in list(small)[:3]:
        del small[k]
    moved: dict[int, int] = {}
    assert pool.evacuate(16 * KiB, lambda s: True, lambda a, b: moved.__setitem__(a, b)) > 0
    small = {k: moved.get(s, s) for k, s in small.items()}
    generation = pool.generation
    pool.close(keep=True)
    assert os.path.exists(tmp_path / "pool") and os.path.exists(keep_path(str(tmp_path / "pool")))

    again = DramPool(spec(tmp_path), Keeper(adopt=True))
    try:
        kept = again.adopted
        assert kept is not None and again.generation == generation
        got = {b.key: b.slot for b in kept.blocks}
        assert got == {**small, b"B" * 32: big}
        for key, slot in got.items():
            n = 200 * KiB if key == b"B" * 32 else 16 * KiB
            assert np.array_equal(again.view(slot, n), block(key, n))
        assert again.stats().slots_used == len(got)
    finally:
        again.close()
    assert not os.path.exists(tmp_path / "pool")


def test_a_torn_record_is_not_adopted(tmp_path: Path) -> None:
    """A kill between a record's fields and its COMMITTED byte: the block is not adopted (its
    slot is free), never half-adopted."""
    pool = DramPool(spec(tmp_path))
    whole = put(pool, b"W" * 32, 16 * KiB)
    torn = pool.alloc(16 * KiB)
    assert torn is not None and pool.keep is not None
    keep = pool.keep
    at = keep._at(torn)
    BODY.pack_into(keep.mm, at + BODY_AT, 32, 0, 7, 16 * KiB, 16 * KiB, b"L" * 32, b"T" * 32,
                   bytes(32), b"default".ljust(64, b"\0"))  # the fields, not the state byte
    nowhere = 3 * pool.pages.ids_per_page + 5  # no row of a 48 KiB class starts there
    keep.commit(nowhere, 48 * KiB, 48 * KiB, "default", b"L" * 32, b"N" * 32, None)
    pool.close(keep=True)
    again = DramPool(spec(tmp_path), Keeper(adopt=True))
    try:
        assert again.adopted is not None
        assert [b.slot for b in again.adopted.blocks] == [whole]
        assert not again.is_allocated(torn) and not again.is_allocated(nowhere)
        assert again.kept_blocks() == 1  # the record left out is cleared, not kept for later
    finally:
        again.close()


def test_a_pool_of_another_shape_or_format_is_refused_and_removed(tmp_path: Path) -> None:
    pool = DramPool(spec(tmp_path))
    put(pool, b"A" * 32, 16 * KiB)
    pool.close(keep=True)
    other = DramPool(DramSpec(name="pool", slot_size=16 * KiB, slot_count=128,
                              shm_dir=str(tmp_path), max_block=256 * KiB,
                              page_bytes=128 * KiB, keep=True), Keeper(adopt=True))
    try:
        assert other.adopted is None and "the kept pool has" in other.cold
        assert other.stats().slots_used == 0
    finally:
        other.close(keep=True)
    fd = os.open(keep_path(str(tmp_path / "pool")), os.O_RDWR)
    os.pwrite(fd, (7).to_bytes(4, "little"), 8)
    os.close(fd)
    again = DramPool(DramSpec(name="pool", slot_size=16 * KiB, slot_count=128,
                              shm_dir=str(tmp_path), max_block=256 * KiB,
                              page_bytes=128 * KiB, keep=True), Keeper(adopt=True))
    try:
        assert again.adopted is None
        assert "its keep file has format 7; this kvtier reads format 1" in again.cold
    finally:
        again.close()


class Holder:
    """A holder that keeps a dup of each fd it is given (as the fd store does)."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def keep(self, name: str, fd: int) -> None:
        if name not in self.fds:
            self.fds[name] = os.dup(fd)

    def forget(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def give_back(self) -> dict[str, int]:
        """The fds for the next start (taken over by it)."""
        out = {n: os.dup(fd) for n, fd in self.fds.items()}
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def test_a_record_naming_another_tenant_is_never_adopted_in_a_region(tmp_path: Path) -> None:
    """The keep file says which tenant each block is; a block is adopted only into that
    tenant's own region, so no record can make a tenant's bytes another's."""
    holder = Holder()
    keys = {"alice": token_key(b"a" * 32), "bob": token_key(b"b" * 32)}
    shares = [TenantShare("alice"), TenantShare("bob")]
    s = spec(tmp_path, isolated=True, tenants=2)
    pool = DramPool(s, Keeper(keys=keys, holder=holder))
    try:
        pool.set_tenants(shares)
        mine = put(pool, b"a" * 32, 16 * KiB, "alice")
        forged = put(pool, b"f" * 32, 16 * KiB, "alice")
        assert pool.keep is not None
        pool.keep.commit(forged, 16 * KiB, 16 * KiB, "bob", b"L" * 32, b"f" * 32, None)
        his = put(pool, b"b" * 32, 16 * KiB, "bob")
        assert NAME in holder.fds and len(holder.fds) == 3
        pool.close(keep=True)
        again = DramPool(s, Keeper(fds=holder.give_back(), keys=keys, holder=holder))
        try:
            assert again.adopted is not None
            got = {b.key: (b.tenant, b.slot) for b in again.adopted.blocks}
            assert got == {b"a" * 32: ("alice", mine), b"b" * 32: ("bob", his)}
            assert not again.is_allocated(forged)
            again.set_tenants(shares)
            fd, _, _ = again.tenant_file("alice")  # a duplicate: ours to close
            try:
                assert block(b"a" * 32, 64).tobytes() in os.pread(fd, 1 << 20, 0)
                assert block(b"b" * 32, 64).tobytes() not in os.pread(fd, 1 << 20, 0)
            finally:
                os.close(fd)
        finally:
            again.close()
    finally:
        holder.close()


def test_a_region_whose_tenant_token_changed_is_released(tmp_path: Path) -> None:
    holder = Holder()
    keys = {"alice": token_key(b"a" * 32)}
    s = spec(tmp_path, isolated=True, tenants=1)
    pool = DramPool(s, Keeper(keys=keys, holder=holder))
    try:
        pool.set_tenants([TenantShare("alice")])
        put(pool, b"a" * 32, 16 * KiB, "alice")
        pool.close(keep=True)
        rotated = {"alice": token_key(b"c" * 32)}
        again = DramPool(s, Keeper(fds=holder.give_back(), keys=rotated, holder=holder))
        try:
            assert again.adopted is not None and again.adopted.blocks == []
            assert "tenant 'alice''s DRAM starts cold: its tenant's token changed" in again.cold
            assert list(holder.fds) == [NAME]  # the old region was dropped from the holder
        finally:
            again.close()
    finally:
        holder.close()


def test_keep_file_round_trip(tmp_path: Path) -> None:
    pool = DramPool(spec(tmp_path))
    slot = put(pool, b"K" * 16, 16 * KiB)
    assert pool.keep is not None
    pool.keep.commit(slot, 16 * KiB, 1000, "default", b"L" * 32, b"K" * 16, b"P" * 16)
    w = pool.alloc(16 * KiB)
    assert w is not None
    pool.writing([w], "default", 1e12)
    pool.hold([slot], 5.0)
    geometry = pool._geometry()
    pool.close(keep=True)
    fd = os.open(keep_path(str(tmp_path / "pool")), os.O_RDWR)
    f, kept = KeepFile.read(fd, geometry)
    try:
        assert [(b.slot, b.nbytes, b.key, b.parent, b.held_until) for b in kept.blocks] == [
            (slot, 1000, b"K" * 16, b"P" * 16, 5.0)]
        assert kept.writing == [(w, 16 * KiB, "default", 1e12)]
    finally:
        f.close(unlink=True)
        os.unlink(tmp_path / "pool")
