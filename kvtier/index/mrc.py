"""Online miss-ratio curve: the hit ratio the daemon would have at other DRAM and SSD capacities.

Pure logic (no I/O, no clock, no threads): the daemon feeds it every Lookup's keys and reads the
estimates at scrape time; the tests feed it a trace and compare with `kvtier simulate` replays.

Method — SHARDS (Waldspurger et al., FAST'15), spatially hashed sampling of LRU reuse distances:

- A key is *sampled* when a 64-bit hash of (tenant, key) falls under ``rate * 2**64``; only
  sampled keys are tracked, and a sampled reuse distance counted among sampled keys, divided by
  the rate, estimates the true one. The rate is what bounds memory: the table never holds more
  than ``max_keys`` keys. When it would, the rate halves and the keys above the new threshold are
  forgotten (SHARDS' fixed-size variant, in halvings), and hits and references so far keep their
  weight (each observation is scaled by the rate it was made at).
- A lookup of the chain ``k0 .. kn`` touches its blocks root-last, so a parent is always more
  recent than its child; the LRU stack is then prefix-closed at every size, and "the block hits
  at size C" (reuse distance < C) agrees with the prefix rule of a prefix cache.
- Two tiers, as the index runs them (DRAM over all traffic, SSD fed by DRAM victims admitted on
  the k-th access, see `kvtier.index.policies.KthAccess`): a reference hits DRAM of C_d blocks when its
  distance d < C_d; it hits DRAM + SSD of C_s blocks when it hits DRAM, or when its block had
  already been accessed k times before (so its last DRAM eviction wrote it to SSD) and its
  distance among such admitted blocks is < C_s + `DRAM_SHARE` x C_d (DRAM and SSD share the
  admitted blocks' recency; about half the admitted blocks in DRAM also hold SSD room).
- Distances come from a Fenwick tree over logical access times of the tracked keys: the keys
  touched since this key's last access are a range sum. Times are renumbered when the tree is
  full, which is also when keys beyond the largest capacity of interest (`horizon`) are dropped:
  they miss at every capacity the curve reports.

Cost per lookup: one vectorised hash of its keys (numpy) plus O(log n) per sampled key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from xxhash import xxh3_64_intdigest

FACTORS = (0.25, 0.5, 2.0, 4.0, 8.0)
"""Capacity multiples the daemon reports (of its DRAM, and of its SSD)."""

DRAM_SHARE = 0.5
"""Of the admitted blocks DRAM holds, the share that does not also take SSD room: a block promoted
from SSD keeps its SSD copy, one that reached k accesses while in DRAM has none yet. 0.5 is
within 3 points of replays at four DRAM/SSD splits of the shared trace (tests/test_mrc.py,
docs/benchmarks.md); 0 (SSD only) and 1 (DRAM + SSD) are each off by up to 5 points."""
_MASK = (1 << 64) - 1
_MUL = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio multiplicative hash (odd)
_SHIFT = np.uint64(29)
_KEY_BYTES_TRACKED = 120
"""Approximate bytes per tracked key: dict slot + int key + list of two ints, and two Fenwick
slots (measured by bench/mrc.py with tracemalloc; used to turn a byte budget into `max_keys`)."""


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
        self.tree = [0] * (n + 1)

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


def keys_for_budget(budget_bytes: int) -> int:
    """How many tracked keys fit in `budget_bytes` (at least 64)."""
    return max(64, budget_bytes // _KEY_BYTES_TRACKED)


class ReuseSampler:
    """SHARDS estimator of the two-tier hit ratio at a fixed set of capacities (see module doc).

    `capacities`: the (dram_blocks, ssd_blocks) pairs to estimate. `admit_k`: the index's SSD
    admission threshold. `rate`: the initial sampling rate (0 < rate <= 1); `max_keys`: the most
    keys tracked at once (the memory bound; the rate halves to stay under it).
    Not thread-safe: the owner serialises `observe` and the readers.
    """

    def __init__(
        self,
        capacities: Sequence[tuple[int, int]],
        *,
        admit_k: int = 2,
        rate: float = 1.0,
        max_keys: int = 1 << 16,
    ) -> None:
        if not capacities:
            raise ValueError("need at least one capacity")
        if any(d < 0 or s < 0 for d, s in capacities):
            raise ValueError("capacities must be >= 0 blocks")
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
        if admit_k < 1:
            raise ValueError(f"admit_k must be >= 1, got {admit_k}")
        if max_keys < 16:
            raise ValueError(f"max_keys must be >= 16, got {max_keys}")
        self.capacities = [(int(d), int(s)) for d, s in capacities]
        self.admit_k = admit_k
        self.max_keys = max_keys
        self.horizon = max(d + s for d, s in self.capacities)
        self._threshold = min(_MASK, int(rate * (1 << 64)))
        self._salts: dict[object, int] = {}
        # tracked key hash -> [last access time, accesses so far]
        self._keys: dict[int, list[int]] = {}
        self._size = max(64, 2 * min(max_keys, int(self.horizon * rate * 1.25) + 64))
        self._all = _Fenwick(self._size)
        self._admitted = _Fenwick(self._size)
        self._now = 0
        self._admitted_count = 0
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

    # ------------------------------------------------------------------ feeding
    def observe(self, tenant: object, keys: Sequence[bytes]) -> None:
        """One lookup of the chain `keys` (root first) by `tenant`."""
        if not keys:
            return
        self.lookups += 1
        salt = self._salts.get(tenant)
        if salt is None:
            salt = self._salts[tenant] = xxh3_64_intdigest(repr(tenant).encode())
        sampled = self._sample(keys, salt)
        if not sampled:
            return
        for h in reversed(sampled):  # root last: a parent is more recent than its child
            self._access(h)

    def _sample(self, keys: Sequence[bytes], salt: int) -> list[int]:
        """Hashes of the sampled keys, in chain order."""
        thr = self._threshold
        n = len(keys[0])
        if n >= 8 and n % 8 == 0 and all(len(k) == n for k in keys):
            raw = np.frombuffer(b"".join(keys), dtype=np.uint64)
            words = n // 8
            h = np.full(len(keys), salt, dtype=np.uint64)
            for w in range(words):
                h ^= raw[w::words]
                h *= _MUL
                h ^= h >> _SHIFT
            hit = np.flatnonzero(h < np.uint64(thr)) if thr < _MASK else range(len(keys))
            return [int(h[i]) for i in hit]
        out = []
        for k in keys:
            v = xxh3_64_intdigest(k, salt)
            if v < thr:
                out.append(v)
        return out

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
        entry = self._keys.get(h)
        if entry is None:
            self._keys[h] = [now, 1]
            self._all.add(now, 1)
            if k <= 1:
                self._admitted.add(now, 1)
                self._admitted_count += 1
            if len(self._keys) > self.max_keys:
                self._compact()
            return
        last, count = entry
        scale = 1.0 / self.rate
        d = (len(self._keys) - self._all.prefix(last)) * scale
        eligible = count >= k
        if eligible:
            da = (self._admitted_count - self._admitted.prefix(last)) * scale
        for i, (cd, cs) in enumerate(self.capacities):
            if d < cd:
                self._dram_hits[i] += weight
                self._hits[i] += weight
            elif eligible and da < cs + DRAM_SHARE * cd:
                self._hits[i] += weight
        self._all.add(last, -1)
        self._all.add(now, 1)
        was_admitted = count >= k
        count += 1
        if was_admitted:
            self._admitted.add(last, -1)
            self._admitted.add(now, 1)
        elif count >= k:
            self._admitted.add(now, 1)
            self._admitted_count += 1
        entry[0] = now
        entry[1] = count

    def _compact(self) -> None:
        """Renumber access times 1..n (oldest first), forget keys beyond the horizon, and halve
        the rate while the table is over `max_keys`."""
        keys = self._keys
        limit = max(1, int(self.horizon * self.rate * 1.25) + 1)
        while len(keys) > self.max_keys or len(keys) > limit:
            if len(keys) > self.max_keys:
                self._threshold //= 2
                thr = self._threshold
                for h in [h for h in keys if h >= thr]:
                    del keys[h]
                limit = max(1, int(self.horizon * self.rate * 1.25) + 1)
            if len(keys) > limit:
                oldest = sorted(keys.items(), key=lambda kv: kv[1][0])
                for h, _ in oldest[: len(keys) - limit]:
                    del keys[h]
        order = sorted(keys.values(), key=lambda e: e[0])
        self._all = _Fenwick(self._size)
        self._admitted = _Fenwick(self._size)
        self._admitted_count = 0
        k = self.admit_k
        for t, e in enumerate(order, start=1):
            e[0] = t
            self._all.add(t, 1)
            if e[1] >= k:
                self._admitted.add(t, 1)
                self._admitted_count += 1
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
    """Estimated bytes of the sampler's tables (`_KEY_BYTES_TRACKED` per tracked key plus the
    two Fenwick trees' pointer arrays)."""
    return sampler.tracked_keys * _KEY_BYTES_TRACKED + 2 * 8 * (sampler._size + 1)


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
