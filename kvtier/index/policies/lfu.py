"""``sglang-lfu`` and ``lmcache-lfu``: least frequently used first.

SGLang ``LFUStrategy`` (``mem_cache/evict_policy.py``): evict the evictable leaf with the lowest
``(hit_count, last_access_time)``. LMCache ``cache_policy/lfu.py``: buckets by frequency, FIFO
inside a bucket (an entry enters the bucket of its new count on a hit). Under the index's rule
they are the same order: one `LfuQueue`.

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.base import BlockList, EvictionQueue, Policy
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block


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

    def push(self, b: Block[Any], cold: bool = False) -> None:
        lst = self._list(min(b.stamp & HITS_MAX, _LFU_TOP))
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)
        self._size += 1

    def _unlink(self, b: Block[Any], hits: int) -> None:
        lst = self._lists[hits]
        lst.unlink(b)
        if not lst.size:
            del self._lists[hits]

    def discard(self, b: Block[Any]) -> None:
        self._unlink(b, min(b.stamp & HITS_MAX, _LFU_TOP))
        self._size -= 1

    def touch(self, b: Block[Any]) -> None:
        hits = b.stamp & HITS_MAX  # one more than when the block entered its list
        self._unlink(b, min(hits - 1, _LFU_TOP))
        self._list(min(hits, _LFU_TOP)).append(b)

    def first(self) -> Block[Any] | None:
        heap, lists = self._heap, self._lists
        while heap:
            lst = lists.get(heap[0])
            if lst is not None:
                return lst.head
            heapq.heappop(heap)
        return None

    def __iter__(self) -> Iterator[Block[Any]]:
        for hits in sorted(self._lists):
            yield from list(self._lists[hits])

    def __len__(self) -> int:
        return self._size


class LfuPolicy(Policy):
    name = "lfu"

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return LfuQueue()
