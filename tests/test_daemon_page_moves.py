"""Page moves off the cache lock (`Residency.taking`'s steps, driven by `Cache.allocate_async` and
`acquire_async`): a page of small blocks is emptied for a big block by copying its blocks on a
worker thread with no lock held, and what other requests do meanwhile is kept. In-process
`Cache` (real shm pool), its calls awaited as the transports await them, with the first copy
held on its worker thread between the move's plan and its end (`tests.cache_calls.Gate` on
`DramPool.copy_moves`), so the interleaving is exact; a real daemon in
tests/test_daemon_blocksizes.py.

Geometry: 4 KiB small blocks, 16 KiB big ones, pages of 16 KiB (4 small slots, 1 big slot),
8 pages. 32 small one-block chains fill it, fullest page first: chain i in page i // 4. With
LRU and chains 1, 3, 5, ... looked up again, a big block evicts chains 0, 2, 4, 6 (the cold ones
of pages 0 and 1) and then page 0's live chains 1 and 3 fit the two free slots of page 1: the
move empties page 0 for the big block."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.keys import layout_id
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.api import AllocateResult
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.tiers.dram import SlotMove
from tests.cache_calls import Gate, run

KiB = 1 << 10
T = Tenant("t")
SMALL, BIG = 4 * KiB, 16 * KiB
LS, LB = layout_id("small", b"fp-small-layout"), layout_id("big", b"fp-big-layout")


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    cfg = config.load({
        "socket": str(tmp_path / "s.sock"), "data_dir": str(tmp_path / "data"),
        "slot_bytes": "4KiB", "dram_bytes": "128KiB", "dram_page_bytes": "16KiB",
        "max_block_bytes": "16KiB", "ssd_bytes": "0", "metrics": "", "policy": "lru",
    }, {"HOME": str(tmp_path)})
    c = Cache(config.cache_spec(cfg), DaemonMetrics())
    c.register_layout(T, "small", b"fp-small-layout", SMALL, 16, 32, None)
    c.register_layout(T, "big", b"fp-big-layout", BIG, 16, 32, None)
    yield c
    c.close()


def key(tag: int, i: int) -> bytes:
    return bytes([tag, i]) + bytes(30)


def payload(k: bytes, n: int) -> bytes:
    return (k[:2] * (n // 2))[:n]


def store(c: Cache, layout: bytes, k: bytes, n: int) -> int:
    """Stores one block; returns its offset."""
    a = run(c.allocate_async(T, layout, k, 32, b"", 0))
    c.pool.view(c.pool.slot_at(a.offsets[0]) or 0, n)[:] = memoryview(payload(k, n))
    assert c.commit(T, a.lease_id) == 1
    return a.offsets[0]


async def read(c: Cache, k: bytes) -> tuple[int, bytes]:
    """(offset, bytes) of a small block under a READ lease, released after."""
    got = await c.acquire_async(T, LS, k, 32, 0)
    assert got.lease_id, "not cached"
    data = bytes(c.slot_view(got.offsets[0], SMALL))
    c.release(T, got.lease_id)
    return got.offsets[0], data


def fill(c: Cache) -> dict[bytes, int]:
    """32 small chains on the 8 pages, the odd ones looked up again (hot). With an SSD tier
    each write-back is drained at once (a queued one is pinned: eviction would skip it)."""
    offsets = {}
    for i in range(32):
        offsets[key(1, i)] = store(c, LS, key(1, i), SMALL)
        assert c.flush(30)
    assert c.pool.stats().pages_free == 0
    for i in range(1, 32, 2):
        assert len(run(c.lookup_async(T, LS, key(1, i), 32)).tiers) == 1
    return offsets


class Moving:
    """A big block's Allocate (`allocate_async`) held at its first page move's copy, on its
    worker thread: `moves` (the pool's planned moves, sources and targets) and the blocks they
    move (index blocks, by their old slots)."""

    def __init__(self, c: Cache, gate: Gate) -> None:
        self.c, self.gate = c, gate
        self.task = asyncio.create_task(c.allocate_async(T, LB, key(2, 0), 32, b"", 0))
        self.moves: list[SlotMove] = []

    async def stopped(self) -> Moving:
        (self.moves,) = await self.gate.wait()
        return self

    def keys(self) -> list[bytes]:
        """The moved blocks' keys, in move order."""
        by_slot = {b.dram_slot: b.key for b in self.c.index.iter_blocks()}
        return [by_slot[m.old] for m in self.moves]

    async def end(self) -> AllocateResult:
        self.gate.open()
        return await self.task


def test_a_move_copies_without_the_cache_lock_and_the_blocks_keep_their_bytes(cache: Cache) -> None:
    offsets = fill(cache)

    async def main() -> None:
        with Gate(cache.pool, "copy_moves", cache._lock) as gate:
            moving = await Moving(cache, gate).stopped()
            # page 0's live chains 1 and 3 go to page 1's free slots (chains 4, 6 were evicted)
            assert moving.keys() == [key(1, 1), key(1, 3)]
            assert sorted(cache.pool.offset(m.new) for m in moving.moves) == sorted(
                [offsets[key(1, 4)], offsets[key(1, 6)]])
            assert cache.leaked_slots() == 0  # the targets count as moving
            assert cache.residency.moving == 2
            res = await moving.end()
        assert res.lease_id
        assert cache.residency.moved == 2 and cache.residency.moving == 0
        for i in (1, 3):
            off, data = await read(cache, key(1, i))
            assert off != offsets[key(1, i)] and data == payload(key(1, i), SMALL)
        assert cache.pool.stats().slots_pinned == 0
        assert cache.leaked_slots() == 0 and cache.allocator.slots_held() == 1  # the big one's
        cache.abort(T, res.lease_id)

    run(main())
    assert cache.leaked_slots() == 0


def test_a_block_leased_during_its_move_stays_at_its_offset(cache: Cache) -> None:
    offsets = fill(cache)

    async def main() -> None:
        with Gate(cache.pool, "copy_moves", cache._lock) as gate:
            moving = await Moving(cache, gate).stopped()
            # a reader takes a lease on chain 1 after the move was planned: the old offset
            got = await cache.acquire_async(T, LS, key(1, 1), 32, 0)
            assert got.offsets == [offsets[key(1, 1)]]
            res = await moving.end()
        # chain 1 stayed (the reader may be reading it), chain 3 moved; the page is not freed,
        # so the big block's Allocate went on evicting until a page emptied
        assert bytes(cache.slot_view(got.offsets[0], SMALL)) == payload(key(1, 1), SMALL)
        block = cache.index.get(cache._ns(T, LS).name, key(1, 1))
        assert block is not None and block.dram_slot == cache.pool.slot_at(offsets[key(1, 1)])
        off3, data3 = await read(cache, key(1, 3))
        assert off3 != offsets[key(1, 3)] and data3 == payload(key(1, 3), SMALL)
        assert res.lease_id
        big = cache.pool.slot_at(res.offsets[0])
        assert big is not None and cache.pool.stride_of(big) == BIG
        cache.release(T, got.lease_id)
        cache.abort(T, res.lease_id)
        assert cache.leaked_slots() == 0 and cache.pool.stats().slots_pinned == 0
        assert await read(cache, key(1, 1)) == (offsets[key(1, 1)], payload(key(1, 1), SMALL))

    run(main())


def test_allocates_during_a_move_never_get_its_slots(cache: Cache) -> None:
    fill(cache)

    async def main() -> None:
        with Gate(cache.pool, "copy_moves", cache._lock) as gate:
            moving = await Moving(cache, gate).stopped()
            moved = moving.keys()
            busy = {m.old for m in moving.moves} | {m.new for m in moving.moves}
            # two concurrent small Allocates: the free slots left are elsewhere, or made by
            # eviction
            a1 = await cache.allocate_async(T, LS, key(3, 0), 32, b"", 0)
            a2 = await cache.allocate_async(T, LS, key(3, 1), 32, b"", 0)
            mine = {cache.pool.slot_at(o) for o in a1.offsets + a2.offsets}
            assert len(mine) == 2 and not mine & busy
            assert cache.leaked_slots() == 0 and cache.allocator.slots_held() == 2
            res = await moving.end()
        for a, k in ((a1, key(3, 0)), (a2, key(3, 1))):
            cache.pool.view(cache.pool.slot_at(a.offsets[0]) or 0, SMALL)[:] = memoryview(
                payload(k, SMALL))
            assert cache.commit(T, a.lease_id) == 1
            assert await read(cache, k) == (a.offsets[0], payload(k, SMALL))
        for m, k in zip(moving.moves, moved, strict=True):
            assert await read(cache, k) == (cache.pool.offset(m.new), payload(k, SMALL))
        cache.abort(T, res.lease_id)

    run(main())
    assert cache.leaked_slots() == 0


def test_allocate_async_moves_on_a_worker_thread_and_stores_the_big_block(cache: Cache) -> None:
    fill(cache)
    copied_on: list[int] = []
    copy = cache.pool.copy_moves

    def spy(moves: list[SlotMove]) -> None:
        copied_on.append(threading.get_ident())
        assert not cache._lock._is_owned()  # type: ignore[attr-defined]
        copy(moves)

    cache.pool.copy_moves = spy  # type: ignore[method-assign]
    res = run(cache.allocate_async(T, LB, key(2, 0), 32, b"", 0))
    assert copied_on and threading.get_ident() not in copied_on  # (the loop's thread)
    big = payload(key(2, 0), BIG)
    cache.pool.view(cache.pool.slot_at(res.offsets[0]) or 0, BIG)[:] = memoryview(big)
    assert cache.commit(T, res.lease_id) == 1
    got = run(cache.acquire_async(T, LB, key(2, 0), 32, 0))
    assert bytes(cache.slot_view(got.offsets[0], BIG)) == big
    cache.release(T, got.lease_id)
    for i in (1, 3):
        assert run(read(cache, key(1, i)))[1] == payload(key(1, i), SMALL)
    assert cache.leaked_slots() == 0


@pytest.fixture
def ssd_cache(tmp_path: Path) -> Iterator[Cache]:
    cfg = config.load({
        "socket": str(tmp_path / "s.sock"), "data_dir": str(tmp_path / "data"),
        "slot_bytes": "4KiB", "dram_bytes": "128KiB", "dram_page_bytes": "16KiB",
        "max_block_bytes": "16KiB", "ssd_bytes": "1MiB", "metrics": "", "policy": "lru",
        "ssd_admit_after": "1", "writeback_queue_bytes": "128KiB",
    }, {"HOME": str(tmp_path)})
    c = Cache(config.cache_spec(cfg), DaemonMetrics())
    c.register_layout(T, "small", b"fp-small-layout", SMALL, 16, 32, None)
    c.register_layout(T, "big", b"fp-big-layout", BIG, 16, 32, None)
    yield c
    c.close()


def test_an_acquire_stopped_at_a_move_takes_a_promotion_made_meanwhile(ssd_cache: Cache) -> None:
    c = ssd_cache
    big = key(2, 0)
    store(c, LB, big, BIG)  # k = 1: written back at Commit
    assert c.flush(30)
    fill(c)  # 32 small blocks: the big one's DRAM copy was demoted (its SSD copy stays)
    assert c.flush(30)
    assert run(c.lookup_async(T, LB, big, 32)).tiers == [Tier.SSD]

    async def main() -> None:
        with Gate(c.pool, "copy_moves", c._lock) as gate:
            # its claim needs a page: small blocks move (held at their copy)
            first = asyncio.create_task(c.acquire_async(T, LB, big, 32, 0))
            await gate.wait()
            # meanwhile another Acquire promotes the big block (its own claim, its own moves)
            other = await c.acquire_async(T, LB, big, 32, 0)
            assert other.source_tiers == [Tier.SSD]
            assert bytes(c.slot_view(other.offsets[0], BIG)) == payload(big, BIG)
            gate.open()
            got = await first  # resumed: the block is in DRAM now, its claim went back
        assert c.residency.claimed == 0
        assert got.offsets == other.offsets and got.source_tiers == [Tier.DRAM]
        c.release(T, got.lease_id)
        c.release(T, other.lease_id)
        assert c.leaked_slots() == 0 and c.residency.moving == 0
        for i in (1, 3):
            assert (await read(c, key(1, i)))[1] == payload(key(1, i), SMALL)

    run(main())
