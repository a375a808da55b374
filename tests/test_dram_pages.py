"""Pages and size classes of the DRAM pool (`kvtier.tiers.dram_pages`, `DramPool` over real shm):
no two live blocks overlap, accounting adds up, empty pages come back, the rounding of known
mixes, and moving a page's blocks to free it for another class."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.segment import slot_array
from kvtier.tiers.dram import DramPool, DramSpec
from kvtier.tiers.dram_pages import UNIT, PageTable

KiB, MiB = 1 << 10, 1 << 20


def check_table(t: PageTable, live: dict[int, int]) -> None:
    """Every live slot's byte range lies in one page, none overlaps another, and the table's
    counts equal what was allocated; each slot sits on its class's grid (row r at r * stride)."""
    spans = sorted((t.location(s), t.location(s) + t.stride_of(s)) for s in live)
    for (_, a1), (b0, _) in itertools.pairwise(spans):
        assert a1 <= b0, "two live blocks overlap"
    for s, stride in live.items():
        loc = t.location(s)
        assert t.stride_of(s) == stride and loc % stride == 0
        # on pages of its class only (a link row spans two adjacent ones)
        first, last = loc // t.page_bytes, (loc + stride - 1) // t.page_bytes
        assert last - first <= 1 and {t.page_class(p) for p in (first, last)} == {stride}
        assert t.page_of(s) == first
        assert t.slot_at(loc) == s
    assert t.used == len(live) and t.used_bytes == sum(live.values())
    classes = t.classes()
    assert sum(c.slots_used for c in classes) == len(live)
    assert sum(c.pages for c in classes) + t.free_pages == t.page_count
    # every slot the table offers is free and on its class's pages: allocating all of them
    # could not overlap a live block (checked through the free slots' spans)
    free_spans = [(t.location(f), t.location(f) + c.stride) for c in classes
                  for f in t.targets(c.stride, -1, c.slots)]
    assert len(free_spans) == sum(c.slots - c.slots_used for c in classes)
    every = sorted(spans + free_spans)
    for (_, a1), (b0, _) in itertools.pairwise(every):
        assert a1 <= b0, "a free slot overlaps another slot"
    for c in classes:
        for f in t.targets(c.stride, -1, c.slots):
            loc = t.location(f)
            pages = {loc // t.page_bytes, (loc + c.stride - 1) // t.page_bytes}
            assert {t.page_class(p) for p in pages} == {c.stride}


SIZES = st.sampled_from([16 * KiB, 32 * KiB, 48 * KiB + 100, 256 * KiB, 448 * KiB, 640 * KiB,
                         1_124_352, 1 * MiB + 4096, 3 * MiB, 4 * MiB, 8 * MiB])


@pytest.mark.parametrize("page_mib,pages", [(16, 6), (8, 8)])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "a", "f", "f", "e"]), SIZES, st.integers(1, 40),
                          st.integers(0, 10 ** 6)), min_size=1, max_size=60))
def test_live_blocks_never_overlap_and_accounting_adds_up(
        page_mib: int, pages: int, ops: list[tuple[str, int, int, int]]) -> None:
    t = PageTable(page_mib * MiB, pages, 16 * KiB)
    live: dict[int, int] = {}
    for op, size, n, pick in ops:
        stride = t.stride_for(size)
        if op == "e":  # free a page of the class by moving its blocks, as the daemon does
            pinned = pick % 7  # slots s with s % 7 == pinned stay put
            want = t.stride_for((16 * KiB, 640 * KiB, 1_124_352, 4 * MiB)[pick % 4])
            found = t.evacuation(stride, lambda s, pinned=pinned: s % 7 != pinned, want)
            if found is not None:
                page, moving = found
                dst = t.targets(stride, page, len(moving))
                assert len(dst) == len(moving) and not set(dst) & set(live)
                t.claim(dst)
                for old, new in zip(moving, dst, strict=True):
                    t.free(old)
                    del live[old]
                    live[new] = stride
                assert page not in {t.page_of(s) for s in live}
        elif op == "a":
            fits = t.can_alloc(n, stride)
            got = t.alloc_many(n, stride)
            assert (got is not None) == fits
            if got is not None:
                assert len(set(got)) == n and not set(got) & set(live)
                live.update(dict.fromkeys(got, stride))
        elif live:
            for s in sorted(live)[pick % len(live)::3]:
                t.free(s)
                del live[s]
        check_table(t, live)
    for s in list(live):
        t.free(s)
    assert t.free_pages == t.page_count and t.used_bytes == 0  # every page came back


