"""Victim selection and eviction for the prefix index, with write-back at eviction.

Victims are the cold ends of the per-tier queues of `kvtier.index.state` (no scan). Two ways to
use them: the mover asks for `victims` and records what it did with `add_tier`/`demote`/`drop`;
synchronous callers (the simulator) call `evict`, which applies the changes itself, including the
SSD write-back of admitted DRAM victims (`KthAccess`, the k-th access) together with their
DRAM-only ancestors, so SSD stays prefix-closed. Contract in `kvtier.index.prefix`.
"""

from __future__ import annotations

from itertools import islice

from kvtier.core.types import Tier
from kvtier.index.policies.base import EvictionQueue
from kvtier.index.state import IndexState
from kvtier.index.types import ON_SSD, Block, Evicted, Reason

_DRAM, _SSD = Tier.DRAM, Tier.SSD
_WRITTEN = Reason.WRITTEN


class Eviction(IndexState):
    """`victims`, `evict`, `evict_count` and the admission rule over an `IndexState`."""

    def victims(self, tier: Tier, n: int) -> list[Block]:
        """Up to `n` blocks that may leave `tier` now, coldest first; changes nothing. Each stays
        evictable until a call changes that block (pin, insert of a child, a drop)."""
        if n <= 0:
            return []
        return list(islice(self._queue_of(tier), n))

    def evict(self, tier: Tier, n: int, *, write_back: bool = False) -> list[Evicted]:
        """Evict up to `n` blocks from `tier` (fewer if fewer are evictable), coldest first.

        With `write_back` (DRAM only), a DRAM-only victim that the admission rule admits goes to
        SSD (WRITTEN_BACK) together with its DRAM-only ancestors (WRITTEN, they stay in DRAM) to
        keep SSD prefix-closed, evicting SSD leaves for room; without room it is DROPPED. The
        result lists every change including those SSD evictions, in order. Meant for synchronous
        callers (the simulator); the mover uses `victims` + `add_tier`/`demote`.
        """
        out: list[Evicted] = []
        self._evict(self._queue_of(tier), tier, n, write_back, out)
        return out

    def evict_count(self, tier: Tier, n: int, *, write_back: bool = False) -> int:
        """`evict` for callers that only need the counters (`stats`): the same changes, but
        returns only how many blocks left `tier` as victims, building no `Evicted` records."""
        return self._evict(self._queue_of(tier), tier, n, write_back, None)

    def admits(self, b: Block) -> bool:
        """The SSD admission rule (k-th access)."""
        return self.admission.admits(b)

    def _evict(self, q: EvictionQueue, tier: Tier, n: int, write_back: bool,
               out: list[Evicted] | None) -> int:
        done = 0
        write_back = write_back and tier is _DRAM and self._cap[_SSD] != 0
        admits = self.admission.admits
        while done < n:
            b = q.first()
            if b is None:
                break
            done += 1
            if (write_back and not b.flags & ON_SSD and admits(b)
                    and self._write_chain(b, out)):
                self._drop(b, tier, out, written_back=True)
            else:
                self._drop(b, tier, out)
        return done

    def _write_chain(self, b: Block, out: list[Evicted] | None) -> bool:
        """Give `b` and its DRAM-only ancestors SSD copies, root-first, evicting SSD leaves for
        room; False (nothing changed) if SSD cannot make room for the whole chain."""
        chain = [b]
        p = b.parent
        while p is not None and not p.flags & ON_SSD:
            chain.append(p)
            p = p.parent
        cap = self._cap[_SSD]
        if cap is not None:
            free = cap - self._count[_SSD]
            if free < len(chain):
                if free + len(self._qs) < len(chain):
                    return False
                self._evict(self._qs, _SSD, len(chain) - free, False, out)
        for c in reversed(chain):
            self._add(c, _SSD, None)
            if c is not b and out is not None:
                out.append(Evicted(c.tenant, c.key, _SSD, _WRITTEN, c.dram_slot))
        return True
