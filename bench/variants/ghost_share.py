"""ARC's own adaptation from the real cache's ghosts: a reinserted block the admission history
remembered with fewer than SPLIT (default 3) accesses (it left from probation) raises the
probation share by 1/capacity, one with more lowers it (share in [0.1, TOP = 0.95]; at TOP the
queue is in LRU order). MODE=arc: the ghosts alone set the share; MODE=hybrid: the mini
simulations still choose LRU order, the ghosts set the share of S3-FIFO order."""

import os

from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.types import HITS_MAX, Block

MODE = os.environ.get("MODE", "arc")
SPLIT = int(os.environ.get("SPLIT", "3"))
TOP = 0.95
_init, _inserted = pa.AdaptivePolicy.__init__, pa.AdaptivePolicy.inserted


def init(self: pa.AdaptivePolicy, dram: int | None, ssd: int | None, k: int) -> None:
    _init(self, dram, ssd, k)
    self.__dict__["variant_cap"] = max(1, dram or 1)
    self.__dict__["variant_p"] = 0.1


def _queue(self: pa.AdaptivePolicy) -> pa.AdaptiveQueue:
    q = self.dram
    assert isinstance(q, pa.AdaptiveQueue)
    return q


def feed(self: pa.AdaptivePolicy, sampled: list[bytes], placed: dict[bytes, int] | None,
         real_hits: int) -> None:
    self.minisims.feed(sampled, placed, real_hits)
    if MODE == "hybrid":
        _queue(self).share = 1.0 if self.minisims.best >= 1.0 else self.__dict__["variant_p"]


def inserted(self: pa.AdaptivePolicy, b: Block) -> None:
    h = b.stamp & HITS_MAX
    if h > 1 and not self._front:
        cap, p = self.__dict__["variant_cap"], self.__dict__["variant_p"]
        p = min(TOP, p + 1 / cap) if h - 1 < SPLIT else max(0.1, p - 1 / cap)
        self.__dict__["variant_p"] = p
        if MODE == "arc":
            _queue(self).share = 1.0 if p >= TOP else p
        elif self.minisims.best < 1.0:
            _queue(self).share = p
    _inserted(self, b)


pa.AdaptivePolicy.__init__ = init  # type: ignore[method-assign]
pa.AdaptivePolicy.inserted = inserted  # type: ignore[method-assign]
pa.AdaptivePolicy._feed = feed  # type: ignore[method-assign]
