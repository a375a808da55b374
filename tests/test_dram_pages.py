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

from kvtier.core.segment import DramError, slot_array
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
        # on pages of its class only (a link row spans adjacent ones: two, or more for a
        # block larger than a page), inside the data area
        first, last = loc // t.page_bytes, (loc + stride - 1) // t.page_bytes
        assert last < t.page_count
        assert last - first <= -(-stride // t.page_bytes)
        assert {t.page_class(p) for p in range(first, last + 1)} == {stride}
        assert t.page_of(s) == first
        assert t.slot_at(loc) == s
    assert t.used == len(live) and t.used_bytes == sum(live.values())
    # the remembered slot counts per page are the ones the pages' classes give now
    for (stride, p), n in t._per_page.items():
        assert n == t.inside(stride, p) + (t.page_class(p) == stride and t._linked(p))
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
            pages = range(loc // t.page_bytes, (loc + c.stride - 1) // t.page_bytes + 1)
            assert pages[-1] < t.page_count and {t.page_class(p) for p in pages} == {c.stride}


SIZES = st.sampled_from([16 * KiB, 32 * KiB, 48 * KiB + 100, 256 * KiB, 448 * KiB, 640 * KiB,
                         1_124_352, 1 * MiB + 4096, 3 * MiB, 4 * MiB, 5 * MiB + 4096,
                         8 * MiB])


@pytest.mark.parametrize("page_bytes,pages", [(16 * MiB, 6), (8 * MiB, 8), (4 * MiB, 22),
                                              (2 * MiB, 24), (1536 * KiB, 20)])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "a", "f", "f", "e", "r"]), SIZES,
                          st.integers(1, 40),
                          st.integers(0, 10 ** 6)), min_size=1, max_size=60))
def test_live_blocks_never_overlap_and_accounting_adds_up(
        page_bytes: int, pages: int, ops: list[tuple[str, int, int, int]]) -> None:
    t = PageTable(page_bytes, pages, 16 * KiB)
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
        elif op == "r" and stride > t.page_bytes:  # clear a row of a wide class
            pinned = pick % 5
            pairs = t.relocation(stride, lambda s, pinned=pinned: s % 5 != pinned)
            assert not {new for _, new in pairs} & set(live)
            for old, new in pairs:
                assert old % 5 != pinned and t.stride_of(new) == live[old] != stride
                t.free(old)
                live[new] = live.pop(old)
            if pairs:  # the cleared row is free now
                assert t.can_alloc(1, stride)
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


def _state(t: PageTable) -> tuple[object, ...]:
    return (bytes(t._allocated), list(t._stride), list(t._live), t.used, t.used_bytes,
            {p: sorted(f) for p, f in t._page_free.items()}, dict(t._class_free),
            sorted(t._free_pages), {c: sorted(ps) for c, ps in t._class_pages.items()})


@pytest.mark.parametrize("page_bytes,pages", [(16 * MiB, 6), (4 * MiB, 22), (1536 * KiB, 20)])
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(SIZES, st.integers(1, 40)), min_size=1, max_size=30),
       st.randoms(use_true_random=False))
def test_freeing_many_slots_at_once_equals_freeing_them_one_by_one(
        page_bytes: int, pages: int, allocs: list[tuple[int, int]], rng: object) -> None:
    """`free_many` (an operator's evict) leaves the table exactly as `free` of each slot in
    order would: the same pages back, the same free lists and counts."""
    import random

    assert isinstance(rng, random.Random)
    one, many = PageTable(page_bytes, pages, 16 * KiB), PageTable(page_bytes, pages, 16 * KiB)
    live: list[int] = []
    for size, n in allocs:
        a, b = one.alloc_many(n, one.stride_for(size)), many.alloc_many(n, many.stride_for(size))
        assert a == b
        live += a or []
    doomed = rng.sample(live, rng.randint(0, len(live)))
    want = sum(one.stride_of(s) for s in doomed)
    for slot in doomed:
        one.free(slot)
    assert many.free_many(doomed) == want
    assert _state(many) == _state(one)
    kept = [s for s in live if s not in set(doomed)]
    check_table(many, {s: many.stride_of(s) for s in kept})
    with pytest.raises(ValueError):  # one slot not allocated: nothing is freed
        many.free_many([*kept[:1], *(doomed[:1] or [10 ** 6])])
    assert _state(many) == _state(one)


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


