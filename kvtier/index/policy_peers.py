"""The peers' eviction and admission policies, reproduced under the index's leaf-first rule.

Each queue orders only the blocks that may leave a tier now (leaves, or blocks with an SSD copy;
see `kvtier.index.state`), so every peer policy runs with our invariants: no stranded block, SSD
prefix-closed, pins respected. What each one reproduces (read from the peers' code, not copied):

- ``lru``: vLLM CPU offloading (``kv_offload/cpu/policies/lru.py``, an OrderedDict moved to the
  end on touch), SGLang's radix cache (``mem_cache/evict_policy.py`` ``LRUStrategy``: a heap of
  evictable leaves by ``last_access_time``) and LMCache (``cache_policy/lru.py``) all evict the
  least recently used evictable entry: under our rule they are one policy, `kvtier.index.policies.
  LruQueue`.
- ``vllm-arc``: vLLM ``kv_offload/cpu/policies/arc.py``: new blocks enter T1, a hit moves a T1
  block to T2; a ghost hit (a key evicted from T1 = B1, from T2 = B2) moves the target size of T1
  up or down; the victim is T1's LRU while ``len(T1) >= target``, else T2's. Ghosts here are the
  index's admission history (a reinserted key whose remembered count is 1 was evicted from T1,
  >= 2 from T2); the step is 1 (vLLM scales it by ``len(B2) / len(B1)``, which a direct-mapped
  history does not count).
- ``vllm-reuse``: vLLM ``kv_offload/reuse_manager.py`` ``FilterReusedOffloadingManager`` over
  LRU: every lookup counts each key of the request in an LRU table of 64,000 keys; a block is
  stored only once its key was counted ``store_threshold`` = 2 times.
- ``sglang-lfu``: SGLang ``LFUStrategy``: evict the evictable leaf with the lowest
  ``(hit_count, last_access_time)``. ``lmcache-lfu``: LMCache ``cache_policy/lfu.py``, buckets by
  frequency, FIFO inside a bucket (an entry enters the bucket of its new count on a hit): under
  our rule that is the same order, one `LfuQueue`.
- ``sglang-hicache``: SGLang HiCache ``write_through_selective`` (``hiradix_cache.py``
  ``_inc_hit_count``: a node is backed up to host memory once ``hit_count >=
  write_through_threshold`` = 2) over LRU eviction: our DRAM is the host tier, so a block is
  stored on its 2nd reference; references of blocks not stored are counted in a direct-mapped
  table of one word per block of capacity (the engine's GPU radix tree counts them in SGLang).
- ``lmcache-s3fifo``: LMCache ``cache_policy/s3fifo.py``: a small FIFO S (10%), a main FIFO M
  and ghosts G; 2-bit frequency; new keys enter S, a ghost hit enters M; S's oldest moves to M if
  its frequency is > 1, else leaves (into G); M's oldest with frequency > 0 is reinserted with
  frequency - 1, else leaves. S's share is counted over the evictable blocks.
- ``sieve``: SIEVE (Zhang et al., NSDI 2024): one FIFO, a visited bit set on a hit, a hand that
  walks from the oldest entry clearing visited bits and evicts the first unvisited one.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier.core.types import BlockKey
from kvtier.index.policies import (
    COUNT_BITS,
    COUNT_SHIFT,
    MARK,
    PROTECTED,
    BlockList,
    EvictionQueue,
    Policy,
)
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block, Tenant


_LFU_TOP = HITS_MAX - 1  # counts saturate at HITS_MAX: the last two share one list


class LfuQueue(EvictionQueue):
    """Lowest access count first, least recently used first among equal counts.

    One list per count (a hit moves the block to its new count's list, at the hot end) and a heap
    of the counts that have a list; O(log distinct counts) per operation."""

    __slots__ = ("_heap", "_lists", "_size")
    name = "lfu"

    def __init__(self) -> None:
        self._lists: dict[int, BlockList] = {}
        self._heap: list[int] = []
        self._size = 0

    def _list(self, hits: int) -> BlockList:
        lst = self._lists.get(hits)
        if lst is None:
            lst = self._lists[hits] = BlockList()
            heapq.heappush(self._heap, hits)
        return lst

    def push(self, b: Block, cold: bool = False) -> None:
        lst = self._list(min(b.stamp & HITS_MAX, _LFU_TOP))
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)
        self._size += 1

    def _unlink(self, b: Block, hits: int) -> None:
        lst = self._lists[hits]
        lst.unlink(b)
        if not lst.size:
            del self._lists[hits]

    def discard(self, b: Block) -> None:
        self._unlink(b, min(b.stamp & HITS_MAX, _LFU_TOP))
        self._size -= 1

    def touch(self, b: Block) -> None:
        hits = b.stamp & HITS_MAX  # one more than when the block entered its list
        self._unlink(b, min(hits - 1, _LFU_TOP))
        self._list(min(hits, _LFU_TOP)).append(b)

    def first(self) -> Block | None:
        heap, lists = self._heap, self._lists
        while heap:
            lst = lists.get(heap[0])
            if lst is not None:
                return lst.head
            heapq.heappop(heap)
        return None

    def __iter__(self) -> Iterator[Block]:
        for hits in sorted(self._lists):
            yield from list(self._lists[hits])

    def __len__(self) -> int:
        return self._size


class ArcQueue(EvictionQueue):
    """vLLM's ARC over the evictable blocks: T1 (not hit since entering), T2 (hit), target of T1
    adapted by ghost hits (`ghost_hit`). A block's list is `PROTECTED` (T2) in its flags."""

    __slots__ = ("_cap", "_t1", "_t2", "target")
    name = "arc"

    def __init__(self, capacity: int | None) -> None:
        self._cap = capacity if capacity is not None else 1 << 62
        self._t1 = BlockList()
        self._t2 = BlockList()
        self.target = 0.0

    def push(self, b: Block, cold: bool = False) -> None:
        lst = self._t2 if b.flags & PROTECTED else self._t1
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block) -> None:
        (self._t2 if b.flags & PROTECTED else self._t1).unlink(b)

    def touch(self, b: Block) -> None:
        if b.flags & PROTECTED:
            self._t2.move_to_end(b)
        else:
            self._t1.unlink(b)
            b.flags |= PROTECTED
            self._t2.append(b)

    def ghost_hit(self, from_t2: bool) -> None:
        if from_t2:
            self.target = max(self.target - 1.0, 0.0)
        else:
            self.target = min(self.target + 1.0, float(self._cap))

    def first(self) -> Block | None:
        t1 = self._t1
        if t1.head is not None and (t1.size >= int(self.target) or self._t2.head is None):
            return t1.head
        return self._t2.head

    def __iter__(self) -> Iterator[Block]:
        if self._t1.size >= int(self.target):
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def __len__(self) -> int:
        return self._t1.size + self._t2.size


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

    def push(self, b: Block, cold: bool = False) -> None:
        lst = self._m if b.flags & PROTECTED else self._s
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block) -> None:
        (self._m if b.flags & PROTECTED else self._s).unlink(b)

    def touch(self, b: Block) -> None:
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f + (1 << COUNT_SHIFT)

    def first(self) -> Block | None:
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

    def __iter__(self) -> Iterator[Block]:
        yield from self._s
        yield from self._m

    def __len__(self) -> int:
        return self._s.size + self._m.size


