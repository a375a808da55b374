"""SlotWriteQueue (the SSD mover's and the remote tier's write-behind queue): the pinned-bytes
bound, batching, a failing writer, and what close hands back."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from kvtier.tiers.dram import DramPool, DramSpec
from kvtier.tiers.writeq import Offered, QueueSpec, SlotWriteQueue

SLOT = 16 << 10


class Item(NamedTuple):
    slot: int


@pytest.fixture
def pool() -> Iterator[DramPool]:
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", SLOT, 32))
    yield p
    p.close()


def slots(pool: DramPool, n: int) -> list[Item]:
    out = []
    for _ in range(n):
        s = pool.alloc()
        assert s is not None
        out.append(Item(s))
    return out


def test_bound_batches_and_unpins(pool: DramPool) -> None:
    gate = threading.Event()
    batches: list[list[Item]] = []
    done: list[tuple[list[Item], int | None]] = []

    def write(batch: list[Item]) -> int:
        gate.wait(10)
        batches.append(batch)
        return len(batch)

    q: SlotWriteQueue[Item, int] = SlotWriteQueue(
        pool, QueueSpec(4 * SLOT, 3), write, lambda b, r: done.append((b, r)), "test")
    items = slots(pool, 6)
    got = [q.offer(it) for it in items]
    assert got[:4] == [Offered.QUEUED] * 4 and got[4:] == [Offered.FULL] * 2
    assert q.held_bytes() == 4 * SLOT and pool.stats().slots_pinned == 4
    assert q.offer(items[4], lambda: False) is Offered.FULL  # full before the budget is asked
    gate.set()
    assert q.flush(10)
    assert [len(b) for b in batches] in ([3, 1], [1, 3], [1, 2, 1], [1, 1, 2], [2, 2])
    assert sorted(i for b, _ in done for i in b) == sorted(items[:4])
    assert all(r == len(b) for b, r in done)
    assert q.held_bytes() == 0 and pool.stats().slots_pinned == 0
    assert q.close(1) == 0


def test_refused_spend_leaves_slot_alone(pool: DramPool) -> None:
    q: SlotWriteQueue[Item, int] = SlotWriteQueue(
        pool, QueueSpec(4 * SLOT, 4), lambda b: 0, lambda b, r: None, "test")
    (it,) = slots(pool, 1)
    assert q.offer(it, lambda: False) is Offered.REFUSED
    assert pool.stats().slots_pinned == 0 and q.held_bytes() == 0
    q.close(1)
    assert q.offer(it) is Offered.CLOSED


def test_failing_writer_reports_none_and_keeps_running(pool: DramPool) -> None:
    calls = {"n": 0}
    done: list[tuple[list[Item], int | None]] = []

    def write(batch: list[Item]) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk on fire")
        return len(batch)

    q: SlotWriteQueue[Item, int] = SlotWriteQueue(
        pool, QueueSpec(8 * SLOT, 1), write, lambda b, r: done.append((b, r)), "test")
    a, b = slots(pool, 2)
    assert q.offer(a) is Offered.QUEUED
    assert q.flush(10)
    assert q.offer(b) is Offered.QUEUED
    assert q.flush(10)
    assert done == [([a], None), ([b], 1)]
    assert pool.stats().slots_pinned == 0
    q.close(1)


def test_close_hands_back_what_was_left(pool: DramPool) -> None:
    gate = threading.Event()
    done: list[tuple[list[Item], int | None]] = []

    def write(batch: list[Item]) -> int:
        gate.wait(10)
        return len(batch)

    q: SlotWriteQueue[Item, int] = SlotWriteQueue(
        pool, QueueSpec(8 * SLOT, 1), write, lambda b, r: done.append((b, r)), "test")
    items = slots(pool, 3)
    for it in items:
        assert q.offer(it) is Offered.QUEUED
    closer = threading.Thread(target=lambda: done.append(([], q.close(0.2))))
    closer.start()
    closer.join(0.5)
    gate.set()
    closer.join(10)
    written = [b for b, r in done if b and r is not None]
    left = [b for b, r in done if b and r is None]
    assert sum(map(len, written)) + sum(map(len, left)) == 3
    assert sum(map(len, left)) == 2  # the one in flight was written, the queued two handed back
    assert pool.stats().slots_pinned == 0 and q.held_bytes() == 0


def test_queue_must_hold_one_slot(pool: DramPool) -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        SlotWriteQueue(pool, QueueSpec(SLOT - 1, 4), lambda b: 0, lambda b, r: None, "test")


def test_urgent_items_go_first_within_a_bound_of_their_own(pool: DramPool) -> None:
    """A queue full of background writes still takes urgent ones (a prefill's hand-off), asks
    them no budget, and writes them before every background item queued."""
    gate = threading.Event()
    started = threading.Event()
    order: list[Item] = []

    def write(batch: list[Item]) -> int:
        started.set()
        gate.wait(10)
        order.extend(batch)
        return len(batch)

    q: SlotWriteQueue[Item, int] = SlotWriteQueue(
        pool, QueueSpec(2 * SLOT, 1), write, lambda b, r: None, "test")
    items = slots(pool, 7)
    assert q.offer(items[0]) is Offered.QUEUED
    assert started.wait(10)  # the writer holds items[0]: the rest stays queued
    assert q.offer(items[1]) is Offered.QUEUED
    assert q.offer(items[2]) is Offered.FULL  # background bound: 2 slots
    urgent = [q.offer(it, lambda: False, urgent=True) for it in items[3:6]]
    assert urgent == [Offered.QUEUED, Offered.QUEUED, Offered.FULL]  # their own 2 slots
    assert q.held_bytes() == 4 * SLOT and pool.stats().slots_pinned == 4
    gate.set()
    assert q.flush(10)
    assert order == [items[0], items[3], items[4], items[1]]
    assert q.held_bytes() == 0 and pool.stats().slots_pinned == 0
    q.close(1)
