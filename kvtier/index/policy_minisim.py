"""Miniature simulations: which window share would have hit more, measured on a sample of keys.

Each candidate share runs a small block-level copy of
`kvtier.index.policy_adaptive.AdaptiveQueue`'s algorithm (probation S in LRU order with a 2-bit
frequency, main M as a CLOCK on that frequency, S's oldest moving to M when its frequency is > 1, a
key dropped from S remembered as a ghost that re-enters in M; share 1.0 = plain LRU) over the
references of a spatial sample of the keys (1 in `rate`: those whose 64-bit XXH3 fingerprint has
its top byte below `threshold` = 256 / rate; the caller, which fingerprints each key once anyway,
samples and calls `feed`; `add` fingerprints for itself; deterministic, no `hash()`), at 1/`rate`
of the real capacity (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017). Hits decay by half each epoch; `best` is the candidate with the
most. The mini caches ignore the prefix rule (a block hits if it is cached), so they rank shares,
they do not predict hit ratios.

Memory: candidates x 2 x capacity/rate entries (cached + ghosts, an OrderedDict slot each,
~100 B): with 2 candidates and rate 8, ~50 B per block of real capacity up to 32K blocks (the
mini caches stop growing at `MINI_MAX` entries: ~13 B per block at 128K, 1.6 MB in all; the
rate falls to 4 below 256 blocks: a small cache's mini copies stay at least 32 blocks). Work:
O(1) per sampled reference and candidate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

from kvtier.core.types import BlockKey

_FREQ_MAX = 3
MINI_MAX = 4096
"""Largest mini cache: beyond 4096 x rate blocks of real capacity the sample thins instead."""
RATE = 8
"""Default sample: 1 key in 8. Measured (docs/benchmarks.md, "Policies, fourth pass", over 4 key
samples on every workload): the sample trace at 1% and 5% 1.086x / 1.035x LRU instead of 1.047x /
1.006x with 1 in 16, every other cell within 0.1%; the larger sample is what fixes the order choice
there (the choice flips with a 1-in-16 sample's luck)."""


class MiniCache:
    """One candidate's block-level cache (module docstring)."""

    __slots__ = ("cap", "ghosts", "hits", "m", "s", "share")

    def __init__(self, cap: int, share: float) -> None:
        self.cap = cap
        self.share = share
        self.s: OrderedDict[BlockKey, int] = OrderedDict()
        self.m: OrderedDict[BlockKey, int] = OrderedDict()
        self.ghosts: OrderedDict[BlockKey, None] = OrderedDict()
        self.hits = 0.0

    def access(self, keys: Sequence[BlockKey]) -> None:
        """Reference `keys` in order."""
        s, m, ghosts, cap = self.s, self.m, self.ghosts, self.cap
        lru = self.share >= 1.0
        hits = 0
        for key in keys:
            f = s.get(key)
            if f is not None:
                hits += 1
                if f < _FREQ_MAX:
                    s[key] = f + 1
                s.move_to_end(key)
                continue
            f = m.get(key)
            if f is not None:
                hits += 1
                if f < _FREQ_MAX:
                    m[key] = f + 1
                continue
            if ghosts.pop(key, 0) is None and not lru:
                m[key] = 0
            else:
                s[key] = 0
            if len(s) + len(m) > cap:
                self._evict()
        self.hits += hits

    def _evict(self) -> None:
        s, m = self.s, self.m
        while True:
            if s and (self.share >= 1.0 or len(s) > self.share * self.cap or not m):
                key, f = s.popitem(last=False)
                if f > 1 and self.share < 1.0:
                    m[key] = f
                    continue
                ghosts = self.ghosts
                ghosts[key] = None
                if len(ghosts) > self.cap:
                    ghosts.popitem(last=False)
                return
            key, f = m.popitem(last=False)
            if f > 0:
                m[key] = f - 1
                continue
            return


class MiniSims:
    """Candidates' mini caches over one key sample; `best` after each epoch. `threshold`: a key
    is in the sample when its fingerprint's top byte (``h >> 56``) is below it."""

    __slots__ = ("_epoch", "_seen", "best", "caches", "margin", "threshold")

    def __init__(self, capacity: int, shares: Sequence[float], start: float,
                 rate: int = RATE, min_cap: int = 32, margin: float = 1.01) -> None:
        rate = max(4, min(max(rate, capacity // MINI_MAX), capacity // min_cap))
        cap = max(1, capacity // rate)
        self.threshold = max(1, 256 // rate)
        self.caches = [MiniCache(cap, s) for s in shares]
        self._epoch = 4 * cap
        self._seen = 0
        self.best = start
        self.margin = margin

    def add(self, keys: Sequence[BlockKey]) -> None:
        """Reference `keys` in order, sampling them by their unseeded fingerprint."""
        th = self.threshold
        self.feed([k for k in keys if xxh3_64_intdigest(k) >> 56 < th])

    def feed(self, keys: Sequence[BlockKey]) -> None:
        """Reference sampled keys in order (the caller applied `threshold`)."""
        caches = self.caches
        for c in caches:
            c.access(keys)
        self._seen += len(keys)
        if self._seen >= self._epoch:
            self._seen = 0
            top = max(caches, key=lambda c: c.hits)
            cur = next((c for c in caches if c.share == self.best), None)
            if cur is None or top.hits > cur.hits * self.margin:
                self.best = top.share
            for c in caches:
                c.hits *= 0.5

    def entries(self) -> int:
        return sum(len(c.s) + len(c.m) + len(c.ghosts) for c in self.caches)
