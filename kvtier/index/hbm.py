"""HBM residency reported by engine replicas: one bit per replica in each stored entry's mask.

The index never evicts HBM and HBM never keeps an entry alive: a report about a block that is not
cached is ignored, and an entry that leaves its last managed tier takes its mask with it. Replica
names map to the lowest free bit; `drop_replica` frees the bit for the next new replica.
Contract in `kvtier.index.prefix`.
"""

from __future__ import annotations

from kvtier.core.types import BlockKey
from kvtier.index.state import IndexState
from kvtier.index.types import Block, NsT


class HbmReports(IndexState[NsT]):
    """`hbm_add`, `hbm_drop` and `drop_replica` over an `IndexState`."""

    def hbm_add(self, replica: str | int, ns: NsT, key: BlockKey) -> bool:
        """Replica reports holding the block in HBM. False (ignored) if the block is not cached."""
        b = self.get(ns, key)
        if b is None:
            return False
        bit = self._replicas.get(replica)
        if bit is None:
            used = set(self._replicas.values())
            bit = self._replicas[replica] = next(i for i in range(len(used) + 1) if i not in used)
        if not b.hbm:
            self._hbm_blocks += 1
        b.hbm |= 1 << bit
        return True

    def hbm_drop(self, replica: str | int, ns: NsT, key: BlockKey) -> bool:
        b = self.get(ns, key)
        bit = self._replicas.get(replica)
        if b is None or bit is None or not b.hbm >> bit & 1:
            return False
        self._clear_hbm(b, bit)
        return True

    def drop_replica(self, replica: str | int) -> int:
        """Forget a replica (it restarted or left): O(entries), not for the hot path."""
        bit = self._replicas.pop(replica, None)
        if bit is None:
            return 0
        held = [b for b in self.iter_blocks() if b.hbm >> bit & 1]
        for b in held:
            self._clear_hbm(b, bit)
        return len(held)

    def _clear_hbm(self, b: Block[NsT], bit: int) -> None:
        b.hbm &= ~(1 << bit)
        if not b.hbm:
            self._hbm_blocks -= 1
