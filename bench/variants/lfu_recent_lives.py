"""Frequency-aware main segment (what makes sglang-lfu win docqa): in S3-FIFO order, a main-list
block at the hand with HOT (default 8) or more accesses and an access within the last WK x
capacity (default 1) ticks of the index clock goes round again without losing a level (at most
one pass of the list per eviction), so popular documents outlast a CLOCK's three lives."""

import os

from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.policies.base import COUNT_BITS, COUNT_SHIFT, PROTECTED
from kvtier.index.types import HITS_BITS, HITS_MAX, Block

HOT = int(os.environ.get("HOT", "8"))
WK = float(os.environ.get("WK", "1"))


class LivesQueue(pa.AdaptiveQueue):
    __slots__ = ("now", "window")

    def __init__(self, share: float) -> None:
        super().__init__(share)
        self.now = 0
        self.window = 1 << 62

    def push(self, b: Block, cold: bool = False) -> None:
        self.now = max(self.now, b.stamp >> HITS_BITS)
        super().push(b, cold)

    def first(self) -> Block | None:
        if self.share >= 1.0:
            return super().first()
        s, m = self._s, self._m
        spins = 0
        while True:
            head = s.head
            if head is not None and (m.head is None or s.size > self.share * (s.size + m.size)):
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
                st = head.stamp
                if (st & HITS_MAX >= HOT and self.now - (st >> HITS_BITS) < self.window
                        and spins < m.size):
                    spins += 1
                else:
                    head.flags -= 1 << COUNT_SHIFT
                m.append(head)
                continue
            return head


_init = pa.AdaptivePolicy.__init__


def init(self: pa.AdaptivePolicy, dram: int | None, ssd: int | None, k: int) -> None:
    _init(self, dram, ssd, k)
    if isinstance(self.dram, LivesQueue):
        self.dram.window = int(WK * max(1, dram or 1))


pa.AdaptiveQueue = LivesQueue  # type: ignore[misc]
pa.AdaptivePolicy.__init__ = init  # type: ignore[method-assign]
