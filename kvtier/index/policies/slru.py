"""``slru``: segmented LRU, frequency-aware.

A block accessed fewer than two times sits in the *probation* list, one accessed again moves to the
*protected* list; protected holds at most `protected_fraction` of the queue (its coldest overflow
falls back to probation's hot end). Victims come from probation first, so one-shot blocks (a long
document read once) cannot flush blocks that are reused (a shared system prompt).

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.base import PROTECTED, BlockList, EvictionQueue, Policy
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block


class SlruQueue(EvictionQueue):
    __slots__ = ("_fraction", "_probation", "_protected")
    name = "slru"

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in (0, 1), got {protected_fraction}")
        self._fraction = protected_fraction
        self._probation = BlockList()
        self._protected = BlockList()

    def push(self, b: Block[Any], cold: bool = False) -> None:
        if b.stamp & HITS_MAX < 2:
            seg = self._probation
        else:
            b.flags |= PROTECTED
            seg = self._protected
        if cold:
            seg.appendleft(b)
        else:
            seg.append(b)
        self._rebalance()

    def discard(self, b: Block[Any]) -> None:
        if b.flags & PROTECTED:
            b.flags &= ~PROTECTED
            self._protected.unlink(b)
        else:
            self._probation.unlink(b)

    def touch(self, b: Block[Any]) -> None:
        if b.flags & PROTECTED:
            self._protected.move_to_end(b)
        elif b.stamp & HITS_MAX >= 2:
            self._probation.unlink(b)
            b.flags |= PROTECTED
            self._protected.append(b)
            self._rebalance()
        else:
            self._probation.move_to_end(b)

    def _rebalance(self) -> None:
        protected, probation = self._protected, self._probation
        limit = max(1, int(self._fraction * (protected.size + probation.size)))
        while protected.size > limit and protected.head is not None:
            b = protected.head
            protected.unlink(b)
            b.flags &= ~PROTECTED
            probation.append(b)

    def first(self) -> Block[Any] | None:
        return self._probation.head or self._protected.head

    def __iter__(self) -> Iterator[Block[Any]]:
        yield from self._probation
        yield from self._protected

    def __len__(self) -> int:
        return self._probation.size + self._protected.size


class SlruPolicy(Policy):
    name = "slru"

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return SlruQueue()
