"""An isolated DRAM pool (`kvtier.tiers.dram_regions`): each tenant's region is a file of its own
holding its slice of the pool's pages, a tenant's file holds its own blocks only, its pages never
go to another tenant while it lives, the tenants' memory together stays within the pool, and a
retired region is released (punched, closed) once its last slot is freed. The pool itself, its
real anonymous files and mappings (the daemon and clients over it: tests/test_shm_isolation.py)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.core.errors import UsageError
from kvtier.core.segment import DramError
from kvtier.tiers.dram import DramPool, DramSpec
from kvtier.tiers.dram_regions import TenantShare, slice_pages

PAGE = 65536
BLOCK = 16384  # 4 blocks a page


@pytest.fixture
def pool() -> Iterator[DramPool]:
    # 8 pages of 64 KiB: 32 slots of 16 KiB; a and b get 4 pages each
    p = DramPool.create(DramSpec("iso-unit", 4096, 128, max_block=BLOCK, page_bytes=PAGE,
                                 isolated=True))
    assert p.set_tenants([TenantShare("a"), TenantShare("b")]) == []
    yield p
    p.close()


def mapped(pool: DramPool, tenant: str) -> np.ndarray:
    """What a client of `tenant` maps: its own file, whole."""
    mm = mmap.mmap(pool.tenant_fd(tenant), pool.tenant_handle(tenant).size)
    return np.frombuffer(mm, dtype=np.uint8)


def allocated_bytes(fd: int) -> int:
    """The memory a file holds now (tmpfs blocks)."""
    return os.fstat(fd).st_blocks * 512


def test_slices_quotas_first_then_equal_shares_at_least_the_guarantee() -> None:
    mib = 1 << 20
    assert slice_pages([TenantShare("a"), TenantShare("b"), TenantShare("c")], mib, 10) == {
        "a": 4, "b": 3, "c": 3}
    got = slice_pages([TenantShare("a", quota_bytes=3 * mib // 2), TenantShare("b"),
                       TenantShare("c", guarantee_bytes=5 * mib)], mib, 10)
    assert got == {"a": 2, "c": 5, "b": 3}  # a's quota rounded up to pages; c's guarantee
    with pytest.raises(UsageError, match="need 11 pages; the DRAM pool has 10"):
        slice_pages([TenantShare("a", quota_bytes=10 * mib), TenantShare("b")], mib, 10)
    assert slice_pages([], mib, 10) == {}


def test_no_file_and_each_tenant_has_a_file_of_its_slice(pool: DramPool) -> None:
    assert pool.isolated and not os.path.exists(os.path.join("/dev/shm", "iso-unit"))
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    assert (a, b) == (BLOCK + 1, BLOCK + 2)  # the stride plus each region's tag
    assert pool.class_stride(a) == pool.class_stride(b) == BLOCK
    ha, hb = pool.tenant_handle("a"), pool.tenant_handle("b")
    assert ha.size == hb.size == pool.data_offset + 4 * PAGE and ha.page_count == 4
    assert os.fstat(pool.tenant_fd("a")).st_size == ha.size
    sa, sb = pool.alloc_many(3, a), pool.alloc_many(3, b)
    assert sa is not None and sb is not None and not set(sa) & set(sb)  # global slot ids
    assert pool.room(a) == pool.room(b) == 16 - 3  # each its own slice
    with pytest.raises(DramError, match="no tenant has size class"):
        pool.alloc_many(1, BLOCK)  # a bare size: no tenant's class
    with pytest.raises(DramError, match="no DRAM slice"):
        pool.class_bytes(BLOCK, "stranger")


def test_a_tenants_file_holds_its_own_blocks_only(pool: DramPool) -> None:
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    sa, sb = pool.alloc_many(16, a), pool.alloc_many(16, b)
    assert sa is not None and sb is not None
    for s in sa:
        pool.write(s, b"\xaa" * BLOCK)
    for s in sb:
        pool.write(s, b"\xbb" * BLOCK)
    view_a = mapped(pool, "a")
    data_a = view_a[pool.data_offset :]  # the header before it holds random ids, not blocks
    assert int((data_a == 0xBB).sum()) == 0 and int((data_a == 0xAA).sum()) == 16 * BLOCK
    for s in sa:  # a's blocks at the offsets the pool hands out
        o = pool.offset(s)
        assert bytes(view_a[o : o + BLOCK]) == b"\xaa" * BLOCK
    view_a[pool.data_offset :] = 0x11  # every byte a can reach
    assert all(bytes(pool.view(s, BLOCK)) == b"\xbb" * BLOCK for s in sb)


def test_a_full_slice_never_takes_another_tenants_pages(pool: DramPool) -> None:
    """a fills its slice and churns; b's blocks and a's own mapping are untouched, and the
    memory behind a's file is the memory a mapped at the start (no page moved in or out)."""
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    sb = pool.alloc_many(4, b)
    assert sb is not None
    for s in sb:
        pool.write(s, b"\xbb" * BLOCK)
    view_a = mapped(pool, "a")  # mapped once, as a pinned client would
    for rnd in range(5):
        sa = pool.alloc_many(16, a)
        assert sa is not None and pool.alloc_many(1, a) is None  # its slice is full
        for s in sa:
            pool.write(s, bytes([rnd + 1]) * BLOCK)
            o = pool.offset(s)
            assert bytes(view_a[o : o + BLOCK]) == bytes([rnd + 1]) * BLOCK
        for s in sa:
            pool.free(s)
    assert pool.room(b) == 12 and all(bytes(pool.view(s, BLOCK)) == b"\xbb" * BLOCK
                                      for s in sb)


