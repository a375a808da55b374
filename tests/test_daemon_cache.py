"""`kvtier.daemon.cache.cache.Cache` in-process (real shm pool, real LMDB, injected lease
clock), its calls awaited as the transports await them (`tests.cache_calls.run`): the domain
rules without gRPC — eviction under pressure, expiry, no leaked slots, SSD round trip."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvtier.core.keys import layout_id
from kvtier.core.segment import DramError
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.metrics import DaemonMetrics
from tests.cache_calls import run, until

FINGERPRINT = b"cache-test-layout"
MODEL = "cache-test-model"
LID = layout_id(MODEL, FINGERPRINT)  # what data calls name
BLOCK = 4096
T = Tenant("t")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp: Path, clock: Clock, slots: int = 8, ssd: str = "0", **kw: str) -> Cache:
    cfg = config.load({
        "socket": str(tmp / "s.sock"), "data_dir": str(tmp / "data"), "slot_bytes": "4KiB",
        "dram_bytes": str(slots * BLOCK), "ssd_bytes": ssd, "metrics": "",
        "writeback_queue_bytes": str(slots * BLOCK),  # tiny pools: the default quarter is 1 slot
        **kw,
    }, {"HOME": str(tmp)})
    cache = Cache(config.cache_spec(cfg), DaemonMetrics(), clock=clock)
    cache.register_layout(T, MODEL, FINGERPRINT, BLOCK, 16, 32, None)
    return cache


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(tmp_path: Path, clock: Clock) -> Iterator[Cache]:
    c = make(tmp_path, clock)
    yield c
    c.close()


def keys(tag: int, n: int) -> bytes:
    return b"".join(bytes([tag, i]) + bytes(30) for i in range(n))


async def stored(c: Cache, k: bytes, parent: bytes = b"", fill: int = 7) -> int:
    """Allocates the chain `k`, fills its slots with `fill` and commits; blocks inserted."""
    a = await c.allocate_async(T, LID, k, 32, parent, 0)
    for off in a.offsets:
        c.slot_view(off, BLOCK, T.name)[:] = bytes([fill]) * BLOCK
    return c.commit(T, a.lease_id, len(a.offsets) * BLOCK) if a.lease_id else 0


def store(c: Cache, k: bytes, parent: bytes = b"", fill: int = 7) -> int:
    return run(stored(c, k, parent, fill))


def tiers(c: Cache, k: bytes) -> list[Tier]:
    """What a Lookup of the chain `k` answers."""
    return run(c.lookup_async(T, LID, k, 32)).tiers


def test_pressure_evicts_leaves_first_and_never_strands(cache: Cache) -> None:
    assert store(cache, keys(1, 6)) == 6
    assert store(cache, keys(2, 4)) == 4  # 10 > 8 slots: evicts 2 blocks of chain 1 from its end
    hit1 = len(tiers(cache, keys(1, 6)))
    assert hit1 == 4  # 6 - 2 leaves; the surviving blocks are still a prefix
    assert len(tiers(cache, keys(2, 4))) == 4
    assert cache.leaked_slots() == 0


def test_pinned_blocks_are_never_evicted(cache: Cache) -> None:
    store(cache, keys(1, 8))
    got = run(cache.acquire_async(T, LID, keys(1, 8), 32, 0))
    with pytest.raises(ResourceExhausted):
        store(cache, keys(2, 1))
    cache.release(T, got.lease_id)
    assert store(cache, keys(2, 1)) == 1
    assert cache.leaked_slots() == 0


def test_expired_leases_are_undone(cache: Cache, clock: Clock) -> None:
    store(cache, keys(1, 2))
    read = run(cache.acquire_async(T, LID, keys(1, 2), 32, 5))
    write = run(cache.allocate_async(T, LID, keys(3, 3), 32, b"", 10))
    assert cache.active_leases() == 2 and cache.pool.stats().slots_used == 5
    clock.now += 5
    assert cache.expire() == 1  # the read lease
    clock.now += 5
    assert cache.expire() == 1  # the allocation: aborted
    assert cache.pool.stats().slots_used == 2 and cache.pool.stats().slots_pinned == 0
    with pytest.raises(NotFound):
        cache.commit(T, write.lease_id)
    with pytest.raises(NotFound):
        cache.release(T, read.lease_id)
    assert cache.leaked_slots() == 0


def test_commit_drops_blocks_whose_parent_vanished(cache: Cache) -> None:
    store(cache, keys(1, 1))
    parent = keys(1, 1)
    a = run(cache.allocate_async(T, LID, keys(2, 2), 32, parent, 0))
    store(cache, keys(3, 6))  # 5 free + the unpinned parent (a leaf), evicted
    assert tiers(cache, parent) == []
    assert cache.commit(T, a.lease_id) == 0  # its children could never be hit
    assert cache.leaked_slots() == 0


def test_rules(cache: Cache) -> None:
    with pytest.raises(NotFound):
        run(cache.lookup_async(T, b"other-layout-xx", keys(1, 1), 32))
    with pytest.raises(InvalidArgument):
        run(cache.allocate_async(T, LID, keys(1, 1) * 2, 32, b"", 0))
    with pytest.raises(FailedPrecondition):
        run(cache.allocate_async(T, LID, keys(1, 1), 32, keys(9, 1), 0))
    a = run(cache.allocate_async(T, LID, keys(1, 1), 32, b"", 0))
    with pytest.raises(PermissionDenied):
        cache.abort(Tenant("intruder"), a.lease_id)
    again = run(cache.allocate_async(T, LID, keys(1, 1), 32, b"", 0))
    assert again.lease_id == ""  # pending: not twice
    cache.abort(T, a.lease_id)
    assert cache.leaked_slots() == 0


@pytest.fixture
def closing() -> Iterator[list[Cache]]:
    """Caches a test opens; closed (segment unlinked) even when the test fails."""
    opened: list[Cache] = []
    yield opened
    for c in opened:
        c.close()


def test_ssd_write_back_promotion_and_restart(
    tmp_path: Path, clock: Clock, closing: list[Cache]
) -> None:
    c = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    closing.append(c)
    assert store(c, keys(1, 4), fill=3) == 4
    assert c.flush(10)
    assert c.stats().ssd_blocks == 4
    store(c, keys(2, 4))  # DRAM full: chain 1 is demoted (it has SSD copies)
    assert c.flush(10)  # chain 2's write-backs pin its slots until written
    assert tiers(c, keys(1, 4)) == [Tier.SSD] * 4
    got = run(c.acquire_async(T, LID, keys(1, 4), 32, 0))
    assert got.source_tiers == [Tier.SSD] * 4
    assert all(bytes(c.slot_view(o, BLOCK)) == bytes([3]) * BLOCK for o in got.offsets)
    c.release(T, got.lease_id)
    assert c.leaked_slots() == 0
    c.close()
    started = time.monotonic()
    c2 = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    closing.append(c2)
    assert time.monotonic() - started < 5
    assert tiers(c2, keys(1, 4)) == [Tier.SSD] * 4
    assert c2.stats(T).tenant_ssd_bytes == c2.stats().ssd_used_bytes


@pytest.mark.parametrize("bad", [1, 0])
def test_corrupt_ssd_payload_is_a_miss_and_a_counter(
    tmp_path: Path, clock: Clock, closing: list[Cache], bad: int
) -> None:
    c = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    closing.append(c)
    store(c, keys(1, 2), fill=0x5A)
    assert c.flush(10) and c.stats().ssd_blocks == 2
    c.close()
    # payloads live in the slot file (or in LMDB values): flip a bit wherever they are
    block = bytes([0x5A]) * BLOCK
    (data,) = [f for f in (tmp_path / "data" / "ssd").iterdir() if block in f.read_bytes()]
    raw = bytearray(data.read_bytes())
    first = raw.find(block)
    second = raw.find(block, first + BLOCK)
    assert 0 <= first < second
    raw[(first, second)[bad] + 100] ^= 0x01  # one flipped bit in one block's payload
    data.write_bytes(bytes(raw))
    c2 = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    closing.append(c2)
    assert tiers(c2, keys(1, 2)) == [Tier.SSD, Tier.SSD]
    got = run(c2.acquire_async(T, LID, keys(1, 2), 32, 0))
    assert got.source_tiers == [Tier.SSD] * bad  # the corrupt block is a miss, never served
    if bad:
        assert bytes(c2.slot_view(got.offsets[0], BLOCK)) == bytes([0x5A]) * BLOCK
        c2.release(T, got.lease_id)
    assert c2.metrics.value("kvtier_checksum_failures_total") == 1
    # the lost block is forgotten with its subtree (the first block takes the second along)
    assert tiers(c2, keys(1, 2)) == [Tier.DRAM] * bad
    assert c2.stats().ssd_blocks == bad
    assert c2.leaked_slots() == 0


def test_events_report_stores_and_evictions_in_order(cache: Cache) -> None:
    async def main() -> list[tuple[int, bool, Tier, int]]:
        sub = cache.events.subscribe("t")
        await stored(cache, keys(1, 6))
        await stored(cache, keys(2, 4))  # evicts the last 2 blocks of chain 1 (8 slots)
        await until(lambda: sub.queue.qsize() >= 3, "3 events")
        out = []
        while not sub.queue.empty():
            ev = sub.queue.get_nowait()
            assert ev is not None
            out.append((ev.sequence, ev.stored, ev.tier, len(ev.keys)))
        cache.events.unsubscribe(sub)
        return out

    got = run(main())
    # the two blocks evicted together for room are one BlockRemoved, before the store they made
    # room for
    assert [(s, t, n) for _, s, t, n in got] == [
        (True, Tier.DRAM, 6), (False, Tier.DRAM, 2), (True, Tier.DRAM, 4),
    ]
    assert [seq for seq, *_ in got] == sorted(seq for seq, *_ in got)


def test_no_room_for_a_promotion_keeps_the_ssd_block(
    tmp_path: Path, clock: Clock, closing: list[Cache]
) -> None:
    c = make(tmp_path, clock, slots=4, ssd="1MiB", ssd_admit_after="1")
    closing.append(c)
    store(c, keys(1, 1), fill=1)  # a leaf: the old bug dropped exactly these
    assert c.flush(10)
    store(c, keys(2, 4), fill=2)  # chain 1 demoted to SSD only
    assert c.flush(10)
    held = run(c.acquire_async(T, LID, keys(2, 4), 32, 0))  # every slot pinned
    none = run(c.acquire_async(T, LID, keys(1, 1), 32, 0))
    assert none.lease_id == ""  # no room: nothing acquired...
    assert tiers(c, keys(1, 1)) == [Tier.SSD]  # ...and nothing forgotten
    c.release(T, held.lease_id)
    got = run(c.acquire_async(T, LID, keys(1, 1), 32, 0))
    assert got.source_tiers == [Tier.SSD]
    c.release(T, got.lease_id)
    assert c.metrics.value("kvtier_checksum_failures_total") == 0 and c.leaked_slots() == 0


def test_an_allocation_that_cannot_fit_evicts_nothing(cache: Cache) -> None:
    store(cache, keys(1, 3))
    held = run(cache.allocate_async(T, LID, keys(2, 4), 32, b"", 0))  # 7 of 8 slots held
    with pytest.raises(ResourceExhausted):
        run(cache.allocate_async(T, LID, keys(3, 5), 32, b"", 0))  # 1 free + 3 evictable < 5
    assert tiers(cache, keys(1, 3)) == [Tier.DRAM] * 3  # nothing evicted
    cache.abort(T, held.lease_id)
    assert cache.leaked_slots() == 0


def test_applier_keeps_tenant_usage_equal_to_a_recount(tmp_path: Path, clock: Clock) -> None:
    """Stores, evictions, write-backs, promotions and SSD evictions all reach the tenant's usage
    through the index's journal: after each round the journal is empty (every operation applied
    it) and the usage equals a recount of what the index holds."""
    c = make(tmp_path, clock, slots=8, ssd=str(10 * (BLOCK + 64)), ssd_admit_after="1")
    try:
        for _ in range(3):
            for tag in range(1, 6):
                store(c, keys(tag, 3))
                c.flush(10)
                got = run(c.acquire_async(T, LID, keys((tag % 5) + 1, 3), 32, 0))
                if got.lease_id:
                    c.release(T, got.lease_id)
                with c._lock:
                    assert c.index.take_changes() == []
                    blocks = list(c.index.iter_blocks())
                    state = c.names.tenants["t"]
                    dram = sum(c.pool.stride_of(b.dram_slot) for b in blocks
                               if b.dram_slot is not None)
                    ssd = sum(c.residency.ssd_bytes_of(b.ns) for b in blocks if b.on_ssd)
                    assert (state.dram_bytes, state.ssd_bytes) == (dram, ssd)
        assert c.stats().ssd_blocks > 0
        assert c.metrics.value("kvtier_evictions_total", tier="ssd", reason="capacity") > 0
        assert c.leaked_slots() == 0
    finally:
        c.close()


def test_a_rekeyed_tenant_leaves_its_old_file_now_or_at_release(
        tmp_path: Path, clock: Clock) -> None:
    """Isolated pool (a tokens file): a reload that changes t's token (`set_tenants(...,
    rekeyed)`) drops t's unpinned DRAM blocks of its old region now; a block leased then is not
    served to another Acquire and goes at its release; a write lease allocated before ends
    uncommitted (its holder wrote as the old token); what t stores after lies in its fresh
    region, and the old one is released once its last slot is freed. No slot leaks."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.t]\ntoken = "token-of-t-1"\n')
    c = make(tmp_path, clock, tokens_file=str(tokens))
    try:
        c.set_tenants([T], [])  # as the daemon does at start
        pool = c.pool
        old_fd = pool.tenant_fd("t")
        assert store(c, keys(1, 2)) == 2
        held = run(c.acquire_async(T, LID, keys(1, 1), 32, 30.0))  # chain 1's block 0, leased
        # a write lease open across the reload
        w = run(c.allocate_async(T, LID, keys(3, 1), 32, b"", 0))
        assert held.lease_id and w.lease_id and pool.stats().slots_used == 3
        c.set_tenants([T], [], ["t"])
        assert [len(tiers(c, keys(1, 2)))] == [1]  # block 1 dropped now
        assert run(c.acquire_async(T, LID, keys(1, 1), 32, 30.0)).lease_id == ""  # not served
        with pytest.raises(NotFound):
            c.commit(T, w.lease_id, BLOCK)
        assert len(tiers(c, keys(3, 1))) == 0  # never committed
        with pytest.raises(DramError, match="not ready"):  # a fresh region, made on first
            pool.tenant_file("t")  # use, handed out once the old one let go of t's slice
        c.release(T, held.lease_id)
        fd, _, _ = pool.tenant_file("t")
        os.close(fd)
        assert pool.tenant_fd("t") != old_fd
        assert len(tiers(c, keys(1, 1))) == 0  # out at its release
        assert pool.stats().slots_used == 0 and c.leaked_slots() == 0
        assert pool.tenant_bytes() == {"t": pool.tenant_handle("t").size}  # the old released
        assert store(c, keys(4, 1), fill=9) == 1
        got = run(c.acquire_async(T, LID, keys(4, 1), 32, 30.0))
        view = np.frombuffer(mmap.mmap(pool.tenant_fd("t"), pool.tenant_handle("t").size),
                             dtype=np.uint8)
        assert bytes(view[got.offsets[0]:got.offsets[0] + BLOCK]) == bytes([9]) * BLOCK
        c.release(T, got.lease_id)
    finally:
        c.close()
