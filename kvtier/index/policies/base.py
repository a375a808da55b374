"""The policy contract of the prefix index (`Policy`), its base LRU and the queues' building blocks.

A `Policy` owns an index's two eviction queues, its DRAM admission (`admit`) and its SSD
admission; `kvtier.index.policies` maps names to policies, one per file in this folder (the
peers', each with where it comes from) and kvtier's own in `kvtier.index.policies.adaptive`.

An eviction queue holds the blocks of one tier that may be evicted *now* (the index decides
membership; see `kvtier.index.prefix`). The queue only orders them. Blocks are linked intrusively
through their own `prev`/`next` slots (vLLM free-block-queue style), so push, discard and touch are
O(1) and a block is in at most one queue at a time. A policy serves an index of any namespace
type (`Block[Any]`): it only hashes a block's `ns` (an `Ns`) and never hands it back.

    coldest ─▶ b ⇄ b ⇄ b ⇄ b ◀─ hottest          (iteration order = eviction order)

``lru`` (this base): one list; a touch moves the block to the hot end.

SSD admission: `KthAccess(k)` admits a block to SSD once it has been accessed k times (the commit
counts as the first access, each lookup hit as one more); k = 2 keeps one-shot prefixes off the
drive, k = 1 writes everything back. The index's `kvtier.index.history.AdmissionHistory` remembers
the counts of recently dropped blocks ("ghost" entries), so a block reused at a distance larger
than DRAM still reaches k.

Threading: none of this is thread-safe; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.types import BlockKey
from kvtier.index.history import ADMISSION_HISTORY_PER_BLOCK
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block, Ns

PROTECTED = 1 << 7
"""Bit of `Block.flags` owned by the policy: SLRU's protected list, ARC's T2, S3-FIFO's main
queue, kvtier's main segment. Bits 5-6 (`COUNT_SHIFT`) are a 2-bit counter the policy owns and bit
0 (`MARK`) a mark it owns; the index never reads or clears any of them."""
COUNT_SHIFT = 5
COUNT_BITS = 3 << COUNT_SHIFT
MARK = 1 << 0



class BlockList:
    """Intrusive doubly linked list over `Block.prev`/`Block.next`; `None` ends the list."""

    __slots__ = ("head", "size", "tail")

    def __init__(self) -> None:
        self.head: Block[Any] | None = None
        self.tail: Block[Any] | None = None
        self.size = 0

    def append(self, b: Block[Any]) -> None:
        tail = self.tail
        b.prev = tail
        b.next = None
        if tail is None:
            self.head = b
        else:
            tail.next = b
        self.tail = b
        self.size += 1

    def appendleft(self, b: Block[Any]) -> None:
        head = self.head
        b.next = head
        b.prev = None
        if head is None:
            self.tail = b
        else:
            head.prev = b
        self.head = b
        self.size += 1

    def unlink(self, b: Block[Any]) -> None:
        p, n = b.prev, b.next
        if p is None:
            self.head = n
        else:
            p.next = n
        if n is None:
            self.tail = p
        else:
            n.prev = p
        b.prev = b.next = None
        self.size -= 1

    def move_to_end(self, b: Block[Any]) -> None:
        if self.tail is not b:
            self.unlink(b)
            self.append(b)

    def __iter__(self) -> Iterator[Block[Any]]:
        b = self.head
        while b is not None:
            nxt = b.next
            yield b
            b = nxt


class EvictionQueue:
    """Order over the evictable blocks of one tier. Subclasses are the policies.

    Contract: `push` only blocks not in any queue, `discard`/`touch` only blocks in this queue;
    `touch` is called after the index has updated the block's `hits`/`last`. Iteration is coldest
    first and tolerates discarding the block just yielded, nothing else.
    """

    __slots__ = ()
    name = ""

    def push(self, b: Block[Any], cold: bool = False) -> None:
        """Add an evictable block; `cold` places it at the eviction end instead of the hot end."""
        raise NotImplementedError

    def discard(self, b: Block[Any]) -> None:
        raise NotImplementedError

    def touch(self, b: Block[Any]) -> None:
        raise NotImplementedError

    def first(self) -> Block[Any] | None:
        """The next victim, or None when nothing is evictable."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Block[Any]]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LruQueue(BlockList, EvictionQueue):
    """One list (the queue *is* the list: one call level less on the index's hot path)."""

    __slots__ = ()
    name = "lru"

    def push(self, b: Block[Any], cold: bool = False) -> None:
        if cold:
            self.appendleft(b)
        else:
            self.append(b)

    discard = BlockList.unlink
    touch = BlockList.move_to_end

    def first(self) -> Block[Any] | None:
        return self.head

    __iter__ = BlockList.__iter__

    def __len__(self) -> int:
        return self.size