def test_a_block_larger_than_a_page_spans_adjacent_pages_of_its_class() -> None:
    # 2 MiB pages: an 8 MiB block is a row of 4 pages (on its grid: rows start at 0, 8, 16 MiB),
    # taken from the top of the data area; the pages come back when the block is freed.
    t = PageTable(2 * MiB, 12, 16 * KiB)
    big = t.stride_for(8 * MiB)
    assert big == 8 * MiB and t.can_alloc(1, big) and t.room(big) == 3
    got = t.alloc_many(1, big)
    assert got is not None and t.location(got[0]) == 16 * MiB
    assert [t.page_class(p) for p in range(12)] == [0] * 8 + [big] * 4
    small = t.alloc_many(200, t.stride_for(32 * KiB))  # 64 per page: pages 0-3, lowest first
    assert small is not None and {t.page_of(s) for s in small} == {0, 1, 2, 3}
    assert t.room(big) == 1 and t.alloc_many(2, big) is None  # no room, nothing taken
    assert t.free_pages == 4
    live = dict.fromkeys(got, big) | dict.fromkeys(small, 32 * KiB)
    check_table(t, live)
    t.free(got[0])
    assert t.free_pages == 8 and t.used == 200  # its 4 pages went back
    # a stride that is no multiple of the page: 3 MiB rows share pages (row 0 = 0..3 MiB lies
    # on pages 0-1, row 1 = 3..6 MiB on pages 1-2); 5 rows in 16 MiB, and a page goes back
    # only when no allocated row lies on it
    t = PageTable(2 * MiB, 8, 16 * KiB)
    three = t.stride_for(3 * MiB)
    rows = t.alloc_many(5, three)
    assert rows is not None and t.alloc_many(1, three) is None and t.free_pages == 0
    assert sorted(t.location(s) for s in rows) == [r * three for r in range(5)]
    check_table(t, dict.fromkeys(rows, three))
    by_loc = {t.location(s): s for s in rows}
    t.free(by_loc[3 * MiB])  # page 1 keeps row 0; page 2 held row 1 only: it goes back
    assert [t.page_class(p) for p in range(8)] == [three] * 2 + [0] + [three] * 5
    assert t.classes()[0].slots == 4  # row 1 is no slot without page 2
    t.free(by_loc[6 * MiB])  # row 2 = pages 3-4: page 3 goes, page 4 keeps row 3
    assert [t.page_class(p) for p in range(8)] == [three] * 2 + [0, 0] + [three] * 4
    left = [s for s in rows if t.is_allocated(s)]
    check_table(t, dict.fromkeys(left, three))
    for s in left:
        t.free(s)
    assert t.free_pages == 8
    with pytest.raises(ValueError, match="does not fit"):
        t.stride_for(16 * MiB + 1)  # larger than the data area
    with pytest.raises(ValueError, match="does not fit"):
        t.stride_for(0)


def test_a_row_of_a_wide_class_is_cleared_by_moving_blocks_of_other_classes() -> None:
    # 8 pages of 2 MiB full of 256 KiB blocks (8 a page). Rows of 8 MiB: pages 0-3 and 4-7.
    t = PageTable(2 * MiB, 8, 16 * KiB)
    a, big = t.stride_for(256 * KiB), t.stride_for(8 * MiB)
    got = t.alloc_many(64, a)
    assert got is not None and t.alloc_many(1, big) is None
    on = {p: [s for s in got if t.page_of(s) == p] for p in range(8)}
    for s in on[5] + on[6] + on[1][:6] + on[7][:3]:  # pages 5-6 go back; 9 free slots of a
        t.free(s)
    assert t.free_pages == 2 and t.relocation(big, lambda s: s not in on[7]) == []
    # row 4-7: 8 + 5 live blocks, but only page 1's 6 free slots lie off it (5-6 are on it);
    # row 0-3: 8 + 2 + 8 + 8 live, 3 free slots (page 7) + pages 5-6 (16) off it: neither
    assert t.relocation(big, lambda s: True) == []
    for s in on[0][:7]:
        t.free(s)  # 13 free slots off row 4-7 now (row 0-3 could move too: 19 blocks)
    pairs = t.relocation(big, lambda s: True)
    assert sorted(old for old, _ in pairs) == sorted(on[4] + on[7][3:])
    assert all(t.page_of(new) in (0, 1) for _, new in pairs)
    for old, _ in pairs:
        t.free(old)
    assert [t.page_class(p) for p in range(4, 8)] == [0] * 4
    slot = t.alloc_many(1, big)
    assert slot is not None and t.location(slot[0]) == 8 * MiB
    live = {s: a for s in got if t.is_allocated(s)} | {new: a for _, new in pairs}
    check_table(t, live | {slot[0]: big})


