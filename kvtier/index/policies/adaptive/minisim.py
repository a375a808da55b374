"""Miniature simulations: whether another queue mode would hit more than LRU, on a sample of keys.

Each candidate runs a small block-level copy of one mode of
`kvtier.index.policies.adaptive.queue.AdaptiveQueue` over the references of a spatial sample of
the keys: `LRU`, a probation share < 1 (S3-FIFO-like: probation S in LRU order with a 2-bit
frequency, main M as a CLOCK on it, S's oldest moving to M when its frequency is > 1, a key
dropped from S remembered as a ghost that re-enters in M), `FILTER` (LRU behind the reuse filter:
a missed key is stored only if a `SeenTable` saw it before) or `LFU` (the lowest access count
leaves, counts resumed from the ghosts). The sample is 1 key in `rate`: those whose 64-bit XXH3
fingerprint has its top byte below `threshold` = 256 / rate (the caller fingerprints each key
once and calls `feed`; `add` fingerprints for itself); the mini caches are 1/`rate` of the real
capacity (Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
USENIX ATC 2017). Deterministic, no `hash()`.

The choice (`MiniSims.best`) is LRU unless the sample resolves a gain. Each `feed` (one request's
sampled keys: its chain's hits and misses move together) is one observation: copy i hit x_i of its
keys. Over a window of hits decayed by `DECAY` an epoch (`EPOCH` x mini capacity sampled refs),
candidate a's gain over b is D = f_a H_a - f_b H_b (H: decayed hits, f: the calibration below, 1
for LRU and the filter) and its standard deviation s = sqrt(sum over feeds of (f_a x_a - f_b
x_b)^2): paired (the copies see the same references, so what they share cancels) and by request
(chains are not independent keys). a *beats* b when D > `Z` s, the two copies counted `MIN_HITS`
hits, and f_a H_a > m_a f_b H_b (m: `LRU_MARGIN` for the probation copy, `LFU_MARGIN` for LFU,
1 else: those copies leave out the prefix rule and the predictor's own errors). At each
epoch's end: running LRU, the candidate that beats LRU with the highest score f H / m takes over;
running another mode, it stays while it is still `Z_STAY` deviations above LRU, gives way to a
candidate that beats both LRU and it, and otherwise LRU comes back. At each quarter of an epoch
(`PARTS`) a win by `Z_EARLY` switches early. So the smallest gain a switch can rest on is Z s:
`MiniSims.resolution` is Z s / H_LRU, the relative difference the window resolves now.

Calibration (`factor`): the probation and LFU copies' hits are scaled by the real cache's sampled
hits over their own while the real queue runs their mode, from the first epoch's end after the
switch (before it the real cache still holds the old mode's content): decayed while the mode runs,
kept while another runs, `CALIBRATION_PRIOR` on both sides. The copies ignore the leaf-first
rule and the hot entry.

Memory: candidates x 2 x capacity/rate entries (cached + ghosts, an OrderedDict slot each,
~100 B; the LFU copy's keys twice) plus the filter copy's seen table (4 B a word, the policy's
table / rate): with 4 candidates and rate 8, ~110 B per block of real capacity up to 32K blocks
(the copies stop growing at `MINI_MAX` entries: ~29 B per block at 128K, ~3.7 MB in all; below
`MIN_CAP` x 8 blocks the rate falls, down to 1 under 2 x `MIN_CAP`: a small cache's copies are
the whole cache). Work: O(1) per sampled reference and candidate, O(candidates^2) per feed.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from xxhash import xxh3_64_intdigest

from kvtier.core.types import BlockKey

_FREQ_MAX = 3
LRU = 1.0
"""The LRU candidate's share: plain LRU, every missed key stored; the mode unless another is
resolved to hit more."""
FILTER = 2.0
"""A candidate's share above 1: LRU order behind the reuse filter (vLLM's store-after-two-lookups,
`kvtier.index.policies.reuse_filter.ReuseFilterPolicy`): a missed key is stored only if it was
seen before, in a direct-mapped table of fingerprint tags (`SeenTable`)."""
LFU = 3.0
"""A candidate's share above `FILTER`: least frequently used first (the lowest access count, the
least recently used among equal counts: SGLang's ``LFUStrategy``, `kvtier.index.policies.lfu.
LfuQueue`), every missed key stored; a key that comes back while its ghost is remembered resumes
its count (the real queue's counts come from the index, which the admission history restores)."""
COLD, SKIP = 1, 2
"""`MiniCache.access`'s placements: a missed key enters probation's cold end / is not stored."""
MINI_MAX = 4096
"""Largest mini cache: beyond 4096 x rate blocks of real capacity the sample thins instead."""
MIN_CAP = 256
"""Smallest mini cache while the rate can fall (to 1: the whole cache simulated)."""
Z = 3.0
"""Standard deviations (paired, by request) by which a candidate must beat LRU, or the mode it
replaces, to be chosen at an epoch's end (one-sided, ~1 in 740 on a tie)."""
Z_STAY = 2.0
"""Standard deviations above LRU under which a mode other than LRU gives way to LRU."""
Z_EARLY = 4.0
"""Standard deviations by which a candidate must win at a quarter of an epoch (`PARTS`) to be
chosen before the epoch ends."""
LRU_MARGIN = 1.05
"""Factor by which the probation copy's score must beat another's: its copy leaves out the prefix
rule and the predictor's errors, so a near tie in the copies is no gain in the real cache."""
LFU_MARGIN = 1.1
"""Factor by which the `LFU` copy's score must beat another's (the same reason)."""
MIN_HITS = 50.0
"""Hits (the two copies' sum) under which no switch is made, whatever the deviation: a few
requests' chains are too few observations for a deviation to mean anything."""
PARTS = 4
"""Checks per epoch: at each quarter the choice is made again with `Z_EARLY` (hits not decayed)."""
CALIBRATION_PRIOR = 50.0
"""Hits added to both sides of `MiniSims.factor` (a few epochs' worth at the smallest copies)."""
EPOCH = 4
"""Sampled references per epoch, per entry of a mini cache."""
DECAY = 0.9
"""Hits kept per epoch: the window is ~10 epochs, ~40 x the mini capacity in sampled refs."""
RATE = 8
"""Default sample: 1 key in 8."""


class SeenTable:
    """Which keys were referenced recently: a direct-mapped table of `size` 32-bit words, word
    ``h % size`` holding the top 31 bits of the key's 64-bit fingerprint `h` (| 1: never 0). It
    remembers about the last `size` distinct keys (a later key on the same word overwrites), in
    4 bytes a word, O(1) per key; a tag collision only admits a block early."""

    __slots__ = ("_words", "size")

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._words = array("I", bytes(4 * self.size))

    def check(self, h: int) -> bool:
        """Whether fingerprint `h` was seen before; remembers it either way."""
        words, i, tag = self._words, h % self.size, (h >> 33) | 1
        if words[i] == tag:
            return True
        words[i] = tag
        return False

    def nbytes(self) -> int:
        return 4 * self.size


class MiniCache:
    """One candidate's block-level cache (module docstring); `seen` for a `FILTER` candidate."""

    __slots__ = ("_heap", "_lists", "cap", "ghosts", "hits", "m", "s", "seen", "share")

    def __init__(self, cap: int, share: float, seen: int = 0) -> None:
        self.cap = cap
        self.share = share
        self.s: OrderedDict[BlockKey, int] = OrderedDict()
        self.m: OrderedDict[BlockKey, int] = OrderedDict()
        self.ghosts: OrderedDict[BlockKey, int | None] = OrderedDict()
        self.seen = SeenTable(seen) if share == FILTER else None
        self.hits = 0.0
        self._lists: dict[int, OrderedDict[BlockKey, None]] = {}
        """`LFU`: the cached keys by count (``m`` maps a key to its count), oldest first..."""
        self._heap: list[int] = []
        """...and the counts that have a list (a heap; emptied lists are dropped lazily)."""

    def access(self, keys: Sequence[BlockKey], placed: Mapping[BlockKey, int] | None = None
               ) -> None:
        """Reference `keys` in order. `placed`: for a probation-share candidate, the keys the real
        policy's predictor would store at probation's cold end (`COLD`) or not at all (`SKIP`)
        when they miss (the other candidates store every missed key as their mode says)."""
        if self.share == LFU:
            self._access_lfu(keys)
            return
        s, m, ghosts, cap = self.s, self.m, self.ghosts, self.cap
        lru = self.share >= 1.0
        seen = self.seen
        if lru or not placed:
            placed = None
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
            if seen is not None and not seen.check(xxh3_64_intdigest(key)):
                continue  # the reuse filter: not stored on its first reference
            if ghosts.pop(key, 0) is None and not lru:
                m[key] = 0
            elif placed is not None and key in placed:
                if placed[key] == SKIP:
                    continue
                s[key] = 0
                s.move_to_end(key, last=False)
            else:
                s[key] = 0
            if len(s) + len(m) > cap:
                self._evict()
        self.hits += hits

    def _access_lfu(self, keys: Sequence[BlockKey]) -> None:
        counts, lists, heap, ghosts = self.m, self._lists, self._heap, self.ghosts
        hits = 0
        for key in keys:
            f = counts.get(key)
            if f is not None:
                hits += 1
                del lists[f][key]
            else:
                f = ghosts.pop(key, None) or 0
                if len(counts) >= self.cap:
                    while True:  # the lowest count's oldest key leaves (into the ghosts)
                        lst = lists.get(heap[0])
                        if lst:
                            break
                        lists.pop(heapq.heappop(heap), None)
                    old = next(iter(lst))
                    del lst[old]
                    ghosts[old] = counts.pop(old)
                    if len(ghosts) > self.cap:
                        ghosts.popitem(last=False)
            counts[key] = f = f + 1
            lst = lists.get(f)
            if lst is None:
                lst = lists[f] = OrderedDict()
                heapq.heappush(heap, f)
            lst[key] = None
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


def _deviation(q: Sequence[float], n: int, a: int, b: int, wa: float = 1.0,
               wb: float = 1.0) -> float:
    """sqrt(sum over feeds of (wa x_a - wb x_b)^2), from ``q[i * n + j]`` = sum of x_i x_j."""
    var = wa * wa * q[a * n + a] - 2.0 * wa * wb * q[a * n + b] + wb * wb * q[b * n + b]
    return math.sqrt(max(var, 0.0))


def choose(shares: Sequence[float], hits: Sequence[float], q: Sequence[float], best: float,
           factors: Mapping[float, float] | None = None, z: float = Z,
           early: bool = False) -> float:
    """The mode to run next (module docstring), from the copies' `shares` (one of them `LRU`),
    their decayed `hits`, the sums of products of their hits per feed `q` (n x n, row-major),
    the running mode `best`, the calibration `factors` of the calibrated modes (1 if absent)
    and the deviations `z` a switch needs; `early` (a quarter-epoch check): only a switch on a
    win, never back to LRU."""
    n = len(shares)
    f = factors or {}
    lru = list(shares).index(LRU)
    w = [f.get(s, 1.0) for s in shares]
    score = [h * x for h, x in zip(hits, w, strict=True)]
    margin = [LFU_MARGIN if s == LFU else LRU_MARGIN if s < LRU else 1.0 for s in shares]

    def ahead(a: int, b: int, zz: float) -> bool:
        """a's score over b's by zz deviations or more, on MIN_HITS hits or more."""
        return (hits[a] + hits[b] >= MIN_HITS
                and score[a] - score[b] > zz * _deviation(q, n, a, b, w[a], w[b]))

    def beats(a: int, b: int) -> bool:
        return score[a] > margin[a] * score[b] and ahead(a, b, z)

    def top(cands: list[int]) -> int:
        return max(cands, key=lambda i: score[i] / margin[i])

    cur = list(shares).index(best) if best in shares else lru
    over_lru = [i for i in range(n) if i != lru and beats(i, lru)]
    if cur != lru and not early and not ahead(cur, lru, Z_STAY):
        cur = lru  # no longer resolved above LRU
    if cur == lru:
        return shares[top(over_lru)] if over_lru else LRU
    better = [i for i in over_lru if i != cur and beats(i, cur)]
    return shares[top(better)] if better else shares[cur]


def resolution(shares: Sequence[float], hits: Sequence[float], q: Sequence[float],
               z: float = Z) -> dict[float, float]:
    """Per candidate other than LRU, the smallest gain over LRU's hits, relative, that `z`
    deviations of their paired difference resolve (empty while LRU has no hit)."""
    n = len(shares)
    lru = list(shares).index(LRU)
    if hits[lru] <= 0:
        return {}
    return {shares[i]: z * _deviation(q, n, i, lru) / hits[lru] for i in range(n) if i != lru}


class MiniSims:
    """Candidates' mini caches over one key sample and the choice between them (module
    docstring). `threshold`: a key is in the sample when its fingerprint's top byte (``h >> 56``)
    is below it. `shares` must include `LRU`."""

    __slots__ = ("_epoch", "_lru", "_q", "_seen", "_settled", "best", "caches", "copy", "real",
                 "resolution", "switches", "threshold", "window")

    def __init__(self, capacity: int, shares: Sequence[float], start: float = LRU,
                 rate: int = RATE, min_cap: int = MIN_CAP, seen: int = 0) -> None:
        rate = max(1, min(max(rate, capacity // MINI_MAX), capacity // min_cap))
        cap = max(1, capacity // rate)
        self.threshold = max(1, 256 // rate)
        self.caches = [MiniCache(cap, s, max(64, seen // rate)) for s in shares]
        self._lru = list(shares).index(LRU)
        n = len(shares)
        self._q = [0.0] * (n * n)
        """Sum over feeds of x_i x_j (copy i's and j's hits in one feed), decayed by DECAY^2."""
        self._epoch = EPOCH * cap
        self._seen = 0
        self.real: dict[float, float] = {}
        self.copy: dict[float, float] = {}
        """Per calibrated mode (probation share, `LFU`): decayed sampled hits of the real cache
        and of that mode's copy while the real cache ran the mode (`factor`)."""
        self.best = start
        self._settled = True
        """False from a switch to the next epoch's end: the real cache is still turning over
        from the old mode's content, so its hits do not calibrate the new mode."""
        self.switches = 0
        """Changes of `best` so far."""
        self.window = 0.0
        """Sampled references in the window (decayed like the hits)."""
        self.resolution: dict[float, float] = {}
        """At the last epoch's end: `resolution` of the window."""

    def add(self, keys: Sequence[BlockKey]) -> None:
        """Reference `keys` in order, sampling them by their unseeded fingerprint."""
        th = self.threshold
        self.feed([k for k in keys if xxh3_64_intdigest(k) >> 56 < th])

    def feed(self, keys: Sequence[BlockKey], placed: Mapping[BlockKey, int] | None = None,
             real_hits: int | None = None) -> None:
        """Reference sampled keys in order (the caller applied `threshold`): one observation of
        the copies' hits. `placed` as in `MiniCache.access`; `real_hits`: how many of `keys` hit
        in the real cache (which ran mode `best` since the last call; None: no real cache, no
        calibration)."""
        cur = self.best
        xs: list[float] = []
        for c in self.caches:
            h0 = c.hits
            c.access(keys, placed)
            x = c.hits - h0
            xs.append(x)
            if (c.share == cur and (cur < LRU or cur == LFU) and real_hits is not None
                    and self._settled):
                self.real[cur] = self.real.get(cur, 0.0) + real_hits
                self.copy[cur] = self.copy.get(cur, 0.0) + x
        if any(xs):
            q, n = self._q, len(xs)
            for i, xi in enumerate(xs):
                if xi:
                    row = i * n
                    for j, xj in enumerate(xs):
                        q[row + j] += xi * xj
        before = self._seen
        self._seen += len(keys)
        self.window += len(keys)
        if self._seen < self._epoch:
            step = self._epoch // PARTS
            if step and self._seen // step != before // step:  # a quarter: a clear win only
                self._choose(Z_EARLY, early=True)
        else:
            self._seen = 0
            self._settled = True
            self._choose(Z, early=False)
            for c in self.caches:
                c.hits *= DECAY
            self._q = [v * (DECAY * DECAY) for v in self._q]
            self.window *= DECAY
            m = self.best
            if m in self.real:  # another mode's calibration keeps until it runs again
                self.real[m] *= DECAY
                self.copy[m] *= DECAY

    def _choose(self, z: float, early: bool) -> None:
        shares = [c.share for c in self.caches]
        hits = [c.hits for c in self.caches]
        factors = {m: self.factor(m) for m in self.real}
        if not early:
            self.resolution = resolution(shares, hits, self._q, z)
        share = choose(shares, hits, self._q, self.best, factors, z, early)
        if share != self.best:
            self.best = share
            self.switches += 1
            self._settled = False

    def factor(self, mode: float) -> float:
        """A calibrated mode's factor: the real cache's sampled hits over its copy's, over the
        epochs it ran that mode (decayed like the hits while it runs, kept while another mode
        runs; `CALIBRATION_PRIOR` hits on each side pull it to 1 while there are few)."""
        return ((self.real.get(mode, 0.0) + CALIBRATION_PRIOR)
                / (self.copy.get(mode, 0.0) + CALIBRATION_PRIOR))

    def entries(self) -> int:
        return sum(len(c.s) + (2 if c.share == LFU else 1) * len(c.m) + len(c.ghosts)
                   for c in self.caches)

    def nbytes_fixed(self) -> int:
        """Bytes of the filter candidates' seen tables (allocated once)."""
        return sum(c.seen.nbytes() for c in self.caches if c.seen is not None)