class KthAccess:
    """SSD admission: write a block back only once it has been accessed `k` times."""

    __slots__ = ("k",)

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError(f"admission k must be >= 1, got {k}")
        self.k = k

    def admits(self, b: Block[Any]) -> bool:
        return b.stamp & HITS_MAX >= self.k


class Policy:
    """One index's policy: the order of its two eviction queues, DRAM admission, SSD admission.

    This base is leaf-first LRU with every block admitted to DRAM and SSD admission on the k-th
    access (`KthAccess`); subclasses (`kvtier.index.policies`) override what differs. The
    index calls `inserted`, `unlinked` and `looked_up` only when `hooks` is true (`mark` when
    `marks` is), so a policy without
    hooks costs nothing on the request path. `admit` is a query: the caller (the simulator, the
    daemon's Allocate) stores only that many blocks of a missed suffix, so nothing is stranded.

    `ghosts`: the policy reads the admission history (a reinserted block's count starts above 1)
    even without an SSD tier, so the index allocates it for DRAM-only configurations too.
    """

    name = "lru"
    ghosts = False
    hooks = False
    marks = False
    ghost_words = ADMISSION_HISTORY_PER_BLOCK
    """Default history words per block of capacity (DRAM + SSD)."""

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        self.dram = self.make_queue(dram_blocks)
        self.ssd = self.make_queue(ssd_blocks)
        self.ssd_admission = KthAccess(admission_k)

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return LruQueue()

    def admit(self, ns: Ns, keys: Sequence[BlockKey], start: int, parent: Block[Any] | None,
              partial_last: bool) -> int:
        """How many blocks of ``keys[start:]`` (not cached; `parent` is keys[start - 1]'s block,
        or None at a root) to store, from the first; `partial_last`: the chain's last block holds
        fewer tokens than a full block (so no longer prompt can share it)."""
        return len(keys) - start

    def inserted(self, b: Block[Any]) -> None:
        """A new entry (its count already includes what the history recalled)."""

    def unlinked(self, b: Block[Any]) -> None:
        """An entry left its last tier (it is still linked to its parent)."""

    def forget(self, blocks: list[Block[Any]]) -> None:
        """Entries removed on purpose (an operator's evict, `kvtier.index.purge`): drop what
        the policy keeps about them; they say nothing about reuse. Default: `unlinked` each."""
        for b in blocks:
            self.unlinked(b)

    def looked_up(self, ns: Ns, keys: Sequence[BlockKey], blocks: list[Block[Any]]) -> None:
        """A touching lookup of `keys` found `blocks` (the first ``len(blocks)`` keys) cached,
        before it counts their access. On the Lookup path: keep it O(1) or C-speed per block
        (read `blocks`, never change it)."""

    def resize(self, dram_blocks: int) -> None:
        """The owner's estimate of how many blocks DRAM holds changed (blocks are sized by the
        layouts registered, so a daemon learns it after start). Policies that size their own
        state by capacity follow it; the queues and tier bounds do not change. Default: nothing."""

    def mark(self, b: Block[Any]) -> None:
        """A touching lookup hit `b`, which is in no queue (its children keep it, or it is
        pinned): what a queue's `touch` would record, for when it enters one. Called only when
        `marks` is true."""
