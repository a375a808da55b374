"""The adaptive policy's eviction queue (`AdaptiveQueue`): probation and main, in one of four modes.

Eviction (`AdaptiveQueue`, over the evictable blocks only — the index's leaf-first rule decides
membership): a *probation* list S (LRU order) where new blocks enter and a *main* list M
(`PROTECTED`, a CLOCK on a 2-bit hit counter). While S holds more than its share of the queue, its
oldest block leaves — or moves to M if it was hit twice since it was stored; else M's oldest block
with a count goes round again one lower and the first without one leaves. A ghost hit (the admission
history remembers the key of a block that left: it came back within about a cache's worth of drops)
enters M directly. With share 0.1 that is S3-FIFO-like (frequency first, scans stay in S); with
share 1.0 the queue is plain LRU (a hit moves a block to the hot end of its list, M's too, and the
older of the two cold ends leaves). The policy has four modes, its *candidates*: share 0.1 with the
predictor below placing blocks; plain LRU (every missed block stored at the hot end, no predictor:
the `lru` policy's order and admission); `FILTER`, LRU behind the reuse filter (vLLM's store-after-
two-lookups, the `vllm-reuse` peer: a missed block is stored only if its key was seen before, in a
`SeenTable` of the last ~`SEEN_MIN` or 2 x capacity missed keys, and a chain's blocks only up to the
first key not seen); and `LFU` (the `sglang-lfu` order: the lowest access count leaves, the least
recently used among equal counts; every missed block stored; the counts are the index's, which the
admission history resumes for a block that comes back). Into LFU the queue moves its blocks to per-
count lists (`LfuQueue`) in recency order, out of it back to S and M, lowest count at the cold end —
O(blocks) a switch, at most a few an epoch; nothing is dropped (issue 29, seventh pass: the mode
wins docqa at 1-5% and chat at 1%, where the peer LFU was 3-5% ahead). Which one the workload wants
is measured online: `kvtier.index.policies.adaptive.minisim` runs all four on a sample of the keys
at a fraction of the capacity and the queue follows the one with more hits, LRU unless another wins
by 5% — so the policy is bounded below by the better of its candidates LRU and the reuse filter, up
to the mini simulations' error (issue 29: the share-0.1 mode with the predictor alone fell 3-7%
under LRU at 10-20% on shapes it was not tuned on, and under the reuse filter at 1-5%). The
share-0.1 copy sees what the predictor decided for its sampled missed keys (cold end, not stored:
`admit` hands them over) and its score is calibrated by the real cache's hits of the sampled keys
while the queue runs that mode (`MiniSims.factor`; issue 29, second pass: without them the copy
ranked the mode 30-40% under the real cache on long reuse distances, and the queue left it for the
filter or LRU there at 0.67-0.75x the best peer). The LFU copy is calibrated the same way, and must
win by 10% and 3 deviations; no switch is made on fewer than 50 hits (a few requests' chains), and a
clear win (4 deviations) switches at a quarter of an epoch.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtier.index.policies.adaptive.minisim import LFU
from kvtier.index.policies.base import COUNT_BITS, COUNT_SHIFT, PROTECTED, BlockList, EvictionQueue
from kvtier.index.policies.lfu import LfuQueue
from kvtier.index.types import HITS_BITS, HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block

HOT_HITS = 8
"""Accesses (index count, the commit included) from which a block enters a queue at the top
frequency; measured: 8 gains on docqa/chat at 1-2% (+6%/+2%) without the losses of 2-4 on the
sample trace at 10% (-5%/-2%)."""


class AdaptiveQueue(EvictionQueue):
    """Probation S (LRU order) and main M (`PROTECTED`, a CLOCK on the 2-bit frequency at
    `COUNT_SHIFT`), S's share of the evictable blocks set by the policy (`share`; >= 1: S alone,
    plain LRU). S's oldest moves to M when hit more than once (its frequency > 1), M's oldest
    with a frequency goes round again one lower. A block entering with `HOT_HITS` accesses or
    more starts at the top frequency: an inner block of a chain is in no queue, so its hits
    reached no counter (the index counts them in `Block.stamp`). The block named by `cold_next`
    (set by the policy just before the index queues a new block) enters S's cold end."""

    __slots__ = ("_f", "_m", "_s", "cold_next", "lru_main", "share")
    name = "adaptive"

    def __init__(self, share: float, lru_main: bool = False) -> None:
        self._s = BlockList()
        self._m = BlockList()
        self._f: LfuQueue | None = None
        """In `LFU` mode the blocks are in this queue instead of S and M (`set_share`)."""
        self.share = share
        self.lru_main = lru_main
        """In LRU order a hit moves a main block to main's hot end too, so the older of the two
        cold ends is the least recently used block (the DRAM queue of a policy whose modes
        include plain LRU; the SSD queue and a DRAM recency buffer keep main in CLOCK order, as
        measured before issue 29)."""
        self.cold_next: Block | None = None

    def set_share(self, share: float) -> None:
        """Change the mode. Into `LFU`: every block moves to the frequency lists, least recently
        used first (so recency orders equal counts); out of it: every block goes back to S or M
        (by its `PROTECTED` flag), the lowest count at the cold end. O(blocks) per change of
        mode, at most once an epoch of the mini simulations; nothing is dropped."""
        if (share == LFU) != (self._f is not None):
            s, m = self._s, self._m
            if self._f is None:
                f = self._f = LfuQueue()
                for b in sorted([*s, *m], key=lambda b: b.stamp >> HITS_BITS):
                    f.push(b)
                self._s, self._m = BlockList(), BlockList()
            else:
                blocks, self._f = list(self._f), None
                for b in blocks:
                    (m if b.flags & PROTECTED else s).append(b)
        self.share = share

    def push(self, b: Block, cold: bool = False) -> None:
        if b.stamp & HITS_MAX >= HOT_HITS:  # hit while out of the queue (an inner block)
            b.flags |= COUNT_BITS
        if self._f is not None:
            self._f.push(b, cold)
            return
        if b.flags & PROTECTED:
            lst = self._m
        else:
            lst = self._s
            if b is self.cold_next:
                cold = True
                self.cold_next = None
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block) -> None:
        if self._f is not None:
            self._f.discard(b)
        else:
            (self._m if b.flags & PROTECTED else self._s).unlink(b)

    def touch(self, b: Block) -> None:
        if self._f is not None:
            self._f.touch(b)
            return
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f = f + (1 << COUNT_SHIFT)
        if not f & PROTECTED:
            self._s.move_to_end(b)
        elif self.lru_main and self.share >= 1.0:  # LRU order: main by recency too
            self._m.move_to_end(b)

    def first(self) -> Block | None:
        if self._f is not None:
            return self._f.first()
        s, m = self._s, self._m
        lru = self.share >= 1.0
        if lru:  # the older of the two cold ends: recency only
            a, b = s.head, m.head
            if a is None or b is None:
                return a or b
            return a if a.stamp >> HITS_BITS <= b.stamp >> HITS_BITS else b
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

    def __iter__(self) -> Iterator[Block]:
        if self._f is not None:
            yield from self._f
        yield from self._s
        yield from self._m

    def __len__(self) -> int:
        return self._s.size + self._m.size + (len(self._f) if self._f is not None else 0)
