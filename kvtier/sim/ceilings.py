"""Hit-ratio ceilings for a trace: an infinite cache and clairvoyant Belady MIN at a capacity.

Hit counting (the same everywhere in `kvtier.sim`): a request's hits are the longest prefix of its
`hash_ids` cached when it arrives; a block after the first miss is a miss even if it is cached (a
prefix cache can only reuse KV from the first block on). The hit ratio is hits / block references.

Infinite cache. Nothing is ever evicted, so a block is cached iff it was referenced before. Ids
are chained, so when block i of a request was seen, blocks 0..i-1 were seen with it: the cached set
is prefix-closed and every previously seen block of a request is a prefix hit. The infinite hit
ratio is therefore exact, and no replay at any capacity can beat it.

Belady MIN at capacity C (C = distinct blocks the tiers can hold, DRAM + SSD). We replay the
trace's block references in order (request by request, position by position) through an
offline-optimal cache that may bypass: on a miss, among the cached blocks plus the new one, the
one whose next reference is farthest is not kept. It counts *every* reference that finds its block
cached, ignoring the prefix rule. That makes it an honest upper bound, not a heuristic:

  * for any policy P that caches at most C distinct blocks between requests and inserts only the
    blocks a request references, a block-level policy that copies P's state at request boundaries
    (inserting P's new blocks as they are referenced, evicting P's dropped ones to make room)
    scores at least P's prefix hits on every request, since each prefix hit of P is a block
    cached at the request's start;
  * farthest-next-use with bypass is optimal among block-level policies (Belady 1966; Mattson et
    al. 1970), so its count is >= that one's.

Hence infinite >= Belady >= any replay at the same capacity. The bound may be loose: it ignores
that a block only pays off while its whole prefix is cached.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvtier.sim.trace import Request

_NEVER = 1 << 62


def infinite_hits(requests: Sequence[Request]) -> int:
    """Prefix hits of a cache that never evicts."""
    seen: set[int] = set()
    hits = 0
    for r in requests:
        for h in r.hash_ids:
            if h not in seen:
                break
            hits += 1
        seen.update(r.hash_ids)
    return hits


def next_uses(refs: Sequence[int]) -> list[int]:
    """For each position, the position of the next reference to the same block (or a sentinel)."""
    nxt = [_NEVER] * len(refs)
    last: dict[int, int] = {}
    for i in range(len(refs) - 1, -1, -1):
        b = refs[i]
        nxt[i] = last.get(b, _NEVER)
        last[b] = i
    return nxt


def flatten(requests: Sequence[Request]) -> list[int]:
    """Every block reference of the trace in replay order."""
    return [h for r in requests for h in r.hash_ids]


def belady_hits(refs: Sequence[int], capacity: int, nxt: Sequence[int] | None = None) -> int:
    """Block hits of farthest-next-use with bypass at `capacity` blocks (see module docstring).

    `nxt` is `next_uses(refs)`, passed in to reuse it across a capacity sweep.
    """
    if capacity <= 0:
        return 0
    if nxt is None:
        nxt = next_uses(refs)
    cached: dict[int, int] = {}  # block -> position of its next reference
    heap: list[tuple[int, int]] = []  # (-next reference, block); stale entries skipped lazily
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for i, b in enumerate(refs):
        n = nxt[i]
        if b in cached:
            hits += 1
            if n == _NEVER:
                del cached[b]
            else:
                cached[b] = n
                push(heap, (-n, b))
            continue
        if n == _NEVER:
            continue
        if len(cached) >= capacity:
            while True:
                neg, victim = heap[0]
                if cached.get(victim) == -neg:
                    break
                pop(heap)
            if -neg < n:
                continue
            pop(heap)
            del cached[victim]
        cached[b] = n
        push(heap, (-n, b))
        if len(heap) > 4 * capacity + 64:
            heap = [(-v, k) for k, v in cached.items()]
            heapq.heapify(heap)
    return hits
