"""The real cache's own hits calibrate the mini simulations: per epoch, the sampled keys' hits in
the real cache / the current order's mini hits is that order's calibration (an EMA with weight
EMA, default 0.5; the first measurement seeds every order's); the order with the most calibrated
mini hits (x margin) is chosen. So the prefix rule, the cold placement and the switching cost,
which the mini caches do not model, enter the choice through the order that was really run."""

import os
from collections.abc import Mapping, Sequence

from kvtier.index.policies.adaptive import minisim as pm
from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.types import Block, Tenant

EMA = float(os.environ.get("EMA", "0.5"))


class CalibratedSims(pm.MiniSims):
    __slots__ = ("bias", "epoch_hits", "real")

    def __init__(self, capacity: int, shares: Sequence[float], start: float) -> None:
        super().__init__(capacity, shares, start)
        self.real = 0
        self.bias: dict[float, float | None] = {c.share: None for c in self.caches}
        self.epoch_hits = {c.share: 0.0 for c in self.caches}

    def feed(self, keys: Sequence[bytes], placed: Mapping[bytes, int] | None = None,
             real_hits: int | None = None) -> None:
        caches = self.caches
        for c in caches:
            h0 = c.hits
            c.access(keys, placed)
            self.epoch_hits[c.share] += c.hits - h0
        self._seen += len(keys)
        if self._seen < self._epoch:
            return
        self._seen = 0
        mine = self.epoch_hits[self.best]
        if mine > 0:
            r = self.real / mine
            old = self.bias[self.best]
            if old is None:
                for k, v in self.bias.items():
                    if v is None:
                        self.bias[k] = r
            else:
                self.bias[self.best] = (1 - EMA) * old + EMA * r
        score = {c.share: c.hits * (self.bias[c.share] or 1.0) for c in caches}
        top = max(score, key=lambda s: score[s])
        if top != self.best and score[top] > score[self.best] * self.margin:
            self.best = top
        self.real = 0
        for c in caches:
            c.hits *= 0.5
            self.epoch_hits[c.share] = 0.0


def looked_up(self: pa.AdaptivePolicy, tenant: Tenant, keys: Sequence[bytes],
              blocks: list[Block]) -> None:
    if not blocks or self._front:
        return
    sampled = [b.key for b in blocks if b.flags & pa.SAMPLED]
    if sampled:
        ms = self.minisims
        if isinstance(ms, CalibratedSims):
            ms.real += len(sampled)
        self._feed(sampled, None, 0)


pa.MiniSims = CalibratedSims  # type: ignore[misc]
pa.AdaptivePolicy.looked_up = looked_up  # type: ignore[method-assign]
