"""``sieve``: SIEVE (Zhang et al., NSDI 2024).

One FIFO, a visited bit set on a hit, a hand that walks from the oldest entry clearing visited
bits and evicts the first unvisited one.

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.base import MARK, BlockList, EvictionQueue, Policy

if TYPE_CHECKING:
    from kvtier.index.types import Block


class SieveQueue(BlockList, EvictionQueue):
    """SIEVE: FIFO order (head = oldest), `MARK` = visited, a hand that moves from old to new."""

    __slots__ = ("_hand",)
    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._hand: Block[Any] | None = None

    def push(self, b: Block[Any], cold: bool = False) -> None:
        if cold:
            self.appendleft(b)
        else:
            self.append(b)

    def discard(self, b: Block[Any]) -> None:
        if self._hand is b:
            self._hand = b.next
        self.unlink(b)

    def touch(self, b: Block[Any]) -> None:
        b.flags |= MARK

    def first(self) -> Block[Any] | None:
        b = self._hand or self.head
        for _ in range(self.size + 1):
            if b is None:
                b = self.head
                if b is None:
                    return None
            if not b.flags & MARK:
                self._hand = b
                return b
            b.flags &= ~MARK
            b = b.next
        self._hand = b
        return b

    def __iter__(self) -> Iterator[Block[Any]]:
        hand = self._hand or self.head
        seen = []
        b = hand
        while b is not None:
            seen.append(b)
            b = b.next
        b = self.head
        while b is not None and b is not hand:
            seen.append(b)
            b = b.next
        yield from sorted(seen, key=lambda x: bool(x.flags & MARK))

    def __len__(self) -> int:
        return self.size


class SievePolicy(Policy):
    name = "sieve"
    marks = True

    def mark(self, b: Block[Any]) -> None:
        b.flags |= MARK

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return SieveQueue()