class SieveQueue(BlockList, EvictionQueue):
    """SIEVE: FIFO order (head = oldest), `MARK` = visited, a hand that moves from old to new."""

    __slots__ = ("_hand",)
    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._hand: Block | None = None

    def push(self, b: Block, cold: bool = False) -> None:
        if cold:
            self.appendleft(b)
        else:
            self.append(b)

    def discard(self, b: Block) -> None:
        if self._hand is b:
            self._hand = b.next
        self.unlink(b)

    def touch(self, b: Block) -> None:
        b.flags |= MARK

    def first(self) -> Block | None:
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

    def __iter__(self) -> Iterator[Block]:
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


class ArcPolicy(Policy):
    name = "vllm-arc"
    ghosts = True
    hooks = True
    marks = True

    def mark(self, b: Block) -> None:
        b.flags |= PROTECTED

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return ArcQueue(capacity)

    def inserted(self, b: Block) -> None:
        hits = b.stamp & HITS_MAX
        if hits > 1:  # the history remembered it: a ghost hit
            q = self.dram
            assert isinstance(q, ArcQueue)
            q.ghost_hit(hits > 2)


class LfuPolicy(Policy):
    name = "lfu"

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return LfuQueue()


class S3FifoPolicy(Policy):
    name = "lmcache-s3fifo"
    ghosts = True
    hooks = True
    marks = True

    def mark(self, b: Block) -> None:
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f + (1 << COUNT_SHIFT)

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return S3FifoQueue()

    def inserted(self, b: Block) -> None:
        if b.stamp & HITS_MAX > 1:  # a ghost hit enters M
            b.flags |= PROTECTED


class SievePolicy(Policy):
    name = "sieve"
    marks = True

    def mark(self, b: Block) -> None:
        b.flags |= MARK

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return SieveQueue()


class ReuseFilterPolicy(Policy):
    """LRU that stores a block only once its key was looked up `threshold` times (vLLM)."""

    name = "vllm-reuse"
    hooks = True
    threshold = 2
    tracker_size = 64_000

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        self.counts: OrderedDict[tuple[Tenant, BlockKey], int] = OrderedDict()

    def looked_up(self, tenant: Tenant, keys: Sequence[BlockKey], blocks: list[Block]) -> None:
        counts = self.counts
        for key in keys:
            tk = (tenant, key)
            n = counts.get(tk)
            if n is None:
                if len(counts) >= self.tracker_size:
                    counts.popitem(last=False)
                counts[tk] = 1
            else:
                counts.move_to_end(tk)
                counts[tk] = n + 1

    def admit(self, tenant: Tenant, keys: Sequence[BlockKey], start: int, parent: Block | None,
              partial_last: bool) -> int:
        counts, need = self.counts, self.threshold
        n = start
        while n < len(keys) and counts.get((tenant, keys[n]), 0) >= need:
            n += 1
        return n - start


class HiCachePolicy(Policy):
    """LRU that stores a block on its `threshold`-th reference (SGLang HiCache selective
    write-through); references of blocks not stored are counted in a direct-mapped table."""

    name = "sglang-hicache"
    hooks = True
    threshold = 2

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        from kvtier.index.policies import AdmissionHistory

        self.seen = AdmissionHistory(max(1, (dram_blocks or 0) + (ssd_blocks or 0)))

    def admit(self, tenant: Tenant, keys: Sequence[BlockKey], start: int, parent: Block | None,
              partial_last: bool) -> int:
        seen, need = self.seen, self.threshold
        n = start
        while n < len(keys):
            refs = seen.recall(tenant, keys[n]) + 1
            if refs < need:
                seen.remember(tenant, keys[n], refs)
                for key in keys[n + 1:]:  # the rest is referenced too, just not storable now
                    seen.remember(tenant, key, seen.recall(tenant, key) + 1)
                break
            n += 1
        return n - start

