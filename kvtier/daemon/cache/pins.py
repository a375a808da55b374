"""Operators' pins: blocks kept through pressure until a deadline (`kvtier pin`, a request's
`pin_s` hint). Pure bookkeeping; the cache holds one index pin per block in this table
(`kvtier.daemon.cache.control`), so a pinned block is never evicted, moved or demoted.

    pin(ns, key, until, cost)   a new entry (True), or a later deadline for an existing one
    unpin(ns, key)              the entry ends now
    expired(now)                the entries past their deadline, removed (oldest first)
    drop(ns, keys | None)       the entries of a namespace (or of those keys), removed

A pin's deadline only grows: pinning a pinned block again keeps the later of the two, so two
requests sharing a prefix never shorten each other's pin. Each entry carries its `cost` (the
DRAM and SSD bytes one block of its namespace can take), summed per tenant (`held`): what a
new pin is checked against (the tenant's quota and its slice of the pool).

Expiry is a heap of deadlines with lazy deletion (a pin extended or removed leaves its old
deadline in the heap; `expired` skips it). Not thread-safe: the cache calls it under its lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from kvtier.daemon.cache.namespaces import Namespace


class Cost(NamedTuple):
    """Bytes one pinned block can take: its DRAM slot's stride and its SSD copy."""

    dram: int
    ssd: int


class _Entry(NamedTuple):
    until: float
    cost: Cost


class PinTable:
    def __init__(self) -> None:
        self._by_ns: dict[Namespace, dict[bytes, _Entry]] = {}
        self._heap: list[tuple[float, int, Namespace, bytes]] = []
        self._seq = 0  # ties in the heap never compare namespaces
        self._held: dict[str, list[int]] = {}  # tenant -> [blocks, dram bytes, ssd bytes]

    def __len__(self) -> int:
        return sum(len(m) for m in self._by_ns.values())

    def until(self, ns: Namespace, key: bytes) -> float | None:
        e = self._by_ns.get(ns, {}).get(key)
        return None if e is None else e.until

    def held(self, tenant: str) -> Cost:
        """The DRAM and SSD bytes `tenant`'s pinned blocks can take."""
        h = self._held.get(tenant)
        return Cost(0, 0) if h is None else Cost(h[1], h[2])

    def blocks(self, tenant: str) -> int:
        h = self._held.get(tenant)
        return 0 if h is None else h[0]

    def namespaces(self) -> Iterator[tuple[Namespace, int, float, float]]:
        """(namespace, pinned blocks, earliest deadline, latest deadline) of each namespace."""
        for ns, m in self._by_ns.items():
            deadlines = [e.until for e in m.values()]
            yield ns, len(m), min(deadlines), max(deadlines)

    def pin(self, ns: Namespace, key: bytes, until: float, cost: Cost) -> bool:
        """Pins (ns, key) until `until` (or keeps its later deadline); True when it is new."""
        m = self._by_ns.setdefault(ns, {})
        old = m.get(key)
        if old is not None and old.until >= until:
            return False
        m[key] = _Entry(until, cost if old is None else old.cost)
        self._seq += 1
        heapq.heappush(self._heap, (until, self._seq, ns, key))
        if old is not None:
            return False
        h = self._held.setdefault(ns.tenant, [0, 0, 0])
        h[0] += 1
        h[1] += cost.dram
        h[2] += cost.ssd
        return True

    def unpin(self, ns: Namespace, key: bytes) -> bool:
        """Ends the pin of (ns, key); False when there was none."""
        m = self._by_ns.get(ns)
        e = None if m is None else m.pop(key, None)
        if e is None:
            return False
        if not m:
            del self._by_ns[ns]
        h = self._held[ns.tenant]
        h[0] -= 1
        h[1] -= e.cost.dram
        h[2] -= e.cost.ssd
        if not h[0]:
            del self._held[ns.tenant]
        return True

    def drop(self, ns: Namespace, keys: Iterable[bytes] | None = None) -> list[bytes]:
        """Ends the pins of `ns` (those of `keys` only, when given); the keys unpinned."""
        m = self._by_ns.get(ns)
        if not m:
            return []
        doomed = list(m) if keys is None else [k for k in keys if k in m]
        for key in doomed:
            self.unpin(ns, key)
        return doomed

    def expired(self, now: float) -> list[tuple[Namespace, bytes]]:
        """Removes and returns every pin whose deadline is `now` or earlier."""
        out: list[tuple[Namespace, bytes]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, _, ns, key = heapq.heappop(heap)
            e = self._by_ns.get(ns, {}).get(key)
            if e is not None and e.until == until:
                self.unpin(ns, key)
                out.append((ns, key))
        if len(heap) > 4 * len(self) + 64:
            self._heap = [(e.until, i, ns, k) for i, (ns, k, e) in enumerate(
                (ns, k, e) for ns, m in self._by_ns.items() for k, e in m.items())]
            heapq.heapify(self._heap)
        return out
