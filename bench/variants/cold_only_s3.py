"""Cold placement only while the queue is in S3-FIFO order (share < 1): in LRU order a block the
predictor calls unlikely enters at the hot end like any other."""

from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.types import Block

_inserted = pa.AdaptivePolicy.inserted


def inserted(self: pa.AdaptivePolicy, b: Block) -> None:
    _inserted(self, b)
    q = self.dram
    if isinstance(q, pa.AdaptiveQueue) and q.share >= 1.0 and q.cold_next is b:
        q.cold_next = None


pa.AdaptivePolicy.inserted = inserted  # type: ignore[method-assign]