@pytest.fixture
def pool() -> Iterator[DramPool]:
    """32 MiB in 4 pages of 8 MiB (set: the automatic page would be 2 MiB)."""
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 16 * KiB, 2048,
                                 max_block=8 * MiB, page_bytes=8 * MiB))
    yield p
    p.close()


@pytest.fixture
def auto_pool() -> Iterator[DramPool]:
    """32 MiB, blocks up to 8 MiB, the automatic page: 2 MiB (pages smaller than a block)."""
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 16 * KiB, 2048,
                                 max_block=8 * MiB))
    yield p
    p.close()


def test_auto_geometry_of_small_and_large_pools() -> None:
    def geometry(mib: int) -> tuple[int, int]:
        return DramSpec("x", 16 * KiB, mib * MiB // (16 * KiB), max_block=8 * MiB).geometry()
    # below 256 MiB sqrt(pool x 256 KiB) is under the largest block: a quarter of it
    assert geometry(32) == (2 * MiB, 16)
    assert geometry(64) == (2 * MiB, 32) and geometry(128) == (2 * MiB, 64)
    assert geometry(256) == (8 * MiB, 32) and geometry(1024) == (16 * MiB, 64)


def test_blocks_larger_than_a_page_over_real_shm(auto_pool: DramPool) -> None:
    pool = auto_pool
    assert (pool.page_bytes, pool.page_count, pool.max_block) == (2 * MiB, 16, 8 * MiB)
    wide = pool.alloc_many(1, 8 * MiB)  # pages 12-15 (the top row)
    big = pool.alloc_many(3, 4 * MiB)  # pages 10-11, 8-9, 6-7
    small = pool.alloc_many(300, 32 * KiB)  # pages 0-4
    assert wide is not None and big is not None and small is not None
    assert pool.offset(wide[0]) - pool.data_offset == 24 * MiB
    for i, s in enumerate(wide + big + small):
        pool.write(s, bytes([i % 251 + 1]) * pool.stride_of(s))
    seg = np.frombuffer(pool._map.mm, dtype=np.uint8)
    for stride, slots in ((8 * MiB, wide), (4 * MiB, big), (32 * KiB, small)):
        rows = slot_array(seg, pool.data_offset, pool.data_bytes // stride, stride, stride)
        for s in slots:  # the row a client computes from the offset is the block
            row = (pool.offset(s) - pool.data_offset) // stride
            assert (rows[row] == pool.view(s)).all()
    st = pool.stats()
    assert st.bytes_used == 8 * MiB + 3 * 4 * MiB + 300 * 32 * KiB and st.pages_free == 1
    with pytest.raises(DramError, match="outside"):
        pool.stride_for(32 * MiB + 1)


def test_pool_clear_row_moves_blocks_off_a_row_and_keeps_their_bytes(auto_pool: DramPool) -> None:
    pool = auto_pool
    got = pool.alloc_many(120, 256 * KiB)  # 8 a page: pages 0-14
    assert got is not None
    for s in got:
        pool.write(s, s.to_bytes(4, "little") * (64 * KiB))
    for s in got[:28]:  # pages 0-2 go back; page 3 keeps 4 blocks; page 15 is free
        pool.free(s)
    assert pool.stats().pages_free == 4 and not pool.can_alloc(1, 8 * MiB)
    moves: dict[int, int] = {}
    pool.pin(got[28])  # a leased block on page 3: row 0-3 cannot be cleared...
    assert pool.clear_row(8 * MiB, got[28:32].__contains__, moves.__setitem__) == -1
    assert not moves  # ...and the caller's rule keeps the other rows' blocks put: nothing moved
    pool.unpin(got[28])
    assert pool.clear_row(8 * MiB, lambda s: True, moves.__setitem__) == 4
    assert sorted(moves) == got[28:32]  # row 0-3: fewest bytes to move, to page 15
    for old, new in moves.items():
        assert pool.offset(new) - pool.data_offset >= 30 * MiB
        assert bytes(pool.view(new, 4)) == old.to_bytes(4, "little")
    assert pool.can_alloc(1, 8 * MiB)
    slot = pool.alloc(8 * MiB)
    assert slot is not None and pool.offset(slot) == pool.data_offset


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
