"""``sglang-hicache``: SGLang HiCache ``write_through_selective`` over LRU eviction.

``hiradix_cache.py`` ``_inc_hit_count``: a node is backed up to host memory once ``hit_count >=
write_through_threshold`` = 2. Our DRAM is the host tier, so a block is stored on its 2nd
reference; references of blocks not stored are counted in a direct-mapped table of one word per
block of capacity (the engine's GPU radix tree counts them in SGLang).

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.types import BlockKey
from kvtier.index.history import HISTORY_MAX_WORDS, AdmissionHistory
from kvtier.index.policies.base import Policy

if TYPE_CHECKING:
    from kvtier.index.types import Block, Ns


class HiCachePolicy(Policy):
    """LRU that stores a block on its `threshold`-th reference (SGLang HiCache selective
    write-through); references of blocks not stored are counted in a direct-mapped table."""

    name = "sglang-hicache"
    hooks = True
    threshold = 2

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        self.seen = AdmissionHistory(
            max(1, min(HISTORY_MAX_WORDS, (dram_blocks or 0) + (ssd_blocks or 0))))

    def admit(self, ns: Ns, keys: Sequence[BlockKey], start: int, parent: Block[Any] | None,
              partial_last: bool) -> int:
        seen, need = self.seen, self.threshold
        n = start
        while n < len(keys):
            refs = seen.recall(ns, keys[n]) + 1
            if refs < need:
                seen.remember(ns, keys[n], refs)
                for key in keys[n + 1:]:  # the rest is referenced too, just not storable now
                    seen.remember(ns, key, seen.recall(ns, key) + 1)
                break
            n += 1
        return n - start