def test_a_run_of_pages_of_one_class_holds_the_rows_that_cross_their_boundaries() -> None:
    # DeepSeek-V3 MLA blocks (1,124,352 B) in 8 MiB pages: 7 rows lie wholly in page 0, 6 in
    # page 1, 7 in page 2; the rows crossing 8 and 16 MiB are slots while both pages they touch
    # belong to the class: 22 blocks in 24 MiB (floor(24 MiB / stride)), not 20.
    t = PageTable(8 * MiB, 3, 16 * KiB)
    mla = t.stride_for(1_124_352)
    assert [t.inside(mla, p) for p in range(3)] == [7, 6, 7]
    got = t.alloc_many(22, mla)
    assert got is not None and t.alloc_many(1, mla) is None and t.free_pages == 0
    assert sorted(t.location(s) for s in got) == [r * mla for r in range(22)]
    check_table(t, dict.fromkeys(got, mla))
    by_page = {p: [s for s in got if t.page_of(s) == p] for p in range(3)}
    crossing_8mib = next(s for s in by_page[0] if t.location(s) == 7 * mla)
    for s in by_page[1]:  # page 1's own slots; page 0's link row still lies on it
        t.free(s)
    assert t.free_pages == 0 and t.page_class(1) == mla
    t.free(crossing_8mib)  # now nothing lies on page 1: it goes back
    assert t.free_pages == 1 and t.page_class(1) == 0
    left = [s for s in got if t.is_allocated(s)]
    check_table(t, dict.fromkeys(left, mla))
    assert sum(c.slots for c in t.classes()) == 7 + 7  # no link rows without page 1
    assert t.location(t.alloc_many(1, 32 * KiB)[0]) // t.page_bytes == 1  # type: ignore[index]


def test_evacuation_frees_the_page_that_keeps_link_rows() -> None:
    # pages 0-1: 640 KiB slots (one run, a link row across 8 MiB); page 2: MLA; page 3: 640 KiB
    # alone. Emptying a 640 KiB page for MLA: page 3 (no link row lost, and next to MLA's page
    # 2, so the MLA row crossing 24 MiB becomes a slot), not the emptier page 1 of the run.
    t = PageTable(8 * MiB, 4, 16 * KiB)
    a, mla = t.stride_for(640 * KiB), t.stride_for(1_124_352)
    run = t.alloc_many(t.inside(a, 0) + t.inside(a, 1) + 1, a)
    assert run is not None and t.page_class(1) == a
    assert t.alloc_many(t.inside(mla, 2), mla) is not None and t.page_class(2) == mla
    alone = t.alloc_many(t.inside(a, 3), a)
    assert alone is not None and t.page_class(3) == a
    page0, page1 = ([s for s in run if t.page_of(s) == p] for p in (0, 1))
    for s in page1[:8] + page0[:2] + alone[:4]:  # page 1 is the emptiest page of class a
        t.free(s)
    found = t.evacuation(a, lambda s: True, mla)
    assert found is not None and found[0] == 3
    page, live = found
    dst = t.targets(a, page, len(live))
    t.claim(dst)
    for s in live:
        t.free(s)
    assert t.page_class(3) == 0
    mla_slots = sum(c.slots for c in t.classes() if c.stride == mla)
    got = t.alloc_many(mla_slots - t.classes()[-1].slots_used + 1, mla)
    assert got is not None and t.page_class(3) == mla
    assert any(t.location(s) < 3 * t.page_bytes < t.location(s) + mla for s in got)


