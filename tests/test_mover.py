"""Mover: write-back through the bounded queue, drops, wear budget, promotion and shutdown.
(The whole DRAM -> SSD -> DRAM cycle with the prefix index deciding is the daemon's:
tests/test_daemon_writeback.py.)"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.wear import WriteBudget
from kvtier.tiers.blockfmt import HEADER_SIZE
from kvtier.tiers.dram import DramPool, DramSpec, SlotPinned
from kvtier.tiers.mover import Mover, MoverSpec, Submitted, WriteBack
from kvtier.tiers.ssd.store import PutResult, SsdSpec, SsdStore

SLOT = 32 << 10
FP = b"mover-layout"


@pytest.fixture
def pool() -> Iterator[DramPool]:
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", SLOT, 64))
    yield p
    p.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SsdStore]:
    s = SsdStore(SsdSpec(str(tmp_path / "ssd"), 64 << 20, FP))
    yield s
    s.close()


def fill(pool: DramPool, n: int) -> list[tuple[WriteBack, bytes]]:
    out = []
    for i in range(n):
        slot = pool.alloc()
        assert slot is not None
        data = os.urandom(SLOT)
        pool.write(slot, data)
        out.append((WriteBack("t", b"key-%03d" % i, None, slot, SLOT), data))
    return out


class Recorder:
    def __init__(self, pool: DramPool) -> None:
        self.pool = pool
        self.done: list[tuple[WriteBack, bool]] = []
        self.lock = threading.Lock()

    def __call__(self, batch: list[WriteBack], result: PutResult) -> None:
        refused = set(result.refused)
        with self.lock:
            for w in batch:
                self.pool.free(w.slot)  # unpinned by the mover before this call
                self.done.append((w, (w.ns, w.key) not in refused))


def test_write_back_then_promote(pool: DramPool, store: SsdStore) -> None:
    rec = Recorder(pool)
    mover = Mover(pool, store, WriteBudget.unlimited(), on_written=rec)
    blocks = fill(pool, 20)
    for w, _ in blocks:
        assert mover.submit(w) is Submitted.QUEUED
        assert pool.pins(w.slot) == 1
    assert mover.flush(10.0)
    assert len(rec.done) == 20 and all(ok for _, ok in rec.done)
    assert mover.submit(blocks[0][0]) is Submitted.ALREADY_STORED
    for w, data in blocks:
        slot = pool.alloc()
        assert slot is not None
        assert mover.promote(w.ns, w.key, slot) == SLOT
        assert bytes(pool.view(slot)) == data
    assert mover.promote("t", b"absent", 0) is None
    s = mover.stats()
    assert (s.written_blocks_total, s.written_bytes_total) == (20, 20 * (SLOT + HEADER_SIZE))
    assert (s.promoted_blocks_total, s.promote_misses_total) == (20, 1)
    assert mover.close(5.0) == 0


def test_slot_under_write_back_cannot_be_freed(pool: DramPool, store: SsdStore) -> None:
    gate = threading.Event()

    def slow(batch: list[WriteBack], result: PutResult) -> None:
        gate.wait(10)

    mover = Mover(pool, store, WriteBudget.unlimited(), on_written=slow)
    (w, _), = fill(pool, 1)
    mover.submit(w)
    with pytest.raises(SlotPinned):
        pool.free(w.slot)  # pinned until the mover has written it
    gate.set()
    mover.close(5.0)
    pool.free(w.slot)


def test_full_queue_drops_without_blocking(pool: DramPool, store: SsdStore) -> None:
    gate = threading.Event()

    def stuck(batch: list[WriteBack], result: PutResult) -> None:
        gate.wait(10)

    mover = Mover(pool, store, WriteBudget.unlimited(),
                  MoverSpec(queue_bytes=4 * SLOT + 100, batch_blocks=1), on_written=stuck)
    started = time.perf_counter()
    results = [mover.submit(w) for w, _ in fill(pool, 12)]
    # the writer is stuck for 10 s: a submit that waited for it would take that long
    assert time.perf_counter() - started < 5.0
    # 4 slots fit the bound, whether queued or in the (stuck) writer's batch: the rest drop.
    assert results == [Submitted.QUEUED] * 4 + [Submitted.QUEUE_FULL] * 8
    s = mover.stats()
    assert (s.dropped_queue_full_total, s.held_bytes) == (8, 4 * SLOT)
    gate.set()
    mover.close(5.0)
    assert mover.stats().held_bytes == 0 and pool.stats().slots_pinned == 0


def test_queue_bound_must_hold_a_slot(pool: DramPool, store: SsdStore) -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        Mover(pool, store, WriteBudget.unlimited(), MoverSpec(queue_bytes=SLOT - 1))


def test_budget_gates_writes(pool: DramPool, store: SsdStore) -> None:
    t = [0.0]
    # 86_400 * 3 * 32 KiB per day = 3 blocks (+headers) per second; burst of 2 blocks
    budget = WriteBudget(86_400 * 3 * (SLOT + HEADER_SIZE), 2 * (SLOT + HEADER_SIZE), lambda: t[0])
    mover = Mover(pool, store, budget)
    blocks = fill(pool, 6)
    got = [mover.submit(w) for w, _ in blocks[:4]]
    assert got == [Submitted.QUEUED] * 2 + [Submitted.OVER_BUDGET] * 2
    t[0] += 1.0  # 3 more blocks of tokens, capped at the 2-block burst
    assert [mover.submit(w) for w, _ in blocks[2:5]] == [Submitted.QUEUED] * 2 + [
        Submitted.OVER_BUDGET
    ]
    mover.close(5.0)
    s = mover.stats()
    assert (s.dropped_budget_total, s.written_blocks_total) == (3, 4)
    assert budget.granted_bytes == 4 * (SLOT + HEADER_SIZE)


def test_close_reports_unwritten_items(pool: DramPool, store: SsdStore) -> None:
    gate = threading.Event()
    rec = Recorder(pool)

    def blocked(batch: list[WriteBack], result: PutResult) -> None:
        gate.wait(10)
        rec(batch, result)

    mover = Mover(pool, store, WriteBudget.unlimited(), MoverSpec(batch_blocks=1),
                  on_written=blocked)
    for w, _ in fill(pool, 5):
        mover.submit(w)
    threading.Timer(0.5, gate.set).start()
    dropped = mover.close(timeout=0.1)
    assert dropped >= 1
    assert mover.submit(fill(pool, 1)[0][0]) is Submitted.CLOSED
    assert len(rec.done) == 5 and sum(not ok for _, ok in rec.done) == dropped
    assert pool.stats().slots_pinned == 0
