"""The mover: write-back of DRAM evictees to SSD and promotion of SSD hits into DRAM slots.

Write-back (asynchronous):

    daemon admits block in slot s ──submit()──▶ [wear budget · bounded queue]
                                                   │ (s is pinned: it cannot be reused)
                       writer thread ◀─────────────┘ batches of up to `batch_blocks`
                       SsdStore.put_many(batch)  (one LMDB transaction, zero-copy from slots)
                       unpin each slot, then on_written(batch, result)  → the daemon records
                                                                          the SSD copies

What is written back, and when, is the placement planner's decision (`kvtier.index.placement`:
the k-th access, prefix closure, SSD room), made before `submit`. The queue and its writer thread
are `kvtier.tiers.writeq.SlotWriteQueue` (shared with the remote tier's write-through). `submit`
never blocks: a write-back over the wear budget, or that finds the queue full
(`MoverSpec.queue_bytes` of slots already held), is dropped and counted; the caller keeps the
slot.

Promotion (synchronous, on the caller's thread): `promote(ns, key, slot)` copies a verified
SSD payload into a DRAM slot the caller allocated and has not published yet.

Threading and ownership: `submit`, `promote` and `stats` may be called from any thread.
`on_written` runs on the writer thread (the daemon must lock its own index inside it). The mover
owns neither the pool nor the store: shut down with `close(timeout)` (flushes the queue), then
close the store (`SsdStore.close`), then the pool.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from kvtier.core.wear import WriteBudget
from kvtier.tiers import blockfmt
from kvtier.tiers.dram import DramPool
from kvtier.tiers.ssd.store import PutItem, PutResult, SsdStore
from kvtier.tiers.writeq import Offered, QueueSpec, SlotWriteQueue

log = logging.getLogger(__name__)


S = TypeVar("S", bound=str)
"""The namespace type of the mover's owner (the daemon's `Namespace`): a write-back comes back
to `on_written` as it was submitted."""


class WriteBack(NamedTuple, Generic[S]):
    ns: S
    key: bytes
    parent: bytes | None
    slot: int
    nbytes: int  # payload bytes in the slot


class Submitted(enum.Enum):
    QUEUED = "queued"
    ALREADY_STORED = "already_stored"
    OVER_BUDGET = "over_budget"
    QUEUE_FULL = "queue_full"
    CLOSED = "closed"


OnWritten = Callable[[list[WriteBack[S]], PutResult], None]


@dataclass(frozen=True)
class MoverSpec:
    """`queue_bytes` bounds the DRAM the mover holds pinned: every write-back queued or being
    written counts its slot's bytes (its size class's stride) until its batch is written; an
    empty queue takes one write-back of any size. The daemon's default is min(DRAM / 4, 1 GiB)
    (`Config.writeback_queue_bytes`)."""

    queue_bytes: int = 1 << 30
    batch_blocks: int = 64
    linger_s: float = 0.002


class MoverStats(NamedTuple):
    queue_depth: int  # blocks waiting for the writer
    queued_total: int
    dropped_queue_full_total: int
    dropped_budget_total: int
    written_blocks_total: int
    written_bytes_total: int
    refused_total: int
    promoted_blocks_total: int
    promoted_bytes_total: int
    promote_misses_total: int
    held_bytes: int  # slot bytes pinned by queued or in-flight write-backs (<= queue_bytes)


@dataclass(slots=True)
class _Counts:
    queued: int = 0
    full: int = 0
    budget: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    refused: int = 0
    promoted: int = 0
    promoted_bytes: int = 0
    promote_misses: int = 0


class Mover(Generic[S]):
    def __init__(
        self,
        pool: DramPool,
        store: SsdStore,
        budget: WriteBudget,
        spec: MoverSpec = MoverSpec(),
        on_written: OnWritten[S] | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.budget = budget
        self.spec = spec
        self.on_written = on_written
        self._c = _Counts()
        self._q: SlotWriteQueue[WriteBack[S], PutResult] = SlotWriteQueue(
            pool, QueueSpec(spec.queue_bytes, spec.batch_blocks, spec.linger_s),
            self._write, self._written, "write-back")

    # -- write-back -------------------------------------------------------------------------

    def submit(self, item: WriteBack[S]) -> Submitted:
        """Queue a write-back without blocking; on QUEUED the slot stays pinned until written
        (the queue pins it, or the pool's owner does: `SlotWriteQueue.offer`).

        On any other result the slot is untouched and stays the caller's to free.
        """
        if self._q.closing:
            return Submitted.CLOSED
        if not 0 < item.nbytes <= self.pool.max_block:
            raise ValueError(f"write-back of {item.nbytes} bytes (blocks are 1..."
                             f"{self.pool.max_block} B)")
        if self.store.contains(item.ns, item.key):
            return Submitted.ALREADY_STORED
        size = self.pool.stride_of(item.slot)
        if item.nbytes > size:
            raise ValueError(f"write-back of {item.nbytes} bytes from a {size}-byte slot")
        cost = item.nbytes + blockfmt.HEADER_SIZE
        got = self._q.offer(item, lambda: self.budget.try_spend(cost))
        if got is Offered.QUEUED:
            self._c.queued += 1
            return Submitted.QUEUED
        if got is Offered.FULL:
            self._c.full += 1
            return Submitted.QUEUE_FULL
        if got is Offered.REFUSED:
            self._c.budget += 1
            return Submitted.OVER_BUDGET
        return Submitted.CLOSED

    def _write(self, batch: list[WriteBack[S]]) -> PutResult:
        items = [
            PutItem(w.ns, w.key, w.parent, self.pool.view(w.slot, w.nbytes)) for w in batch
        ]
        try:
            return self.store.put_many(items)
        finally:
            del items

    def _written(self, batch: list[WriteBack[S]], result: PutResult | None) -> None:
        """The batch's slots are unpinned: refund what was not stored, tell the daemon."""
        if result is None:  # the write failed, or the mover closed before it
            result = PutResult([], [(w.ns, w.key) for w in batch], [], 0)
        refused = set(result.refused)
        for w in batch:
            if (w.ns, w.key) in refused:
                self.budget.refund(w.nbytes + blockfmt.HEADER_SIZE)
        c = self._c
        c.written_blocks += len(batch) - len(refused)
        c.written_bytes += result.bytes_written
        c.refused += len(refused)
        if self.on_written is not None:
            self.on_written(batch, result)

    # -- promotion ----------------------------------------------------------------------------

    def promote(self, ns: str, key: bytes, slot: int) -> int | None:
        """Copy a verified SSD block into an allocated, unpublished DRAM slot; bytes or None."""
        return self.promote_many([(ns, key, slot)])[0]

    def promote_many(self, reads: list[tuple[str, bytes, int]]) -> list[int | None]:
        """`promote` for a batch (one read transaction, read-ahead for all of it)."""
        got = self.store.get_many_into([(t, k, self.pool.view(s)) for t, k, s in reads])
        for (ns, key, _), n in zip(reads, got, strict=True):
            if n is None:
                self._c.promote_misses += 1
                continue
            self.store.record_access(ns, key)
            self._c.promoted += 1
            self._c.promoted_bytes += n
        return got

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write-back is written; False on timeout."""
        return self._q.flush(timeout)

    def close(self, timeout: float = 10.0) -> int:
        """Stop taking write-backs, write what is queued (up to `timeout`), stop the thread.

        Returns how many queued write-backs were dropped; their slots are unpinned and reported
        through `on_written` as refused, so the daemon frees them.
        """
        left = self._q.close(timeout)
        self.store.flush_stats()
        return left

    def stats(self) -> MoverStats:
        c = self._c
        return MoverStats(
            self._q.depth(), c.queued, c.full, c.budget, c.written_blocks,
            c.written_bytes, c.refused, c.promoted, c.promoted_bytes, c.promote_misses,
            self._q.held_bytes(),
        )
