"""A bounded write queue of pinned DRAM slots, drained in batches by one writer thread.

    offer(item, spend) ──▶ [closed? · bytes of pinned slots ≤ queue_bytes · spend()] ──▶ pin slot
                              │                                                    queue item
    writer thread ◀───────────┘ batches of up to `batch_blocks` (waits `linger_s` for a fuller one)
    write(batch) -> R   (no lock held; an exception is logged and reported as R = None)
    unpin each slot, then done(batch, R)   (R None: nothing of the batch was written)

Both write-behind paths of the daemon use it: the SSD mover (`kvtier.tiers.mover`) and the
remote tier's write-through (`kvtier.daemon.cache.remote_tier`). The bound is in slot bytes (each
item counts its slot's size-class stride, `DramPool.stride_of`) because what a queued write
costs is the DRAM it keeps pinned; an empty queue takes one item of any size. `offer` never
blocks and never waits on I/O: the caller learns at once whether the slot is now the queue's.
The queue pins the slots itself only in a pool that keeps its own pins; the daemon's pool has
an owner (the prefix index, `DramPool.owner`), and the daemon pins each block there before it
offers its slot and unpins it in `done`: one owner for every pin.

Urgent items (`offer(..., urgent=True)`: the remote tier's prefill hand-offs, which a decode
engine elsewhere waits for) go out before every background item queued, are not asked `spend`,
and have a bound of their own (`queue_bytes` of urgent slots), so a queue full of background
writes never refuses or delays them.

Lifecycle: `flush(timeout)` waits until everything queued is written; `close(timeout)` flushes,
stops taking items, stops the thread and hands what is left to `done(left, None)` with its
slots unpinned. Threading: `offer`, `flush`, `close`, `depth` and `held_bytes` from any thread;
`write` and `done` run on the writer thread (or on `close`'s caller for what was left). Lock
order: callers may hold their own lock when they `offer` (the daemon's cache lock); under the
queue's lock `offer` asks `spend` and takes the pool's lock (pin), nothing else. `write` and `done`
run with the queue's lock released, so they may take the caller's lock (`done` does).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvtier.tiers.dram import DramPool

log = logging.getLogger(__name__)


class HasSlot(Protocol):
    @property
    def slot(self) -> int: ...


T = TypeVar("T", bound=HasSlot)
R = TypeVar("R")


class Offered(enum.Enum):
    QUEUED = "queued"
    FULL = "full"
    REFUSED = "refused"  # `spend` said no
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    queue_bytes: int
    batch_blocks: int
    linger_s: float = 0.0


class SlotWriteQueue(Generic[T, R]):
    def __init__(self, pool: DramPool, spec: QueueSpec, write: Callable[[list[T]], R],
                 done: Callable[[list[T], R | None], None], name: str) -> None:
        if spec.queue_bytes < pool.slot_size:
            raise ValueError(f"{name} queue of {spec.queue_bytes} bytes cannot hold one "
                             f"{pool.slot_size}-byte slot")
        if spec.batch_blocks < 1:
            raise ValueError(f"{name} batches need at least one block")
        self.pool = pool
        self.spec = spec
        self.name = name
        self._write = write
        self._done = done
        self._queue: collections.deque[T] = collections.deque()
        self._urgent: collections.deque[T] = collections.deque()
        self._held = 0  # slot bytes of items queued or being written
        self._held_urgent = 0  # of which urgent items'
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}", daemon=True)
        self._thread.start()

    @property
    def closing(self) -> bool:
        return self._closing

    def depth(self) -> int:
        """Items waiting for the writer (not counting a batch being written)."""
        return len(self._queue) + len(self._urgent)

    def held_bytes(self) -> int:
        """Slot bytes pinned by queued or in-flight items (<= queue_bytes, or one item, for the
        background items; as much again for the urgent ones)."""
        return self._held

    def offer(self, item: T, spend: Callable[[], bool] | None = None, urgent: bool = False
              ) -> Offered:
        """Queues `item` without blocking. On QUEUED its slot is pinned until `done` reports
        it — by the queue in a pool that keeps its own pins, else by the offerer, who pinned the
        slot's block with the pool's owner before offering (the daemon) —; otherwise the slot
        is untouched. `spend` (a budget, under the queue's lock) is asked
        only when the item fits; its False is REFUSED. An `urgent` item goes ahead of the
        background ones, within a bound of its own, and is not asked `spend`."""
        size = self.pool.stride_of(item.slot)
        with self._cv:
            if self._closing:
                return Offered.CLOSED
            held = self._held_urgent if urgent else self._held - self._held_urgent
            if held and held + size > self.spec.queue_bytes:
                return Offered.FULL
            if not urgent and spend is not None and not spend():
                return Offered.REFUSED
            if self.pool.owner is None:  # else the offerer pinned the slot's block
                self.pool.pin(item.slot)
            (self._urgent if urgent else self._queue).append(item)
            self._held += size
            self._held_urgent += size if urgent else 0
            self._cv.notify()
        return Offered.QUEUED

    def _run(self) -> None:
        spec = self.spec
        while True:
            with self._cv:
                while not self._queue and not self._urgent and not self._closing:
                    self._cv.wait()
                if not self._queue and not self._urgent:
                    return
                if (not self._urgent and len(self._queue) < spec.batch_blocks
                        and not self._closing and spec.linger_s):
                    self._cv.wait(spec.linger_s)
                urgent = min(len(self._urgent), spec.batch_blocks)
                n = min(len(self._queue), spec.batch_blocks - urgent)
                if urgent + n == 0:
                    continue
                batch = [self._urgent.popleft() for _ in range(urgent)]
                batch += [self._queue.popleft() for _ in range(n)]
                # pinned (allocated) slots: their strides stay what they were when queued
                held_urgent = sum(self.pool.stride_of(w.slot) for w in batch[:urgent])
                held = held_urgent + sum(self.pool.stride_of(w.slot) for w in batch[urgent:])
                self._busy = True
            try:
                self._finish(batch, self._attempt(batch))
            finally:
                with self._cv:
                    self._busy = False
                    self._held -= held
                    self._held_urgent -= held_urgent
                    self._cv.notify_all()

    def _attempt(self, batch: list[T]) -> R | None:
        try:
            return self._write(batch)
        except Exception:  # a bug or an I/O error: never let the writer thread die
            log.exception("%s write of %d blocks failed", self.name, len(batch))
            return None

    def _finish(self, batch: list[T], result: R | None) -> None:
        if self.pool.owner is None:
            for w in batch:
                self.pool.unpin(w.slot)
        try:
            self._done(batch, result)
        except Exception:
            log.exception("%s: completion of %d writes failed; their slots may leak",
                          self.name, len(batch))

    def flush(self, timeout: float) -> bool:
        """Waits until every queued item is written; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._urgent or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> int:
        """Stops taking items, writes what is queued (up to `timeout`), stops the thread; what
        is left goes to `done(left, None)`, slots unpinned. Returns how many were left."""
        flushed = self.flush(timeout)
        with self._cv:
            self._closing = True
            left = [*self._urgent, *self._queue]
            self._urgent.clear()
            self._queue.clear()
            self._held -= sum(self.pool.stride_of(w.slot) for w in left)
            self._held_urgent = 0
            self._cv.notify_all()
        self._thread.join(timeout=max(timeout, 1.0))
        if left:
            log.warning("%s queue closed with %d writes unwritten (flushed=%s)",
                        self.name, len(left), flushed)
            self._finish(left, None)
        return len(left)
