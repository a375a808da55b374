"""Miniature simulations: which queue mode would have hit more, measured on a sample of keys.

Each candidate runs a small block-level copy of one mode of
`kvtier.index.policies.adaptive.queue.AdaptiveQueue` over the references of a spatial sample of the
keys: a probation share < 1 (probation S in LRU order with a 2-bit frequency, main M as a CLOCK on
that frequency, S's oldest moving to M when its frequency is > 1, a key dropped from S remembered as
a ghost that re-enters in M), share 1.0 (plain LRU), `FILTER` (LRU behind the reuse filter: a missed
key is stored only if a `SeenTable` saw it before, vLLM's store-after-two-lookups) or `LFU` (the
lowest access count leaves, counts resumed from the ghosts: SGLang's LFU). The sample is 1 key in
`rate`: those whose 64-bit XXH3 fingerprint has its top byte below `threshold` = 256 / rate; the
caller, which fingerprints each key once anyway, samples and calls `feed`; `add` fingerprints for
itself; deterministic, no `hash()`. The mini caches are 1/`rate` of the real capacity (Waldspurger
et al., "Cache Modeling and Optimization using Miniature Simulations", USENIX ATC 2017). Hits decay
by `DECAY` each epoch; `best` moves to the candidate with the most only when it wins by `margin` and
by `Z` standard deviations of the counts (two Poisson counts: a small cache's few hits an epoch do
not flip the mode on noise) with `MIN_HITS` counted, and a probation-share candidate must beat the
LRU ones by `LRU_MARGIN`, the `LFU` one by `LFU_MARGIN` and `Z_LFU` (LRU is the bound the policy
must not fall under: the copies ignore the prefix rule and the predictor, so a near tie in them is
no gain in the real cache; measured, issue 29). The probation and LFU copies are calibrated by the
real cache's hits while it runs their mode (`MiniSims.factor`). At each quarter of an epoch
(`PARTS`) the choice is made again, needing `Z_EARLY` deviations: a wide gap switches without
waiting for the epoch's end. The mini caches rank modes, they do not predict hit ratios.

Memory: candidates x 2 x capacity/rate entries (cached + ghosts, an OrderedDict slot each,
~100 B; the LFU copy's keys twice: a count and a slot in their count's list) plus the filter
candidate's seen table (4 B a word, the policy's table / rate): with 4 candidates and rate 8,
~110 B per block of real capacity up to 32K blocks (the mini caches stop growing at `MINI_MAX`
entries: ~29 B per block at 128K, ~3.7 MB in all; below `MIN_CAP` x 8
blocks the rate falls, down to 1 under 2 x `MIN_CAP`: a small cache's copies are the whole cache,
so its few hits are all counted). Work: O(1) per sampled reference and candidate.
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
Z = 2.0
"""Standard deviations by which a candidate must win to be chosen (measured, issue 29, with the
copies' predictor placements and the probation mode's calibration: 1 flipped longreuse at 1-2%
out of the probation mode on the first epochs' noise, 0.67-0.74x the best peer there; before
those, 2 kept a small cache in the start mode too long; 0 flips on noise)."""
LRU_MARGIN = 1.05
"""Factor by which a probation-share candidate must beat the others' hits (measured, issue 29:
1.0-1.03 left agentic at 10-20% 1-3% under LRU; its small-cache wins are 10% and more). The
filter candidate competes at par: its copy leaves out less (no predictor), and a margin kept the
real cache out of it at 2-5% on tenants and chat, 1-3% under vllm-reuse."""
MIN_HITS = 50.0
"""Hits (the two candidates' sum) under which no switch is made, whatever the gap: a request's
hits come in chains, so a few dozen hits are a few requests and their Poisson deviation
understates the noise (measured, issue 29 seventh pass: longreuse at 1-2% left the probation
mode for LRU or the filter on the first epochs' 10-40 hits, 0.90-0.94x lmcache-s3fifo; 50 took
both to 0.94, 100 left longreuse 1% at 0.92x, 300 took the shared trace at 1% from 1.22x LRU to
1.05x)."""
LFU_MARGIN = 1.1
"""Factor by which the `LFU` candidate must beat the others (after its calibration): measured
(issue 29, seventh pass), at par it took trace 20% to 0.97x LRU, at 1.05 docchat 2% fell to 0.96x
the best peer."""
Z_LFU = 3.0
"""Standard deviations by which the `LFU` candidate must win (measured: with 2 the first epochs'
noise took the shared trace at 1% into it, 1.15x LRU instead of 1.18x)."""
Z_EARLY = 4.0
"""Standard deviations by which a candidate must win at a quarter of an epoch (`PARTS`) to be
chosen before the epoch ends (measured: 3 took the shared trace at 2% to 0.95x the filter)."""
PARTS = 4
"""Checks per epoch: at each quarter the choice is made again with `Z_EARLY` (hits not decayed)."""
CALIBRATION_PRIOR = 50.0
"""Hits added to both sides of `MiniSims.factor` (a few epochs' worth at the smallest copies)."""
EPOCH = 4
"""Sampled references per epoch, per entry of a mini cache (measured: 2 gained nowhere)."""
DECAY = 0.9
"""Hits kept per epoch (0.5 before issue 29: two epochs' memory was too few hits to rank; 0.8
until its second pass: longreuse 2% 0.86x the best peer against 0.90x, trace 10% 0.96x the reuse
filter against 1.00x)."""
RATE = 8
"""Default sample: 1 key in 8. Measured (docs/benchmarks.md, "Policies, fourth pass", over 4 key
samples on every workload): the sample trace at 1% and 5% 1.086x / 1.035x LRU instead of 1.047x /
1.006x with 1 in 16, every other cell within 0.1%; the larger sample is what fixes the order choice
there (the choice flips with a 1-in-16 sample's luck)."""


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


def choose(caches: Sequence[MiniCache], best: float, margin: float,
           factors: Mapping[float, float] | None = None, z: float = Z) -> float:
    """The mode to run: the candidate with the highest score (its decayed hits; a calibrated
    candidate's — probation share or `LFU` — times its factor in `factors`, the real cache's hits
    over its copy's while it ran that mode, 1 if absent, and divided by `LRU_MARGIN`, `LFU_MARGIN`
    for `LFU`; the first listed on a tie) if it beats the current mode `best`'s score by `margin`
    and by `z` standard deviations of the two counts (sqrt of their sum: Poisson; `Z_LFU` for
    `LFU`) and the two counts sum to `MIN_HITS` or more, else `best` (hysteresis)."""
    f = factors or {}

    def score(c: MiniCache) -> float:
        if c.share == LFU:
            return c.hits * f.get(LFU, 1.0) / LFU_MARGIN
        if c.share < 1.0:
            return c.hits * f.get(c.share, 1.0) / LRU_MARGIN
        return c.hits
    top = max(caches, key=score)
    cur = next((c for c in caches if c.share == best), None)
    if top.share == LFU:
        z = Z_LFU
    if cur is None or (score(top) > score(cur) * margin and top.hits + cur.hits >= MIN_HITS
                       and score(top) - score(cur) > z * math.sqrt(top.hits + cur.hits)):
        return top.share
    return best


class MiniSims:
    """Candidates' mini caches over one key sample; `best` after each epoch. `threshold`: a key
    is in the sample when its fingerprint's top byte (``h >> 56``) is below it."""

    __slots__ = ("_epoch", "_seen", "best", "caches", "copy", "margin", "real",
                 "threshold")

    def __init__(self, capacity: int, shares: Sequence[float], start: float,
                 rate: int = RATE, min_cap: int = MIN_CAP, margin: float = 1.01,
                 seen: int = 0) -> None:
        rate = max(1, min(max(rate, capacity // MINI_MAX), capacity // min_cap))
        cap = max(1, capacity // rate)
        self.threshold = max(1, 256 // rate)
        self.caches = [MiniCache(cap, s, max(64, seen // rate)) for s in shares]
        self._epoch = EPOCH * cap
        self._seen = 0
        self.real: dict[float, float] = {}
        self.copy: dict[float, float] = {}
        """Per calibrated mode (probation share, `LFU`): decayed sampled hits of the real cache
        and of that mode's copy while the real cache ran the mode (`factor`)."""
        self.best = start
        self.margin = margin

    def add(self, keys: Sequence[BlockKey]) -> None:
        """Reference `keys` in order, sampling them by their unseeded fingerprint."""
        th = self.threshold
        self.feed([k for k in keys if xxh3_64_intdigest(k) >> 56 < th])

    def feed(self, keys: Sequence[BlockKey], placed: Mapping[BlockKey, int] | None = None,
             real_hits: int | None = None) -> None:
        """Reference sampled keys in order (the caller applied `threshold`); `placed` as in
        `MiniCache.access`; `real_hits`: how many of `keys` hit in the real cache (which ran
        mode `best` since the last call; None: no real cache, no calibration)."""
        caches = self.caches
        cur = self.best
        for c in caches:
            h0 = c.hits
            c.access(keys, placed)
            if c.share == cur and (cur < 1.0 or cur == LFU) and real_hits is not None:
                self.real[cur] = self.real.get(cur, 0.0) + real_hits
                self.copy[cur] = self.copy.get(cur, 0.0) + c.hits - h0
        before = self._seen
        self._seen += len(keys)
        if self._seen < self._epoch:
            step = self._epoch // PARTS
            if step and self._seen // step != before // step:  # a quarter: a clear win only
                self.best = choose(caches, self.best, self.margin,
                                   {m: self.factor(m) for m in self.real}, Z_EARLY)
        else:
            self._seen = 0
            self.best = choose(caches, self.best, self.margin,
                               {m: self.factor(m) for m in self.real})
            for c in caches:
                c.hits *= DECAY
            for m in self.real:
                self.real[m] *= DECAY
                self.copy[m] *= DECAY

    def factor(self, mode: float) -> float:
        """A calibrated mode's factor: the real cache's sampled hits over its copy's, over the
        epochs it ran that mode (decayed like the hits; `CALIBRATION_PRIOR` hits of each pull
        it to 1 while there are few, and back to 1 while another mode runs)."""
        return ((self.real.get(mode, 0.0) + CALIBRATION_PRIOR)
                / (self.copy.get(mode, 0.0) + CALIBRATION_PRIOR))

    def entries(self) -> int:
        return sum(len(c.s) + (2 if c.share == LFU else 1) * len(c.m) + len(c.ghosts)
                   for c in self.caches)

    def nbytes_fixed(self) -> int:
        """Bytes of the filter candidates' seen tables (allocated once)."""
        return sum(c.seen.nbytes() for c in self.caches if c.seen is not None)