def test_an_emptied_page_serves_another_class() -> None:
    t = PageTable(8 * MiB, 2, 16 * KiB)
    small = t.alloc_many(2 * 256, t.stride_for(32 * KiB))  # both pages of 32 KiB slots
    assert small is not None and t.free_pages == 0
    big = t.stride_for(4 * MiB)
    assert t.alloc_many(1, big) is None
    for s in small[:256]:  # the first page's blocks
        t.free(s)
    assert t.free_pages == 1
    got = t.alloc_many(2, big)
    assert got is not None and {t.location(s) // t.page_bytes for s in got} == {0}


def test_evacuation_moves_the_emptiest_page_into_free_slots_elsewhere() -> None:
    t = PageTable(1 * MiB, 3, 16 * KiB)
    stride = t.stride_for(64 * KiB)  # 16 per page
    slots = t.alloc_many(48, stride)
    assert slots is not None
    for s in slots[:14] + slots[16:20]:  # page 0 keeps 2 live, page 1 keeps 12
        t.free(s)
    page, live = t.evacuation(stride, lambda s: True) or (None, [])
    assert page == 0 and live == slots[14:16]
    other = t.evacuation(stride, lambda s: s not in live)  # a pinned block stays put...
    assert other is not None and other[0] == 1  # ...so the next emptiest page goes
    dst = t.targets(stride, page, len(live))
    assert len(dst) == 2 and all(t.location(d) // t.page_bytes == 1 for d in dst)
    t.claim(dst)
    for s in live:
        t.free(s)
    assert t.free_pages == 1


def test_rounding_of_a_llama_and_a_small_model_mix() -> None:
    # Llama-3-8B CPU block: 32 tokens x 128 KiB = 4 MiB; a small model: 32 KiB. In 64 MiB pages
    # both strides divide the page: no tail, no rounding — every DRAM byte can hold KV.
    t = PageTable(64 * MiB, 4, 16 * KiB)
    big, small = t.stride_for(4 * MiB), t.stride_for(32 * KiB)
    assert (big, small) == (4 * MiB, 32 * KiB)
    assert t.alloc_many(2 * 16, big) is not None and t.alloc_many(2 * 2048, small) is not None
    assert t.used_bytes == t.page_bytes * t.page_count and t.free_pages == 0
    # An odd block (DeepSeek-V3 MLA, 16 tokens: 61 x 576 x 2 B x 16 = 1,124,352 B) rounds to
    # 256 B (1,124,352 is a multiple) and loses only the page's head and tail: 59 rows fit
    # one 64 MiB page -> 1.15% lost.
    t = PageTable(64 * MiB, 1, 16 * KiB)
    mla = t.stride_for(1_124_352)
    assert mla == 1_124_352 and mla % UNIT == 0
    assert t.per_page(mla, 0) == 59
    assert 1 - 59 * mla / t.page_bytes == pytest.approx(0.0115, abs=1e-4)


def test_a_block_larger_than_a_page_is_refused() -> None:
    t = PageTable(8 * MiB, 2, 16 * KiB)
    with pytest.raises(ValueError, match="does not fit"):
        t.stride_for(8 * MiB + 1)
    with pytest.raises(ValueError, match="does not fit"):
        t.stride_for(0)


@pytest.fixture
def pool() -> Iterator[DramPool]:
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 16 * KiB, 2048,
                                 max_block=8 * MiB))
    yield p
    p.close()


def test_pool_geometry_and_a_class_view_over_real_shm(pool: DramPool) -> None:
    assert (pool.page_bytes, pool.page_count, pool.max_block) == (8 * MiB, 4, 8 * MiB)
    big = pool.alloc_many(3, 4 * MiB)
    small = pool.alloc_many(300, 32 * KiB)
    assert big is not None and small is not None
    for i, s in enumerate(big + small):
        pool.write(s, bytes([i % 251 + 1]) * pool.stride_of(s))
    seg = np.frombuffer(pool._map.mm, dtype=np.uint8)
    for stride, slots in ((4 * MiB, big), (32 * KiB, small)):
        rows = slot_array(seg, pool.data_offset, pool.data_bytes // stride, stride, stride)
        for s in slots:  # the row a client computes from the offset is the block
            row = (pool.offset(s) - pool.data_offset) // stride
            assert (rows[row] == pool.view(s)).all()
    s = pool.stats()
    assert s.bytes_used == 3 * 4 * MiB + 300 * 32 * KiB
    assert s.bytes_used + s.bytes_free == s.bytes_reserved == 32 * MiB
    assert s.pages_free == 4 - 2 - 2  # 4 MiB: 2 per page; 300 x 32 KiB: 2 pages of 256


def test_pool_evacuate_copies_blocks_and_frees_the_page(pool: DramPool) -> None:
    got = pool.alloc_many(512, 32 * KiB)  # two full pages
    assert got is not None
    for s in got:
        pool.write(s, s.to_bytes(4, "little") * (8 * KiB))
    for s in got[256:500]:  # page 1 keeps 12 blocks; page 0 is full
        pool.free(s)
    keep = got[500:]
    for s in got[:20]:
        pool.free(s)  # room on page 0 for page 1's 12
    moves: dict[int, int] = {}
    pool.pin(keep[0])
    pool.pin(got[20])  # a pinned block in each page: neither page can move
    assert pool.evacuate(32 * KiB, lambda s: True, moves.__setitem__) == -1
    assert pool.evacuate(32 * KiB, lambda s: s != got[20], moves.__setitem__) == -1
    pool.unpin(keep[0])
    pool.unpin(got[20])
    assert pool.evacuate(32 * KiB, lambda s: True, moves.__setitem__) == 12
    assert sorted(moves) == keep and pool.stats().pages_free == 3
    for old, new in moves.items():
        assert bytes(pool.view(new, 4)) == old.to_bytes(4, "little")
