"""kvtier's mechanisms switched off (issue 29, item 1; issue 42, item 1), by OFF = one of (or
several, comma-separated):

- ``predictor``: no cold placement and no tail bypass (``lo`` = ``bypass`` = -1);
- ``bypass``: no tail bypass only; ``cold``: no cold placement only;
- ``hot``: no top-frequency entry for blocks hit while inner (`HOT_HITS` out of reach);
- ``filter`` / ``lfu``: the reuse-filter / LFU candidate left out of the mini simulations;
- ``start-lru``: the mini simulations' choice kept, but the queue starts in LRU mode (not in the
  probation mode);
- ``exact-lru``: the LRU and filter modes order every block as the ``lru`` policy does (one
  list; a ghost hit is not set apart, main is merged into it by recency at the switch);
- ``choice-s3`` / ``choice-lru`` / ``choice-filter`` / ``choice-lfu``: the mini simulations'
  choice replaced by one fixed mode (probation share 0.1 / LRU / LRU behind the reuse
  filter / LFU) from the start.
"""

import os

from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.policies.adaptive import queue as aq
from kvtier.index.policies.adaptive.minisim import FILTER, LFU
from kvtier.index.policies.base import PROTECTED, BlockList
from kvtier.index.types import HITS_BITS, Block

_FIXED = {"choice-s3": 0.1, "choice-lru": 1.0, "choice-filter": FILTER, "choice-lfu": LFU}


def knock_out(off: str) -> None:
    if off == "predictor":
        pa.AdaptivePolicy.lo = pa.AdaptivePolicy.bypass = -1.0
    elif off == "bypass":
        pa.AdaptivePolicy.bypass = -1.0
    elif off == "cold":
        pa.AdaptivePolicy.lo = -1.0
    elif off == "hot":
        aq.HOT_HITS = 1 << 30
    elif off == "filter":
        pa.SHARES = (0.1, 1.0, LFU)
    elif off == "lfu":
        pa.SHARES = (0.1, 1.0, FILTER)
    elif off == "start-lru":
        _init = pa.AdaptivePolicy.__init__

        def init(self: pa.AdaptivePolicy, dram: int | None, ssd: int | None, k: int) -> None:
            _init(self, dram, ssd, k)
            if not self._front:
                q = self.dram
                assert isinstance(q, pa.AdaptiveQueue)
                q.share = self.minisims.best = 1.0

        pa.AdaptivePolicy.__init__ = init  # type: ignore[method-assign]
    elif off == "exact-lru":
        _set, _push = pa.AdaptiveQueue.set_share, pa.AdaptiveQueue.push

        def set_share(self: pa.AdaptiveQueue, share: float) -> None:
            if (share >= 1.0 and share != LFU and self._f is None and self.lru_main
                    and self._m.size):
                blocks = sorted([*self._s, *self._m], key=lambda b: b.stamp >> HITS_BITS)
                self._s, self._m = BlockList(), BlockList()
                for b in blocks:
                    b.flags &= ~PROTECTED
                    self._s.append(b)
            _set(self, share)

        def push(self: pa.AdaptiveQueue, b: Block, cold: bool = False) -> None:
            if self.share >= 1.0 and self.lru_main and self._f is None:
                b.flags &= ~PROTECTED
            _push(self, b, cold)

        pa.AdaptiveQueue.set_share = set_share  # type: ignore[method-assign]
        pa.AdaptiveQueue.push = push  # type: ignore[method-assign]
    elif off in _FIXED:
        share = _FIXED[off]

        def feed(self: pa.AdaptivePolicy, sampled: list[bytes], placed: dict[bytes, int] | None,
                 real_hits: int) -> None:
            self.minisims.feed(sampled, placed, real_hits)
            q = self.dram
            assert isinstance(q, pa.AdaptiveQueue)
            q.set_share(share)

        def make_queue(self: pa.AdaptivePolicy, capacity: int | None) -> pa.EvictionQueue:
            q = pa.AdaptiveQueue(0.1, lru_main=True)
            q.set_share(share)
            return q

        pa.AdaptivePolicy._feed = feed  # type: ignore[method-assign]
        pa.AdaptivePolicy.make_queue = make_queue  # type: ignore[method-assign]
    else:
        raise SystemExit(f"OFF={off!r}: one of predictor, bypass, cold, hot, filter, lfu, "
                         f"start-lru, exact-lru, {', '.join(_FIXED)}")


for _off in os.environ.get("OFF", "predictor").split(","):
    knock_out(_off)
