"""An isolated DRAM pool (`kvtier.tiers.dram_regions`): each tenant's classes and pages are its
own, a tenant's file holds its pages' bytes only, and a page that changes hands leaves nothing
behind. The pool itself, its real anonymous files and mappings (the daemon and clients over it:
tests/test_shm_isolation.py)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.core.segment import DramError
from kvtier.tiers.dram import DramPool, DramSpec

PAGE = 65536
BLOCK = 16384  # 4 blocks a page


@pytest.fixture
def pool() -> Iterator[DramPool]:
    # 4 pages of 64 KiB: 16 slots of 16 KiB
    p = DramPool.create(DramSpec("iso-unit", 4096, 64, max_block=BLOCK, page_bytes=PAGE,
                                 isolated=True))
    yield p
    p.close()


def mapped(pool: DramPool, tenant: str) -> np.ndarray:
    """What a client of `tenant` maps: its own file, whole."""
    mm = mmap.mmap(pool.tenant_fd(tenant), pool.size)
    return np.frombuffer(mm, dtype=np.uint8)


def test_no_file_and_tenant_classes_never_share_a_page(pool: DramPool) -> None:
    assert pool.isolated and not os.path.exists(os.path.join("/dev/shm", "iso-unit"))
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    assert (a, b) == (BLOCK + 1, BLOCK + 2)  # the stride plus each tenant's tag
    assert pool.class_stride(a) == pool.class_stride(b) == BLOCK
    sa, sb = pool.alloc_many(3, a), pool.alloc_many(3, b)
    assert sa is not None and sb is not None
    pages_a = {(pool.offset(s) - pool.data_offset) // PAGE for s in sa}
    pages_b = {(pool.offset(s) - pool.data_offset) // PAGE for s in sb}
    assert len(pages_a) == len(pages_b) == 1 and not pages_a & pages_b
    assert [pool.page_tenant(p) for p in range(4)].count("a") == 1
    with pytest.raises(DramError, match="no tenant has size class"):
        pool.alloc_many(1, BLOCK)  # a bare size: no tenant's class


def test_a_tenants_file_holds_its_own_blocks_only(pool: DramPool) -> None:
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    sa, sb = pool.alloc_many(4, a), pool.alloc_many(4, b)
    assert sa is not None and sb is not None
    for s in sa:
        pool.write(s, b"\xaa" * BLOCK)
    for s in sb:
        pool.write(s, b"\xbb" * BLOCK)
    view_a = mapped(pool, "a")
    data_a = view_a[pool.data_offset :]  # the header before it holds random ids, not blocks
    assert int((data_a == 0xBB).sum()) == 0 and int((data_a == 0xAA).sum()) == 4 * BLOCK
    for s in sa:  # a's blocks at the offsets the pool hands out
        o = pool.offset(s)
        assert bytes(view_a[o : o + BLOCK]) == b"\xaa" * BLOCK
    view_a[pool.data_offset :] = 0x11  # every byte a can reach
    assert all(bytes(pool.view(s, BLOCK)) == b"\xbb" * BLOCK for s in sb)


def test_a_page_that_changes_hands_leaves_nothing_behind(pool: DramPool) -> None:
    a, b = pool.class_bytes(BLOCK, "a"), pool.class_bytes(BLOCK, "b")
    sa = pool.alloc_many(16, a)  # every page
    assert sa is not None and pool.alloc_many(1, b) is None
    for s in sa:
        pool.write(s, b"\xaa" * BLOCK)
    view_a = mapped(pool, "a")
    page = (pool.offset(sa[0]) - pool.data_offset) // PAGE
    for s in sa[:4]:  # the four slots of one page: it goes back to the free pages
        assert (pool.offset(s) - pool.data_offset) // PAGE == page
        pool.free(s)
    start = pool.data_offset + page * PAGE
    # a free page keeps its tenant's memory (a's own bytes) until another tenant takes it
    assert pool.page_tenant(page) == "a" and bytes(view_a[start : start + 4]) == b"\xaa" * 4
    sb = pool.alloc_many(4, b)
    assert sb is not None and {(pool.offset(s) - pool.data_offset) // PAGE for s in sb} == {page}
    assert pool.page_tenant(page) == "b"
    assert not view_a[start : start + PAGE].any()  # a's bytes there are gone
    assert all(not pool.view(s, BLOCK).any() for s in sb)  # b finds zeros, not a's bytes
    for s in sb:
        pool.write(s, b"\xbb" * BLOCK)
    assert not view_a[start : start + PAGE].any()  # and a does not see b's
    for s in sb:  # b's page goes back; a takes it again: b's bytes go, a sees zeros there
        pool.free(s)
    again = pool.alloc_many(4, a)
    assert again is not None and pool.page_tenant(page) == "a"
    assert all(not pool.view(s, BLOCK).any() for s in again)


def test_a_retired_tenant_file_sees_nothing_stored_after_and_its_pages_are_punched(
        pool: DramPool) -> None:
    """A reload changed or revoked tenant a's token (`retire_tenant`): its next blocks go to a
    fresh file under a fresh class id and generation; the old file (an fd its client fetched
    before) is marked closed, its classes are stale, and a page of it that a's new file takes
    is punched out of it first."""
    a = pool.class_bytes(BLOCK, "a")
    old_fd, old_gen = pool.tenant_file("a")
    assert old_gen == pool.generation  # a tenant's first file carries the pool's generation
    sa = pool.alloc_many(4, a)  # one whole page
    assert sa is not None
    for s in sa:
        pool.write(s, b"\xaa" * BLOCK)
    old = np.frombuffer(mmap.mmap(old_fd, pool.size), dtype=np.uint8)
    assert pool.retire_tenant("a") and not pool.retire_tenant("never-seen")
    assert pool.tags_needed({"a"}, set()) == 2  # a's retired tag, never reused, and a fresh one
    assert all(pool.slot_stale(s) for s in sa)
    assert old[12] == 2  # the old file's header: STATE_CLOSED (u32 at offset 12)
    new = pool.class_bytes(BLOCK, "a")
    assert new == BLOCK + 2 and pool.tenant_handle("a").generation != old_gen
    new_fd, new_gen = pool.tenant_file("a")
    assert new_fd != old_fd and new_gen == pool.tenant_handle("a").generation
    for s in sa:
        pool.free(s)  # the old blocks leave (the daemon: `Residency.rekey`)
    got = pool.alloc_many(16, new)  # every page, the old one included
    assert got is not None and not any(pool.slot_stale(s) for s in got)
    for s in got:
        pool.write(s, b"\xcc" * BLOCK)
    old_data = old[pool.data_offset :]  # the header before it holds random ids, not blocks
    assert int((old_data == 0xCC).sum()) == 0 and int((old_data == 0xAA).sum()) == 0  # punched
    view = mapped(pool, "a")  # what a client with the new token maps
    assert int((view[pool.data_offset :] == 0xCC).sum()) == 16 * BLOCK
    assert int.from_bytes(bytes(view[16:24]), "little") == new_gen
