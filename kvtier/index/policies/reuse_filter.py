"""``vllm-reuse``: vLLM ``kv_offload/reuse_manager.py`` ``FilterReusedOffloadingManager`` over LRU.

Every lookup counts each key of the request in an LRU table of 64,000 keys; a block is stored only
once its key was counted ``store_threshold`` = 2 times.

Like every peer here it orders only the blocks that may leave a tier now (leaves, or blocks with
an SSD copy; see `kvtier.index.state`), so it runs with the index's invariants: no stranded block,
SSD prefix-closed, pins respected. Read from the peer's code, not copied.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.types import BlockKey
from kvtier.index.policies.base import Policy

if TYPE_CHECKING:
    from kvtier.index.types import Block, Ns


class ReuseFilterPolicy(Policy):
    """LRU that stores a block only once its key was looked up `threshold` times (vLLM)."""

    name = "vllm-reuse"
    hooks = True
    threshold = 2
    tracker_size = 64_000

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        self.counts: OrderedDict[tuple[Ns, BlockKey], int] = OrderedDict()

    def looked_up(self, ns: Ns, keys: Sequence[BlockKey], blocks: list[Block[Any]]) -> None:
        counts = self.counts
        for key in keys:
            tk = (ns, key)
            n = counts.get(tk)
            if n is None:
                if len(counts) >= self.tracker_size:
                    counts.popitem(last=False)
                counts[tk] = 1
            else:
                counts.move_to_end(tk)
                counts[tk] = n + 1

    def admit(self, ns: Ns, keys: Sequence[BlockKey], start: int, parent: Block[Any] | None,
              partial_last: bool) -> int:
        counts, need = self.counts, self.threshold
        n = start
        while n < len(keys) and counts.get((ns, keys[n]), 0) >= need:
            n += 1
        return n - start
