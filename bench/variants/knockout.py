"""One of kvtier's mechanisms switched off (issue 29, item 1), by OFF = one of:

- ``predictor``: no cold placement and no tail bypass (``lo`` = ``bypass`` = -1);
- ``bypass``: no tail bypass only; ``cold``: no cold placement only;
- ``hot``: no top-frequency entry for blocks hit while inner (`HOT_HITS` out of reach);
- ``choice-s3`` / ``choice-lru`` / ``choice-filter`` / ``choice-lfu``: the mini simulations'
  choice replaced by one fixed mode (probation share 0.1 / plain LRU / LRU behind the reuse
  filter / LFU) from the start.
"""

import os

from kvtier.index import policy_adaptive as pa
from kvtier.index.policy_minisim import FILTER, LFU

OFF = os.environ.get("OFF", "predictor")
_FIXED = {"choice-s3": 0.1, "choice-lru": 1.0, "choice-filter": FILTER, "choice-lfu": LFU}

if OFF == "predictor":
    pa.AdaptivePolicy.lo = pa.AdaptivePolicy.bypass = -1.0
elif OFF == "bypass":
    pa.AdaptivePolicy.bypass = -1.0
elif OFF == "cold":
    pa.AdaptivePolicy.lo = -1.0
elif OFF == "hot":
    pa.HOT_HITS = 1 << 30
elif OFF in _FIXED:
    share = _FIXED[OFF]

    def feed(self: pa.AdaptivePolicy, sampled: list[bytes], placed: dict[bytes, int] | None,
             real_hits: int) -> None:
        self.minisims.feed(sampled, placed, real_hits)
        q = self.dram
        assert isinstance(q, pa.AdaptiveQueue)
        q.set_share(share)

    def make_queue(self: pa.AdaptivePolicy, capacity: int | None) -> pa.EvictionQueue:
        q = pa.AdaptiveQueue(0.1)
        q.set_share(share)
        return q

    pa.AdaptivePolicy._feed = feed  # type: ignore[method-assign]
    pa.AdaptivePolicy.make_queue = make_queue  # type: ignore[method-assign]
else:
    raise SystemExit(f"OFF={OFF!r}: one of predictor, bypass, cold, hot, {', '.join(_FIXED)}")
