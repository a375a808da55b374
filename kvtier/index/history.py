"""Access counts of recently dropped blocks ("ghost" entries), kept by the index.

When an entry leaves its last tier its access count goes to the index's `AdmissionHistory`; an
insert of the same (ns, key) while the history still remembers it starts at that count + 1
(`kvtier.index.prefix`), so SSD admission on the k-th access (`kvtier.index.policies.base.
KthAccess`) still counts a block reused at a distance larger than DRAM, and policies that read
ghosts (`kvtier.index.policies.base.Policy.ghosts`) see a returning block.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from xxhash import xxh3_64_intdigest

if TYPE_CHECKING:
    from kvtier.index.types import Ns

ADMISSION_HISTORY_PER_BLOCK = 1
"""Default admission-history words per block of total capacity (DRAM + SSD); see `PrefixIndex`."""
HISTORY_MAX_WORDS = 1 << 25
"""The most words a default admission history takes (128 MiB), whatever the capacity: a tier of
billions of small blocks (a large SSD) must not size the daemon's memory by its block count."""

_MASK64 = (1 << 64) - 1
_COUNT_MAX = 255


class AdmissionHistory:
    """Access counts of recently dropped blocks ("ghost" entries), for k-th-access admission.

    A direct-mapped table of `size` 32-bit words (4 bytes each, allocated once; size 0 = off).
    `remember` stores a dropped (ns, key) in word ``h % size`` as ``tag << 8 | min(hits,
    255)`` (h = XXH3-64 of the key seeded by the namespace, tag = its top 24 bits), overwriting what
    was there; `recall` of a key whose tag matches returns the count and clears the word. So memory
    is fixed, every operation is O(1) and keeps no key alive; a dropped block is remembered until
    a later drop lands on its word: after m more drops with probability (1 - 1/size)^m ~
    exp(-m/size). A tag collision (2^-24 per recall that finds a word occupied by another key)
    restores a wrong count: it can change an admission decision, never the index's invariants.
    Deterministic across processes and runs (no `hash()`).

    Counters: `entries` = occupied words; `recalled` = counts given back so far.
    """

    __slots__ = ("_words", "entries", "recalled", "size")

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"admission history size must be >= 0, got {size}")
        self.size = size
        self._words = array("I", bytes(4 * size))
        self.entries = 0
        self.recalled = 0

    def slot(self, ns: Ns, key: bytes) -> tuple[int, int]:
        """(word index, tag) of a key; for tests and audits."""
        h = _fingerprint(ns, key)
        return h % self.size, h >> 40

    def remember(self, ns: Ns, key: bytes, hits: int) -> None:
        """A block left the cache after `hits` accesses (>= 1)."""
        if not self.size:
            return
        h = _fingerprint(ns, key)
        i = h % self.size
        words = self._words
        if not words[i]:
            self.entries += 1
        words[i] = (h >> 40) << 8 | (hits if hits < _COUNT_MAX else _COUNT_MAX)

    def recall(self, ns: Ns, key: bytes) -> int:
        """The remembered access count of a dropped key, forgetting it; 0 if not remembered."""
        if not self.entries:
            return 0
        h = _fingerprint(ns, key)
        i = h % self.size
        w = self._words[i]
        if w and w >> 8 == h >> 40:
            self._words[i] = 0
            self.entries -= 1
            self.recalled += 1
            return w & _COUNT_MAX
        return 0

    def nbytes(self) -> int:
        return self._words.itemsize * self.size

    def occupied(self) -> int:
        """Recount of `entries` (O(size), for tests)."""
        return self.size - self._words.count(0)


def _fingerprint(ns: Ns, key: bytes) -> int:
    seed = ns if isinstance(ns, int) else xxh3_64_intdigest(ns.encode())
    return xxh3_64_intdigest(key, seed & _MASK64)
