"""``lmcache-s3fifo``: LMCache ``cache_policy/s3fifo.py``.

A small FIFO S (10%), a main FIFO M and ghosts G; 2-bit frequency; new keys enter S, a ghost hit
enters M; S's oldest moves to M if its frequency is > 1, else leaves (into G); M's oldest with
frequency > 0 is reinserted with frequency - 1, else leaves. S's share is counted over the
evictable blocks; the ghosts are the index's admission history.

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.base import (
    COUNT_BITS,
    COUNT_SHIFT,
    PROTECTED,
    BlockList,
    EvictionQueue,
    Policy,
)
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block


class S3FifoQueue(EvictionQueue):
    """LMCache's S3-FIFO over the evictable blocks. Flags: `PROTECTED` = in M, the 2-bit count
    at `COUNT_SHIFT` = frequency. `first` does S3-FIFO's moves (S -> M, M reinsertion) lazily:
    they only reorder blocks inside the queue, and each costs one frequency unit or one S -> M
    move, so they are O(1) amortised."""

    __slots__ = ("_m", "_ratio", "_s")
    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        self._s = BlockList()
        self._m = BlockList()
        self._ratio = small_ratio

    def push(self, b: Block[Any], cold: bool = False) -> None:
        lst = self._m if b.flags & PROTECTED else self._s
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block[Any]) -> None:
        (self._m if b.flags & PROTECTED else self._s).unlink(b)

    def touch(self, b: Block[Any]) -> None:
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f + (1 << COUNT_SHIFT)

    def first(self) -> Block[Any] | None:
        s, m = self._s, self._m
        while True:
            head = s.head
            if head is not None and (s.size > self._ratio * (s.size + m.size) or m.head is None):
                if (head.flags & COUNT_BITS) >> COUNT_SHIFT > 1:
                    s.unlink(head)
                    head.flags |= PROTECTED
                    m.append(head)
                    continue
                return head
            head = m.head
            if head is None:
                return None
            if head.flags & COUNT_BITS:
                m.unlink(head)
                head.flags -= 1 << COUNT_SHIFT
                m.append(head)
                continue
            return head

    def __iter__(self) -> Iterator[Block[Any]]:
        yield from self._s
        yield from self._m

    def __len__(self) -> int:
        return self._s.size + self._m.size


class S3FifoPolicy(Policy):
    name = "lmcache-s3fifo"
    ghosts = True
    hooks = True
    marks = True

    def mark(self, b: Block[Any]) -> None:
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f + (1 << COUNT_SHIFT)

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return S3FifoQueue()

    def inserted(self, b: Block[Any]) -> None:
        if b.stamp & HITS_MAX > 1:  # a ghost hit enters M
            b.flags |= PROTECTED
