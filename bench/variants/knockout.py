"""kvtier's mechanisms switched off (issue 29, item 1; issue 42, item 1), by OFF = one of (or
several, comma-separated):

- ``predictor``: no cold placement and no tail bypass (``lo`` = ``bypass`` = -1);
- ``bypass``: no tail bypass only; ``cold``: no cold placement only;
- ``hot``: no top-frequency entry for blocks hit while inner (`HOT_HITS` out of reach);
- ``filter`` / ``lfu``: the reuse-filter / LFU candidate left out of the mini simulations;
- ``choice-s3`` / ``choice-lru`` / ``choice-filter`` / ``choice-lfu``: the mini simulations'
  choice replaced by one fixed mode (probation share 0.1 / LRU / LRU behind the reuse
  filter / LFU) from the start.

The knock-outs of the policy before it started in exact LRU (``start-lru``: the queue starts in
LRU mode; ``exact-lru``: its LRU mode orders blocks as ``lru`` does) are this file at commit
577096c (docs/benchmarks.md, "Policies, eighth pass").
"""

import os

from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.policies.adaptive import queue as aq
from kvtier.index.policies.adaptive.minisim import FILTER, LFU

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
                         f"{', '.join(_FIXED)}")


for _off in os.environ.get("OFF", "predictor").split(","):
    knock_out(_off)
