"""Online miss-ratio curve: the hit ratio the daemon would have at other DRAM and SSD capacities.

Pure logic (no I/O, no clock, no threads): the daemon feeds it every Lookup's keys and reads the
estimates at scrape time; the tests feed it a trace and compare with `kvtier simulate` replays.

Method — SHARDS (Waldspurger et al., FAST'15), spatially hashed sampling of LRU reuse distances:

- A key is *sampled* when a 64-bit hash of (ns, key) falls under ``rate * 2**64``; only
  sampled keys are tracked, and a sampled reuse distance counted among sampled keys, divided by
  the rate, estimates the true one. The rate is what bounds memory: the table never holds more
  than ``max_keys`` keys. When it would, the rate halves and the keys above the new threshold are
  forgotten (SHARDS' fixed-size variant, in halvings), and hits and references so far keep their
  weight (each observation is scaled by the rate it was made at).
- A lookup of the chain ``k0 .. kn`` touches its blocks root-last, so a parent is always more
  recent than its child; the LRU stack is then prefix-closed at every size, and "the block hits
  at size C" (reuse distance < C) agrees with the prefix rule of a prefix cache.
- Two tiers, as the daemon places blocks (`kvtier.index.placement`: a DRAM block is copied to
  SSD at the Lookup or Commit that makes its k-th access, `kvtier.index.policies.KthAccess`, and
  keeps its DRAM copy; SSD holds the admitted blocks, DRAM's included, in LRU order). Admission
  depends on the capacity, so each capacity with an SSD tier keeps its own access count per key
  and its own set of SSD-resident keys: a reference hits DRAM of C_d blocks when its distance
  d < C_d; it hits DRAM + SSD of C_s blocks when it hits DRAM, or when its block is on SSD there
  (it reached k accesses) and its distance among that capacity's SSD blocks is < C_s. The count
  grows on every access of a cached block; a block gone from both tiers keeps it only while the
  index's admission history still remembers it (`_remembered`), else it starts again at 1.
- Distances come from the tracked keys' logical access times, one mark per key at its time
  (`_Marks`, counted by numpy; per capacity with SSD a Fenwick tree over its SSD blocks' times):
  the keys touched since this key's last access are a range count. Times are renumbered when the
  table of times is full, which is also when keys beyond the largest capacity of interest
  (`horizon`) are dropped: they miss at every capacity the curve reports.

Cost per lookup: one vectorised hash of its keys (numpy) plus O(log n) per sampled key and
capacity with SSD; without SSD capacities a Lookup's sampled keys (from `_BATCH_MIN` on) are
accessed together, vectorised (`_access_batch`: the same sums as one at a time).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from functools import reduce
from itertools import repeat
from operator import add
from typing import NamedTuple

import numpy as np
from xxhash import xxh3_64_intdigest

from kvtier.index.history import ADMISSION_HISTORY_PER_BLOCK

FACTORS = (0.25, 0.5, 2.0, 4.0, 8.0)
"""Capacity multiples the daemon reports (of its DRAM, and of its SSD)."""

MIN_SAMPLES = 1000
"""Sampled block references below which the curve is not reported as a number (`kvtier stats`
says how many it has): with fewer, a hit ratio's sampling error alone can exceed `ERROR`
(binomial: 2 x 0.5 / sqrt(1000) = 0.032)."""
ERROR = 0.03
"""The estimator's stated error in hit ratio: within 3 points of `kvtier simulate` replays of
the shared trace (tests/test_mrc.py) and of the daemon's measured ratio at its own capacity
(tests/test_stats_top.py), once `MIN_SAMPLES` references were sampled."""

HISTORY_REACH = 0.1
"""The admission history's reach, as the words a dropped count survives on average, per word of
the index's history (`ADMISSION_HISTORY_PER_BLOCK` x (C_d + C_s) words, direct-mapped: a count is
lost to a later drop on its word). The drops since a block left are estimated as (d - C_d) x the
miss ratio so far, which undercounts them (a block dropped and reinserted counts once in d, and
SSD victims and ancestors add drops); 0.1 is fitted on the shared trace: every point of the
four DRAM/SSD splits of tests/test_mrc.py is then within 2.6 points of the replays (k = 2; 2.4
with k = 1), where on the 2,000 + 8,000 grid 1 is off by up to 13 points, 0.05 by 4.4, 0.2 by 6.9
(docs/benchmarks.md)."""
_MASK = (1 << 64) - 1
_CAP_BITS = 8
_CAP_MAX = (1 << _CAP_BITS) - 1
_MUL = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio multiplicative hash (odd)
_BATCH_MAX = 256
"""Sampled keys of one Lookup vectorised together at most (`_access_batch` compares each with
the earlier ones: a square of booleans)."""
_BATCH_MIN = 32
"""A Lookup's sampled keys go through `_access_batch` from this many on: one at a time costs ~5 us
a key, a batch ~100 us for a few dozen (16,384 positions, dev-2c: 16 keys 82 vs 129 us, 32 keys
167 vs 136 us, 47 keys 245 vs 153 us)."""
KEY_BYTES = 120
"""Bytes per tracked key without SSD capacities, an upper bound: a dict slot (30-50 B) and two
ints (the 64-bit hash, 36 B; the packed time and counts, 32 B; `key_bytes` adds the counts of
capacities with SSD). The access times add 2 x 1 B per key of `max_keys` (`_Marks`), and 2 x 4 B
each capacity with SSD (a Fenwick tree)."""


class Point(NamedTuple):
    """One capacity of the curve, in blocks, and the estimated hit ratios there."""

    dram_blocks: int
    ssd_blocks: int
    dram_hit_ratio: float
    hit_ratio: float  # DRAM + SSD


class _Fenwick:
    """Prefix sums over positions 1..n with point updates, O(log n) each."""

    __slots__ = ("n", "tree")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = array("i", bytes(4 * (n + 1)))

    def move(self, old: int, new: int) -> None:
        """One mark from position `old` to `new` (> old)."""
        tree, n = self.tree, self.n
        while old <= n:
            tree[old] -= 1
            old += old & -old
        while new <= n:
            tree[new] += 1
            new += new & -new

    def add(self, i: int, v: int) -> None:
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        tree, s = self.tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


class _Marks:
    """0/1 marks over positions 1..n, one byte each, with prefix counts by `numpy.count_nonzero`
    (a few microseconds over the table's positions, about what a Fenwick tree's O(log n) Python
    steps cost) and every prefix count at once (`prefixes`, one `numpy.cumsum`), so a batch of
    accesses (`ReuseSampler._access_batch`) reads and moves all its marks without a Python step
    per key."""

    __slots__ = ("n", "occ", "view")

    def __init__(self, n: int) -> None:
        self.n = n
        self.occ = bytearray(n + 1)
        self.view = np.frombuffer(self.occ, dtype=np.uint8)

    def move(self, old: int, new: int) -> None:
        """The mark at `old` to `new` (which has none)."""
        self.occ[old] = 0
        self.occ[new] = 1

    def add(self, i: int, v: int) -> None:
        """A mark at `i` (which has none): `v` = 1."""
        self.occ[i] = v

    def prefix(self, i: int) -> int:
        """Marks at positions 1..i."""
        return int(np.count_nonzero(self.view[: i + 1]))

    def prefixes(self, upto: int) -> np.ndarray:
        """Every prefix count up to position `upto`: [i] = `prefix(i)` (int32 out: a cumsum into
        int64 runs ~20x slower here)."""
        return np.cumsum(self.view[: upto + 1], dtype=np.int32)


def key_bytes(ssd_points: int = 0) -> int:
    """Bytes per tracked key with `ssd_points` capacities that have an SSD tier: `KEY_BYTES` plus
    the packed int's `_CAP_BITS` per such capacity (4 bytes per 30-bit digit)."""
    return KEY_BYTES + 4 * -(-_CAP_BITS * ssd_points // 30)


def keys_for_budget(budget_bytes: int, ssd_points: int = 0) -> int:
    """How many tracked keys fit in `budget_bytes` (at least 64) with `ssd_points` capacities
    that have an SSD tier (each adds a Fenwick tree: 2 x 4 B per key; the marks: 2 x 1 B)."""
    return max(64, budget_bytes // (key_bytes(ssd_points) + 8 * ssd_points + 2))


class ReuseSampler:
    """SHARDS estimator of the two-tier hit ratio at a fixed set of capacities (see module doc).

    `capacities`: the (dram_blocks, ssd_blocks) pairs to estimate. `admit_k`: the index's SSD
    admission threshold. `max_keys`: the most keys tracked at once (the memory bound; the rate
    halves to stay under it). `rate`: the initial sampling rate (0 < rate <= 1); None = the rate
    at which `max_keys` keys cover the largest capacity (`horizon`).
    Not thread-safe: the owner serialises `observe` and the readers.
    """

    def __init__(
        self,
        capacities: Sequence[tuple[int, int]],
        *,
        admit_k: int = 2,
        rate: float | None = None,
        max_keys: int = 1 << 16,
    ) -> None:
        if not capacities:
            raise ValueError("need at least one capacity")
        if any(d < 0 or s < 0 for d, s in capacities):
            raise ValueError("capacities must be >= 0 blocks")
        if rate is not None and not 0.0 < rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
        if admit_k < 1:
            raise ValueError(f"admit_k must be >= 1, got {admit_k}")
        if max_keys < 16:
            raise ValueError(f"max_keys must be >= 16, got {max_keys}")
        self.capacities = [(int(d), int(s)) for d, s in capacities]
        self.admit_k = admit_k
        self.max_keys = max_keys
        self.horizon = max(d + s for d, s in self.capacities)
        if rate is None:  # as many keys as the bound allows over the horizon
            rate = min(1.0, max_keys / max(1, self.horizon))
        self._threshold = max(1, min(_MASK, int(rate * (1 << 64))))
        self._dram_caps = [d for d, _s in self.capacities]
        # the capacities with an SSD tier: (index, dram, ssd, history reach)
        self._tiered = [(i, d, s, HISTORY_REACH * ADMISSION_HISTORY_PER_BLOCK * (d + s))
                        for i, (d, s) in enumerate(self.capacities) if s]
        self._shift = _CAP_BITS * max(1, len(self._tiered))
        self._salts: dict[object, int] = {}
        self._np_salts: dict[object, np.uint64] = {}
        self._np_threshold = np.uint64(self._threshold)
        # tracked key hash -> last access time << _shift | per SSD capacity: accesses (capped)
        self._keys: dict[int, int] = {}
        self._size = max(64, 2 * min(max_keys, int(self.horizon * rate * 1.25) + 64))
        self._all = _Marks(self._size)
        self._adm = [_Fenwick(self._size) for _ in self._tiered]
        self._adm_count = [0] * len(self._tiered)
        self._now = 0
        self.refs = 0.0  # references seen, in block units (each sampled one weighs 1 / rate)
        self._dram_hits = [0.0] * len(self.capacities)
        self._hits = [0.0] * len(self.capacities)
        self.lookups = 0
        self.sampled_refs = 0

    @property
    def rate(self) -> float:
        return self._threshold / (1 << 64)

    @property
    def tracked_keys(self) -> int:
        return len(self._keys)

    @property
    def key_bytes(self) -> int:
        """`key_bytes` of this sampler's capacities."""
        return key_bytes(len(self._tiered))

    def tree_bytes(self) -> int:
        """The Fenwick trees' bytes (one per capacity with SSD) and the marks of all keys'."""
        return (len(self._tiered) * 4 + 1) * (self._size + 1)

    # ------------------------------------------------------------------ feeding
    def observe(self, ns: object, keys: Sequence[bytes]) -> None:
        """One lookup of the chain `keys` (root first) by `ns`."""
        if not keys:
            return
        width = len(keys[0])
        if width % 8 == 0 and all(len(k) == width for k in keys):
            self.observe_packed(ns, b"".join(keys), width)
            return
        self.lookups += 1
        thr, salt = self._threshold, self._salt(ns)
        sampled = [v for v in (xxh3_64_intdigest(k, salt) for k in keys) if v < thr]
        for h in reversed(sampled):  # root last: a parent is more recent than its child
            self._access(h)

    def observe_packed(self, ns: object, keys: bytes, width: int) -> None:
        """`observe` for keys packed back to back, `width` bytes each (a multiple of 8), as the
        Lookup RPC carries them: one vectorised hash of all keys, no per-key Python work."""
        if not keys:
            return
        if width < 8 or width % 8 or len(keys) % width:
            raise ValueError(f"packed keys need a width that is a multiple of 8, got {width}")
        self.lookups += 1
        # Fibonacci hashing of each key's first 8 bytes (block keys are SHA-256 or XXH3 output,
        # so those are uniform; the multiply is a bijection, so distinct words stay distinct)
        h = np.frombuffer(keys, dtype=np.uint64)[:: width // 8] ^ self._np_salt(ns)
        h *= _MUL
        under = h < self._np_threshold
        if under.any():
            sampled = h[np.flatnonzero(under)[::-1]].tolist()  # root last: a parent is more recent
            if self._tiered or len(sampled) < _BATCH_MIN:
                for v in sampled:
                    self._access(v)
                return
            for at in range(0, len(sampled), _BATCH_MAX):
                part = sampled[at : at + _BATCH_MAX]
                if not self._access_batch(part):
                    for v in part:
                        self._access(v)

    def _salt(self, ns: object) -> int:
        salt = self._salts.get(ns)
        if salt is None:
            salt = self._salts[ns] = xxh3_64_intdigest(repr(ns).encode())
            self._np_salts[ns] = np.uint64(salt)
        return salt

    def _np_salt(self, ns: object) -> np.uint64:
        salt = self._np_salts.get(ns)
        if salt is None:
            self._salt(ns)
            salt = self._np_salts[ns]
        return salt

    def _access(self, h: int) -> None:
        weight = (1 << 64) / self._threshold
        self.refs += weight
        self.sampled_refs += 1
        if self._now >= self._size:
            self._compact()
            if h >= self._threshold:  # the compaction lowered the rate past this key
                return
        self._now += 1
        now = self._now
        k = self.admit_k
        keys = self._keys
        shift = self._shift
        tiered = self._tiered
        entry = keys.get(h)
        if entry is None:
            packed = 0
            for j, (_i, _cd, _cs, _keep) in enumerate(tiered):
                packed |= 1 << (_CAP_BITS * j)
                if k <= 1:
                    self._adm[j].add(now, 1)
                    self._adm_count[j] += 1
            keys[h] = now << shift | packed
            self._all.add(now, 1)
            if len(keys) > self.max_keys:
                self._compact()
            return
        last = entry >> shift
        scale = 1.0 / self.rate
        d = (len(keys) - self._all.prefix(last)) * scale
        hits, dram_hits = self._hits, self._dram_hits
        for i, cd in enumerate(self._dram_caps):
            if d < cd:
                dram_hits[i] += weight
                hits[i] += weight
        packed = 0
        for j, (i, cd, cs, keep) in enumerate(tiered):
            cnt = entry >> (_CAP_BITS * j) & _CAP_MAX
            adm = self._adm[j]
            on = cnt >= k
            if d < cd:  # a DRAM hit: one more access of a cached block
                cached = True
            elif on and (self._adm_count[j] - adm.prefix(last)) * scale < cs:
                hits[i] += weight  # an SSD hit
                cached = True
            else:
                cached = False
            if cached or self._remembered(h, now, (d - cd) * (1.0 - hits[i] / self.refs), keep):
                cnt = cnt + 1 if cnt < _CAP_MAX else cnt
            else:  # gone from every tier and forgotten by the admission history
                cnt = 1
            if on:
                if cnt >= k:
                    adm.move(last, now)
                else:
                    adm.add(last, -1)
                    self._adm_count[j] -= 1
            elif cnt >= k:  # the k-th access: written back at this Lookup or Commit
                adm.add(now, 1)
                self._adm_count[j] += 1
            packed |= cnt << (_CAP_BITS * j)
        self._all.move(last, now)
        keys[h] = now << shift | packed

    def _access_batch(self, hs: list[int]) -> bool:
        """`_access` of each of `hs` in turn, vectorised: the same state and the same sums (each
        float accumulator gets the same additions in the same order). Only without capacities
        with an SSD tier, for distinct keys, and when no access would compact; False (nothing
        changed) otherwise, for the caller to take `_access` one key at a time.

        Access i of an already tracked key last seen at time t_i finds, among the keys tracked
        then, those with a later time: the keys with a later time before the batch (the table's
        size minus the prefix sum at t_i), the keys new in the batch before i, and the keys
        accessed earlier in the batch that were older than t_i (their mark moved past t_i)."""
        m = len(hs)
        keys = self._keys
        now0 = self._now
        if self._tiered or now0 + m > self._size:
            return False
        entries = np.array([-1 if e is None else e for e in map(keys.get, hs)], dtype=np.int64)
        is_new = entries < 0
        fresh = int(np.count_nonzero(is_new))
        if len(keys) + fresh > self.max_keys or len(set(hs)) != m:
            return False
        shift = self._shift
        marks = self._all
        weight = (1 << 64) / self._threshold
        old = ~is_new
        lasts = entries[old] >> shift
        if len(lasts):
            new_before: np.ndarray = (np.cumsum(is_new) - is_new)[old]
            earlier_older = np.tril(lasts[None, :] < lasts[:, None], -1).sum(axis=1)
            before = marks.prefixes(int(lasts.max()))[lasts]
            d = (len(keys) + new_before - before + earlier_older) * (1.0 / self.rate)
            hits, dram_hits = self._hits, self._dram_hits
            for i, cd in enumerate(self._dram_caps):
                n = int(np.count_nonzero(d < cd))  # one addition of `weight` per hit, in turn
                dram_hits[i] = reduce(add, repeat(weight, n), dram_hits[i])
                hits[i] = reduce(add, repeat(weight, n), hits[i])
        self.refs = reduce(add, repeat(weight, m), self.refs)
        self.sampled_refs += m
        nows = np.arange(now0 + 1, now0 + m + 1, dtype=np.int64)
        marks.view[lasts] = 0
        marks.view[nows] = 1
        keys.update(zip(hs, (nows << shift).tolist(), strict=True))
        self._now = now0 + m
        return True

    @staticmethod
    def _remembered(h: int, now: int, drops: float, words: float) -> bool:
        """Whether a direct-mapped history of `words` words still holds a count after `drops`
        later drops: with probability exp(-drops / words), drawn from a hash of (key, time)."""
        if drops <= 0:
            return True
        u = ((h ^ now * 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9 & _MASK) >> 11
        return u < math.exp(-drops / words) * (1 << 53)

    def _compact(self) -> None:
        """Renumber access times 1..n (oldest first), forget keys beyond the horizon, and halve
        the rate while the table is over `max_keys`."""
        keys = self._keys
        while len(keys) > self.max_keys:
            self._threshold //= 2
            self._np_threshold = np.uint64(self._threshold)
            thr = self._threshold
            for h in [h for h in keys if h >= thr]:
                del keys[h]
        shift = self._shift
        order = sorted(keys.items(), key=lambda kv: kv[1] >> shift)  # by last access time
        limit = max(1, int(self.horizon * self.rate * 1.25) + 1)
        for h, _v in order[: max(0, len(order) - limit)]:
            del keys[h]
        order = order[max(0, len(order) - limit) :]
        self._all = _Marks(self._size)
        n = len(self._tiered)
        self._adm = [_Fenwick(self._size) for _ in range(n)]
        self._adm_count = [0] * n
        k = self.admit_k
        mask = (1 << shift) - 1
        for t, (h, v) in enumerate(order, start=1):
            packed = v & mask
            keys[h] = t << shift | packed
            self._all.add(t, 1)
            for j in range(n):
                if packed >> (_CAP_BITS * j) & _CAP_MAX >= k:
                    self._adm[j].add(t, 1)
                    self._adm_count[j] += 1
        self._now = len(order)

    # ------------------------------------------------------------------ reading
    def points(self) -> list[Point]:
        """The estimate at every capacity, in the order given (hit ratios 0 before any lookup)."""
        refs = self.refs
        return [
            Point(d, s, dh / refs if refs else 0.0, h / refs if refs else 0.0)
            for (d, s), dh, h in zip(self.capacities, self._dram_hits, self._hits, strict=True)
        ]


def memory_bytes(sampler: ReuseSampler) -> int:
    """An upper bound of the sampler's tables' bytes, O(1): `key_bytes` per tracked key plus the
    time marks and Fenwick trees (`measure_bytes` counts them object by object)."""
    return sampler.tracked_keys * sampler.key_bytes + sampler.tree_bytes()


def measure_bytes(sampler: ReuseSampler) -> int:
    """The sampler's tables counted object by object (O(tracked keys); for tests and benches)."""
    keys = sampler._keys
    return (sys.getsizeof(keys) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in
                                      keys.items()) + sampler.tree_bytes())


def labelled(points: Sequence[Point], factors: Sequence[float] = FACTORS,
             ) -> list[tuple[str, float, Point]]:
    """`points` of a `capacity_grid` as (scaled tier, factor, point): ("none", 1.0) first."""
    out = [("none", 1.0, points[0])]
    n = len(factors)
    out += [("dram", f, p) for f, p in zip(factors, points[1 : 1 + n], strict=True)]
    out += [("ssd", f, p) for f, p in zip(factors, points[1 + n :], strict=False)]
    return out


def capacity_grid(dram_blocks: int, ssd_blocks: int,
                  factors: Sequence[float] = FACTORS) -> list[tuple[int, int]]:
    """The capacities the daemon reports: its own, then DRAM x each factor (SSD as is), then SSD
    x each factor (DRAM as is). With no SSD, the SSD points are left out."""
    grid = [(dram_blocks, ssd_blocks)]
    grid += [(int(dram_blocks * f), ssd_blocks) for f in factors]
    if ssd_blocks:
        grid += [(dram_blocks, int(ssd_blocks * f)) for f in factors]
    return grid