def test_the_tenants_memory_stays_within_the_pool(pool: DramPool) -> None:
    """Clients touch every byte of their mappings (as `register_cuda` does), tenants rotate:
    the files together never hold more than the pool's pages plus a header each."""
    bound = pool.data_bytes + 2 * pool.data_offset
    for _ in range(3):
        for t in ("a", "b"):
            view = mapped(pool, t)
            view[pool.data_offset :] = 0x5A  # written, so its memory is there
            assert int(view.sum()) > 0  # and read
        held = sum(allocated_bytes(pool.tenant_fd(t)) for t in ("a", "b"))
        assert held <= bound and sum(pool.tenant_bytes().values()) <= bound
        for t in ("a", "b"):
            old_fd = os.dup(pool.tenant_fd(t))
            assert pool.retire_tenant(t)  # nothing allocated: released at once, punched
            assert allocated_bytes(old_fd) <= pool.data_offset  # its closed header only
            os.close(old_fd)


def test_a_retired_region_sees_nothing_stored_after_and_is_released_when_drained(
        pool: DramPool) -> None:
    """A reload changed or revoked tenant a's token (`retire_tenant`): its next blocks go to a
    fresh region under a fresh class id and generation; the old file (an fd its client fetched
    before) is marked closed and its classes are stale. The fresh region waits for pages while
    the old one still holds a's slice; the old is released (its memory punched out) when its
    last slot is freed, and the fresh one gets the pages."""
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")  # every page held
    kept_fd, old_gen, size = pool.tenant_file("a")  # a duplicate, ours to close
    old_fd = pool.tenant_fd("a")
    assert size == pool.tenant_handle("a").size
    sa = pool.alloc_many(4, a)
    assert sa is not None
    for s in sa:
        pool.write(s, b"\xaa" * BLOCK)
    old = np.frombuffer(mmap.mmap(kept_fd, pool.tenant_handle("a").size), dtype=np.uint8)
    assert pool.retire_tenant("a") and not pool.retire_tenant("never-seen")
    assert pool.tags_needed({"a"}, set()) == 3  # a's retired tag (never reused), b's, a fresh one
    assert all(pool.slot_stale(s) for s in sa)
    assert old[12] == 2  # the old file's header: STATE_CLOSED (u32 at offset 12)
    new = pool.class_bytes(BLOCK, "a")
    assert new == BLOCK + 3 and pool.tenant_handle("a").generation != old_gen
    new_gen = pool.tenant_handle("a").generation
    assert pool.tenant_fd("a") != old_fd
    with pytest.raises(DramError, match="not ready"):  # its file is not handed out meanwhile
        pool.tenant_file("a")
    assert pool.room(new) == 0 and pool.alloc_many(1, new) is None  # waits for a's pages
    assert pool.room(b) == 16  # b's slice is b's
    for s in sa[:3]:
        pool.free(s)
    assert pool.room(new) == 0 and bytes(old[pool.offset(sa[3]):][:4]) == b"\xaa" * 4
    pool.free(sa[3])  # the old region's last slot: released
    assert allocated_bytes(kept_fd) <= pool.data_offset  # punched: its closed header only
    assert not old[pool.data_offset :].any() and old[12] == 2
    new_fd, got_gen, _ = pool.tenant_file("a")  # its pages came: handed out now
    assert got_gen == new_gen
    os.close(new_fd)
    got = pool.alloc_many(16, new)
    assert got is not None and not any(pool.slot_stale(s) for s in got)
    for s in got:
        pool.write(s, b"\xcc" * BLOCK)
    assert not old[pool.data_offset :].any()  # the old file sees nothing stored after
    view = mapped(pool, "a")  # what a client with the new token maps
    assert int((view[pool.data_offset :] == 0xCC).sum()) == 16 * BLOCK
    assert int.from_bytes(bytes(view[16:24]), "little") == new_gen
    os.close(kept_fd)


def test_a_reload_keeps_the_slices_of_tenants_it_did_not_change(pool: DramPool) -> None:
    pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    with pytest.raises(UsageError, match="need 9 pages; the DRAM pool has 8"):
        pool.set_tenants([TenantShare("a"), TenantShare("b"),
                          TenantShare("c", quota_bytes=7 * PAGE)])
    assert pool.slices() == {"a": 4 * PAGE, "b": 4 * PAGE}  # refused: nothing changed
    assert pool.set_tenants([TenantShare("a")]) == []  # b removed: a keeps its region
    assert pool.slices() == {"a": 4 * PAGE}
    assert pool.set_tenants([TenantShare("a"), TenantShare("c")]) == []  # c takes b's pages
    assert pool.slices() == {"a": 4 * PAGE, "c": 4 * PAGE}
    pool.class_bytes(BLOCK, "c")  # c's region
    # a's quota changed: a new slice from the pages c does not hold, a new region for it
    assert pool.set_tenants([TenantShare("a", quota_bytes=2 * PAGE), TenantShare("c")]) == ["a"]
    assert pool.retire_tenant("a")  # as the caller does
    assert pool.slices() == {"a": 2 * PAGE, "c": 4 * PAGE}
    # d added, 2 pages free: d takes them, nobody else changes
    assert pool.set_tenants([TenantShare("a", quota_bytes=2 * PAGE), TenantShare("c"),
                             TenantShare("d")]) == []
    assert pool.slices() == {"a": 2 * PAGE, "c": 4 * PAGE, "d": 2 * PAGE}
    # e added, no page free: the pool is divided again (a's quota kept; c, d, e share the rest)
    assert pool.set_tenants([TenantShare("a", quota_bytes=2 * PAGE), TenantShare("c"),
                             TenantShare("d"), TenantShare("e")]) == ["c"]  # c has a region
    assert pool.slices() == {"a": 2 * PAGE, "c": 2 * PAGE, "d": 2 * PAGE, "e": 2 * PAGE}
