"""Victim selection and eviction for the prefix index.

Victims are the cold ends of the per-tier queues of `kvtier.index.state` (no scan). `victims`
only names them; `evict`/`evict_count` apply the changes (demotion of a DRAM copy whose block
is on SSD, else a leaf-first drop). Nothing here writes to SSD: the placement planner decides
write-backs (`kvtier.index.placement.write_backs`). Contract in `kvtier.index.prefix`.
"""

from __future__ import annotations

from itertools import islice

from kvtier.core.types import Tier
from kvtier.index.policies.base import EvictionQueue
from kvtier.index.state import IndexState
from kvtier.index.types import Block, Evicted, NsT


class Eviction(IndexState[NsT]):
    """`victims`, `evict`, `evict_count` and the admission rule over an `IndexState`."""

    def victims(self, tier: Tier, n: int) -> list[Block[NsT]]:
        """Up to `n` blocks that may leave `tier` now, coldest first; changes nothing. Each stays
        evictable until a call changes that block (pin, insert of a child, a drop)."""
        if n <= 0:
            return []
        return list(islice(self._queue_of(tier), n))

    def evict(self, tier: Tier, n: int) -> list[Evicted[NsT]]:
        """Evict up to `n` blocks from `tier` (fewer if fewer are evictable), coldest first:
        a DRAM copy whose block is on SSD is demoted, else the block is dropped (leaf-first).
        The result lists every change, in order. The placement planner
        (`kvtier.index.placement`) decides what goes to SSD; eviction never writes."""
        out: list[Evicted[NsT]] = []
        self._evict(self._queue_of(tier), tier, n, out)
        return out

    def evict_count(self, tier: Tier, n: int) -> int:
        """`evict` for callers that only need the counters (`stats`): the same changes, but
        returns only how many blocks left `tier`, building no `Evicted` records."""
        return self._evict(self._queue_of(tier), tier, n, None)

    def admits(self, b: Block[NsT]) -> bool:
        """The SSD admission rule (k-th access)."""
        return self.admission.admits(b)

    def _evict(self, q: EvictionQueue, tier: Tier, n: int, out: list[Evicted[NsT]] | None) -> int:
        done = 0
        while done < n:
            b = q.first()
            if b is None:
                break
            done += 1
            self._drop(b, tier, out)
        return done
