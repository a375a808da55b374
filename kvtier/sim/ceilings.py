"""Hit-ratio ceilings for a trace: an infinite cache and clairvoyant Belady MIN at a capacity.

Hit counting (the same everywhere in `kvtier.sim`): a request's hits are the longest prefix of its
`hash_ids` cached when it arrives; a block after the first miss is a miss even if it is cached (a
prefix cache can only reuse KV from the first block on). The hit ratio is hits / block references.

Infinite cache. Nothing is ever evicted, so a block is cached iff it was referenced before. Ids
are chained, so when block i of a request was seen, blocks 0..i-1 were seen with it: the cached set
is prefix-closed and every previously seen block of a request is a prefix hit. The infinite hit
ratio is therefore exact, and no replay at any capacity can beat it.

Belady MIN at capacity C (C = distinct blocks the tiers hold together, DRAM + SSD). The trace's
block references are replayed in order (request by request, position by position) through an
offline-optimal cache with bypass: on a miss, among the cached blocks plus the new one, the one
whose next reference is farthest is not kept; a block is dropped at its last reference.

  * Upper bound. Counting *every* reference that finds its block cached, farthest-next-use with
    bypass is optimal among all caches of C blocks (Belady 1966; Mattson et al. 1970). A policy P
    that holds at most C distinct blocks and stores only blocks a request references can be
    copied by a block-level cache (P's state at request boundaries; P's new blocks inserted as
    they are referenced, P's dropped ones evicted to make room) that scores at least P's prefix
    hits on every request. So no policy, tiered or not, beats MIN at C.
  * Attained under the prefix rule. A request that references a block references its parent
    earlier, so while both are cached next(parent) < next(child): MIN never drops a parent and
    keeps its child, never admits a child whose parent it bypassed, and never evicts a block
    still to be referenced in the current request. Its cache is therefore prefix-closed at every
    request start and its block hits are prefix hits (`belady` returns both; tests check they
    are equal). MIN is thus the exact optimum of a single pool of C blocks, reached by a
    clairvoyant prefix cache; a tiered cache has further limits (admission, per-tier room).

Hence infinite >= Belady >= any replay at the same capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

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


class BeladyResult(NamedTuple):
    block_hits: int
    """References that found their block cached."""
    prefix_hits: int
    """Leading cached blocks per request at its arrival (equal to block_hits; module docstring)."""


def belady(
    requests: Sequence[Request], capacity: int, nxt: Sequence[int] | None = None
) -> BeladyResult:
    """Farthest-next-use with bypass at `capacity` blocks (see the module docstring).

    `nxt` is `next_uses(flatten(requests))`, passed in to reuse it across a capacity sweep.
    """
    if capacity <= 0:
        return BeladyResult(0, 0)
    if nxt is None:
        nxt = next_uses(flatten(requests))
    cached: dict[int, int] = {}  # block -> position of its next reference
    heap: list[tuple[int, int]] = []  # (-next reference, block); stale entries skipped lazily
    hits = prefix_hits = 0
    i = 0
    push, pop = heapq.heappush, heapq.heappop
    for r in requests:
        for b in r.hash_ids:
            if b not in cached:
                break
            prefix_hits += 1
        for b in r.hash_ids:
            n = nxt[i]
            i += 1
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
    return BeladyResult(hits, prefix_hits)
