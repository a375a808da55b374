"""SSD promotion off the cache lock (in-process, real shm pool and LMDB, `Cache.acquire_async`
as the transports await it): an Acquire claims its slots, reads on a worker thread without the
lock, then settles. With the read held at its start (`tests.cache_calls.Gate`), the cache serves
others, pinned blocks and claimed slots stay put, and a second Acquire of the same blocks waits
for the first; a cancelled Acquire still ends cleanly."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import ResourceExhausted
from kvtier.core.types import Tier
from kvtier.daemon.cache.cache import Cache
from tests.cache_calls import Gate, not_done_within, run, until
from tests.test_daemon_cache import BLOCK, LID, Clock, T, keys, make, store


async def settled(c: Cache) -> None:
    """Until the cancelled Acquire's read has run and granted its lease. `asyncio.run` cancels
    the tasks left when `main` returns, and a read still queued for a worker thread then would
    never run (only a daemon's shutdown does that; a test must not race it)."""
    deadline = time.monotonic() + 60
    while c.active_leases() == 0:
        assert time.monotonic() < deadline, "the cancelled Acquire never finished"
        await asyncio.sleep(0.01)


def lease_expires_and_frees_all(c: Cache, clock: Clock) -> None:
    """The cancelled Acquire's one lease, its claims settled, ends by TTL and leaves no slot
    leaked; its blocks stay in DRAM."""
    assert c.active_leases() == 1 and c.residency.claimed == 0
    clock.now += 2.0
    assert c.expire() == 1
    assert c.leaked_slots() == 0
    assert run(c.lookup_async(T, LID, keys(1, 2), 32)).tiers == [Tier.DRAM] * 2


@pytest.fixture
def ssd_cache(tmp_path: Path) -> Iterator[tuple[Cache, Clock]]:
    clock = Clock()
    c = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    store(c, keys(1, 2), fill=0x11)
    assert c.flush(10)
    store(c, keys(2, 4), fill=0x22)  # the pool is full: chain 1 keeps only its SSD copies
    assert c.flush(10)
    assert run(c.lookup_async(T, LID, keys(1, 2), 32)).tiers == [Tier.SSD] * 2
    yield c, clock
    c.close()


def test_claimed_slots_and_pinned_blocks_survive_pressure_during_the_read(
    ssd_cache: tuple[Cache, Clock],
) -> None:
    c, _ = ssd_cache

    async def main() -> None:
        with Gate(c.residency, "read_claimed", c._lock) as read:
            acquire = asyncio.create_task(c.acquire_async(T, LID, keys(1, 2), 32, 0))
            await read.wait()  # step 1 ran: 2 slots claimed (chain 2 evicted); the read waits
            assert c.residency.claimed == 2
            assert c.leaked_slots() == 0  # claimed slots are accounted for
            # the lock is free: other requests are served while the read has not happened yet
            assert (await c.lookup_async(T, LID, keys(1, 2), 32)).tiers == [Tier.SSD] * 2
            w = await c.allocate_async(T, LID, keys(3, 2), 32, b"", 0)  # the 2 slots left
            with pytest.raises(ResourceExhausted):
                await c.allocate_async(T, LID, keys(4, 1), 32, b"", 0)  # claims stay claimed
            read.open()
            got = await acquire  # steps 2 and 3
        assert got.source_tiers == [Tier.SSD] * 2
        assert all(bytes(c.slot_view(o, BLOCK)) == bytes([0x11]) * BLOCK for o in got.offsets)
        c.abort(T, w.lease_id)
        c.release(T, got.lease_id)

    run(main())
    assert run(c.lookup_async(T, LID, keys(1, 2), 32)).tiers == [Tier.DRAM] * 2
    assert c.leaked_slots() == 0 and c.residency.claimed == 0


def test_a_second_acquire_waits_for_the_first_promotion(ssd_cache: tuple[Cache, Clock]) -> None:
    c, _ = ssd_cache
    ns = c._ns(T, LID).name

    def pins() -> int:
        block = c.index.get(ns, keys(1, 1))
        return 0 if block is None else block.pins

    async def main() -> None:
        with Gate(c.residency, "read_claimed", c._lock) as read:
            first = asyncio.create_task(c.acquire_async(T, LID, keys(1, 2), 32, 0))
            await read.wait()
            second = asyncio.create_task(c.acquire_async(T, LID, keys(1, 2), 32, 0))
            await until(lambda: pins() == 2, "the second Acquire pinned the blocks")
            assert c.residency.claimed == 2  # no second claim, no race
            assert await not_done_within(second, 0.2)  # it waits for the first promotion
            read.open()
            a = await first
            b = await second
        assert b.offsets == a.offsets and b.source_tiers == [Tier.SSD] * 2
        c.release(T, a.lease_id)
        c.release(T, b.lease_id)

    run(main())
    assert c.leaked_slots() == 0 and c.active_leases() == 0


def test_a_cancelled_async_acquire_still_finishes_and_its_lease_expires(
    ssd_cache: tuple[Cache, Clock],
) -> None:
    c, clock = ssd_cache

    async def main() -> None:
        task = asyncio.create_task(c.acquire_async(T, LID, keys(1, 2), 32, 1.0))
        await asyncio.sleep(0)  # step 1 ran, the read is on a worker thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settled(c)

    asyncio.run(main())
    lease_expires_and_frees_all(c, clock)


def test_a_cancelled_async_acquire_queued_behind_busy_workers_still_finishes(
    ssd_cache: tuple[Cache, Clock],
) -> None:
    """The caller gives up (a client's deadline) while every worker thread is busy, so the
    Acquire's read has not started: it still runs later. Were it dropped, its claimed slots and
    pins would leak, and every later Acquire of those blocks would wait PROMOTION_WAIT_S for a
    promotion that never ends."""
    c, clock = ssd_cache
    busy = threading.Event()

    async def main() -> None:
        from concurrent.futures import ThreadPoolExecutor
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        blocker = loop.run_in_executor(None, busy.wait, 30.0)  # the only worker thread
        task = asyncio.create_task(c.acquire_async(T, LID, keys(1, 2), 32, 1.0))
        for _ in range(3):
            await asyncio.sleep(0)  # step 1 ran; the read waits for a worker thread
        assert c.residency.claimed == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        busy.set()
        await blocker
        await settled(c)

    asyncio.run(main())
    lease_expires_and_frees_all(c, clock)
    # no promotion left behind to wait for: served from DRAM at once, nothing claimed
    again = run(c.acquire_async(T, LID, keys(1, 2), 32, 0))
    assert again.source_tiers == [Tier.DRAM] * 2 and c.residency.claimed == 0
    c.release(T, again.lease_id)
