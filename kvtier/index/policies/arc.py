"""``vllm-arc``: vLLM ``kv_offload/cpu/policies/arc.py``.

New blocks enter T1, a hit moves a T1 block to T2; a ghost hit (a key evicted from T1 = B1, from
T2 = B2) moves the target size of T1 up or down; the victim is T1's LRU while ``len(T1) >=
target``, else T2's. Ghosts here are the index's admission history (a reinserted key whose
remembered count is 1 was evicted from T1, >= 2 from T2); the step is 1 (vLLM scales it by
``len(B2) / len(B1)``, which a direct-mapped history does not count).

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.index.policies.base import PROTECTED, BlockList, EvictionQueue, Policy
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block


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

    def push(self, b: Block[Any], cold: bool = False) -> None:
        lst = self._t2 if b.flags & PROTECTED else self._t1
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block[Any]) -> None:
        (self._t2 if b.flags & PROTECTED else self._t1).unlink(b)

    def touch(self, b: Block[Any]) -> None:
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

    def first(self) -> Block[Any] | None:
        t1 = self._t1
        if t1.head is not None and (t1.size >= int(self.target) or self._t2.head is None):
            return t1.head
        return self._t2.head

    def __iter__(self) -> Iterator[Block[Any]]:
        if self._t1.size >= int(self.target):
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def __len__(self) -> int:
        return self._t1.size + self._t2.size


class ArcPolicy(Policy):
    name = "vllm-arc"
    ghosts = True
    hooks = True
    marks = True

    def mark(self, b: Block[Any]) -> None:
        b.flags |= PROTECTED

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return ArcQueue(capacity)

    def inserted(self, b: Block[Any]) -> None:
        hits = b.stamp & HITS_MAX
        if hits > 1:  # the history remembered it: a ghost hit
            q = self.dram
            assert isinstance(q, ArcQueue)
            q.ghost_hit(hits > 2)
