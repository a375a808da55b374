"""The adaptive policy's eviction queue (`AdaptiveQueue`): one order of four, the policy's *mode*.

Over the evictable blocks only (the index's leaf-first rule decides membership), in one of:

- LRU (share >= 1, also `FILTER`, which differs only in admission): one list, exactly the ``lru``
  policy's queue — a new or re-queued block at the hot end (the cold end when the index says it
  is older than the coldest), a hit moves it to the hot end, the cold end leaves. Same victims in
  the same order as ``lru`` (tested against it).
- S3-FIFO-like (share < 1): a *probation* list S (LRU order) where new blocks enter and a *main*
  list M (`PROTECTED`, a CLOCK on the 2-bit hit counter at `COUNT_SHIFT`). While S holds more than
  its share of the queue its oldest block leaves, or moves to M if it was hit twice since it was
  stored; else M's oldest block with a count goes round again one lower and the first without one
  leaves. A ghost hit (flagged `PROTECTED` by the policy) enters M; the block named by `cold_next`
  enters S's cold end.
- `LFU`: per-count lists (`LfuQueue`): the lowest index access count leaves, the least recently
  used among equal counts.

A switch re-ranks the blocks and drops none, O(blocks) (at most a few an epoch of the mini
simulations): into S3 the LRU list splits into S and M by `PROTECTED`, order kept; into LRU every
block goes to the one list by its last access; into LFU by count, least recent first. The counter
and `PROTECTED` are kept up in every mode, so a later S3 mode starts from them.

With ``lru_main=False`` (the SSD queue, and DRAM in front of a larger SSD, neither of which
switches) the LRU order keeps S and M apart and the older of the two cold ends leaves, with M
not reordered by hits: the recency buffer measured for two tiers.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.adaptive.minisim import LFU
from kvtier.index.policies.base import COUNT_BITS, COUNT_SHIFT, PROTECTED, BlockList, EvictionQueue
from kvtier.index.policies.lfu import LfuQueue
from kvtier.index.types import HITS_BITS, HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block

HOT_HITS = 8
"""Accesses (index count, the commit included) from which a block enters a queue at the top
frequency (an inner block is in no queue, so its hits reached no counter); measured: 8 gains on
docqa/chat at 1-2% (+6%/+2%) without the losses of 2-4 on the sample trace at 10% (-5%/-2%)."""


def _last(b: Block[Any]) -> int:
    return b.stamp >> HITS_BITS


class AdaptiveQueue(EvictionQueue):
    """The queue in one of its modes (module docstring); `share` is the mode (`set_share`)."""

    __slots__ = ("_f", "_lru", "_m", "_s", "cold_next", "lru_main", "share")
    name = "adaptive"

    def __init__(self, share: float, lru_main: bool = False) -> None:
        self._s = BlockList()
        """S3 mode: probation; LRU mode with `lru_main`: the one list."""
        self._m = BlockList()
        self._f: LfuQueue | None = None
        """`LFU` mode: the blocks are in this queue instead of the lists."""
        self.lru_main = lru_main
        """The queue switches modes and its LRU mode is the ``lru`` policy's one list."""
        self.share = 0.1
        self._lru = False
        """One list in the ``lru`` policy's order (LRU or FILTER mode with `lru_main`)."""
        self.cold_next: Block[Any] | None = None
        self.set_share(share)

    def set_share(self, share: float) -> None:
        """Change the mode; O(blocks) when the order changes, nothing dropped."""
        if share == self.share:
            return
        lru = self.lru_main and share >= 1.0 and share != LFU
        if share == LFU or self._f is not None or lru != self._lru:
            blocks = list(self)
            s, m = self._s, self._m = BlockList(), BlockList()
            self._f = None
            if share == LFU:
                f = self._f = LfuQueue()
                for b in sorted(blocks, key=_last):
                    f.push(b)
            elif lru:
                for b in sorted(blocks, key=_last):
                    s.append(b)
            else:  # into S3 (or the two-list recency order): by `PROTECTED`, order kept
                for b in blocks:
                    (m if b.flags & PROTECTED else s).append(b)
        self._lru = lru
        self.share = share

    def push(self, b: Block[Any], cold: bool = False) -> None:
        if b.stamp & HITS_MAX >= HOT_HITS:  # hit while out of the queue (an inner block)
            b.flags |= COUNT_BITS
        if b is self.cold_next:
            self.cold_next = None
            cold = cold or (not self._lru and self._f is None and not b.flags & PROTECTED)
        if self._lru:
            lst = self._s
        elif self._f is not None:
            self._f.push(b, cold)
            return
        else:
            lst = self._m if b.flags & PROTECTED else self._s
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block[Any]) -> None:
        if self._lru:
            self._s.unlink(b)
        elif self._f is not None:
            self._f.discard(b)
        else:
            (self._m if b.flags & PROTECTED else self._s).unlink(b)

    def touch(self, b: Block[Any]) -> None:
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f = f + (1 << COUNT_SHIFT)
        if self._lru:
            self._s.move_to_end(b)
        elif self._f is not None:
            self._f.touch(b)
        elif not f & PROTECTED:
            self._s.move_to_end(b)

    def first(self) -> Block[Any] | None:
        s = self._s
        if self._lru:
            return s.head
        if self._f is not None:
            return self._f.first()
        m = self._m
        if self.share >= 1.0:  # two lists by recency: the older of the two cold ends
            a, b = s.head, m.head
            if a is None or b is None:
                return a or b
            return a if _last(a) <= _last(b) else b
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
                head.flags -= 1 << COUNT_SHIFT
                m.append(head)
                continue
            return head

    def __iter__(self) -> Iterator[Block[Any]]:
        if self._f is not None:
            yield from self._f
        yield from self._s
        yield from self._m

    def __len__(self) -> int:
        return self._s.size + self._m.size + (len(self._f) if self._f is not None else 0)
