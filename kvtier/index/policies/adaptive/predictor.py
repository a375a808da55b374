"""The adaptive policy's admission side: `FrequencySketch` and `ReusePredictor`.

`FrequencySketch`: one saturating byte per slot (4 slots per block of the larger tier, at least 64
KiB), indexed by the XXH3 fingerprint of (ns, key); every key `admit` is asked about (the
missed suffix of a request, when it is about to be stored) adds 1 (up to 15) and every slot is
halved after 10 x slots increments, so it tells whether a key was referenced before over a window
~10x longer than the cache, without keeping any key. A collision only inflates a count: it can
change a decision, never the index's invariants.

`ReusePredictor` (admission): every missed block gets a feature bucket from what a daemon sees
when it is stored —

    depth in the chain (log2, 8 classes) x tail (partial last / full last / inner block)
    x prefix hit of the request (none / parent hit for the first time / parent reused before)
    x blocks since the hit boundary (0, 1, 2-3, 4+) x key seen before (the seen table; the sketch
    in front of a larger SSD) = 576 buckets

and per namespace (the daemon's: tenant + layout) a table of (reused, stored) counts per bucket,
with a prior from the namespace's overall rate and halving when a bucket's count reaches 256 (so
it follows drift). In the probation mode (and in front of a larger SSD) a block with estimate
p < `lo` enters probation's cold end (evicted first); a partial last block with p < `bypass` is
not stored at all. Outside those the predictor neither places nor learns.
One block in `SAMPLE` (while fewer than `TRACKED_MAX` are tracked) is a control: stored whatever
p says and tracked until it leaves the cache; whether it was hit meanwhile is the label its bucket
learns, so learning never starves a bucket and the labels do not depend on the predictions.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xxhash import xxh3_64_intdigest

from kvtier.core.types import BlockKey

if TYPE_CHECKING:
    from kvtier.index.types import Ns

BUCKETS = 8 * 3 * 3 * 4 * 2
SKETCH_SLOTS = 4
"""Sketch bytes per block of the larger tier..."""
SKETCH_MIN = 1 << 16
"""...and at least this many (64 KiB: a small cache still remembers a long window of keys)..."""
SKETCH_MAX = 1 << 27
"""...and at most this many (128 MiB), whatever the capacity (billions of small SSD blocks)."""
_HALVE_AT = 256
_MASK64 = (1 << 64) - 1
_COUNT_MAX = 15
_HALVE = bytes(i >> 1 for i in range(256))


def _seed(ns: Ns) -> int:
    return (ns if isinstance(ns, int) else xxh3_64_intdigest(ns.encode())) & _MASK64


def fingerprints(ns: Ns, keys: Sequence[BlockKey]) -> list[int]:
    """XXH3-64 of each key seeded by the namespace: the sketch slot (``h % size``) and the mini
    simulations' sample (``h >> 56``) both come from it, so a key is hashed once."""
    seed = _seed(ns)
    return [xxh3_64_intdigest(k, seed) for k in keys]


class FrequencySketch:
    """Saturating per-slot reference counts with periodic halving (module docstring)."""

    __slots__ = ("_adds", "_counts", "_period", "size")

    def __init__(self, size: int) -> None:
        self.size = max(64, size)
        self._counts = bytearray(self.size)
        self._period = 10 * self.size
        self._adds = 0

    def add(self, ns: Ns, keys: Sequence[BlockKey]) -> list[int]:
        """Count one reference of each key; returns each key's count, this one included."""
        return self.add_hashed(fingerprints(ns, keys))

    def add_hashed(self, fps: Sequence[int]) -> list[int]:
        """`add` for keys already fingerprinted (`fingerprints`)."""
        counts, size = self._counts, self.size
        out = []
        for h in fps:
            i = h % size
            c = counts[i]
            if c < _COUNT_MAX:
                counts[i] = c = c + 1
            out.append(c)
        self._adds += len(fps)
        if self._adds >= self._period:
            self._adds = 0
            self._counts = bytearray(counts.translate(_HALVE))
        return out

    def count(self, ns: Ns, key: BlockKey) -> int:
        return self._counts[xxh3_64_intdigest(key, _seed(ns)) % self.size]

    def nbytes(self) -> int:
        return self.size


class ReusePredictor:
    """Per-namespace (reused, stored) counts per bucket; see the module docstring."""

    __slots__ = ("_tables",)

    def __init__(self) -> None:
        self._tables: dict[Ns, tuple[array[int], array[int], list[int]]] = {}

    def table(self, ns: Ns) -> tuple[array[int], array[int], list[int]]:
        """(reused, stored, [reused, stored] overall) of a namespace, created on first use."""
        t = self._tables.get(ns)
        if t is None:
            t = self._tables[ns] = (array("I", bytes(4 * BUCKETS)),
                                        array("I", bytes(4 * BUCKETS)), [1, 2])
        return t

    def learn(self, ns: Ns, b: int, was_reused: bool) -> None:
        reused, stored, total = self.table(ns)
        stored[b] += 1
        total[1] += 1
        if was_reused:
            reused[b] += 1
            total[0] += 1
        if stored[b] >= _HALVE_AT:
            stored[b] >>= 1
            reused[b] >>= 1
        if total[1] >= _HALVE_AT * 16:
            total[0] = (total[0] >> 1) + 1
            total[1] = (total[1] >> 1) + 2

    def nbytes(self) -> int:
        return len(self._tables) * (8 * BUCKETS + 64)
