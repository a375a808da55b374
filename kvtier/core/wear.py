"""SSD write budget from drive endurance, enforced as a token bucket. Pure: the clock is injected.

A drive rated for D drive-writes-per-day (DWPD) of size S bytes absorbs S·D bytes a day over its
warranty; a drive rated by TBW (terabytes written) over Y warranty years absorbs TBW / (365·Y) a
day. The cache may use a `share` of that (the rest is the system's). Write-backs take tokens
(bytes); a write-back that finds too few tokens is dropped (the block stays recomputable), so a
cache cannot wear the drive out early whatever the workload.

Thread safety: none; the mover calls it from the thread that submits write-backs, under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.core.errors import UsageError

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class Endurance:
    """A drive's rated endurance: give `dwpd` or (`tbw_bytes` and `warranty_years`)."""

    drive_bytes: int
    dwpd: float | None = None
    tbw_bytes: float | None = None
    warranty_years: float = 5.0
    share: float = 1.0

    def bytes_per_day(self) -> float:
        if not 0.0 < self.share <= 1.0:
            raise UsageError(f"endurance share must be in (0, 1], got {self.share}")
        if self.dwpd is not None:
            if self.dwpd <= 0 or self.drive_bytes <= 0:
                raise UsageError("dwpd and drive size must be positive")
            return self.drive_bytes * self.dwpd * self.share
        if self.tbw_bytes is not None:
            if self.tbw_bytes <= 0 or self.warranty_years <= 0:
                raise UsageError("tbw and warranty years must be positive")
            return self.tbw_bytes / (365.0 * self.warranty_years) * self.share
        raise UsageError("endurance needs dwpd or tbw")


class BudgetStats(NamedTuple):
    rate_bytes_per_s: float
    burst_bytes: float
    available_bytes: float
    granted_bytes: int
    denied_bytes: int
    denied_total: int


class TokenBucket:
    """Tokens accrue at `rate` per second up to `burst`; `take(n)` is all-or-nothing.

    A request larger than `burst` can never succeed, so `burst` must cover the largest write-back
    (a block); the bucket starts full.
    """

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate < 0 or burst <= 0:
            raise UsageError(f"token bucket needs rate >= 0 and burst > 0 (got {rate}, {burst})")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def available(self) -> float:
        self._refill()
        return self._tokens

    def take(self, n: int) -> bool:
        self._refill()
        if n <= self._tokens:
            self._tokens -= n
            return True
        return False

    def refund(self, n: int) -> None:
        """Give back tokens for bytes that were granted but not written."""
        self._tokens = min(self.burst, self._tokens + n)

    def retune(self, rate: float, burst: float) -> None:
        """New rate and size from now on (a live reload); the tokens held stay, up to `burst`."""
        if rate < 0 or burst <= 0:
            raise UsageError(f"token bucket needs rate >= 0 and burst > 0 (got {rate}, {burst})")
        self._refill()
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = min(self._tokens, self.burst)


class WriteBudget:
    """Token bucket of `bytes_per_day` (see `Endurance.bytes_per_day`) with counters."""

    def __init__(
        self,
        bytes_per_day: float,
        burst_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bytes_per_day = float(bytes_per_day)
        self._bucket = TokenBucket(self.bytes_per_day / SECONDS_PER_DAY, burst_bytes, clock)
        self.granted_bytes = 0
        self.denied_bytes = 0
        self.denied_total = 0

    @classmethod
    def unlimited(cls) -> WriteBudget:
        """A budget that never denies (for tests and for drives without a wear concern)."""
        return cls(float(1 << 80), burst_bytes=1 << 62)

    @classmethod
    def from_endurance(
        cls, endurance: Endurance, burst_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> WriteBudget:
        return cls(endurance.bytes_per_day(), burst_bytes, clock)

    def try_spend(self, nbytes: int) -> bool:
        if self._bucket.take(nbytes):
            self.granted_bytes += nbytes
            return True
        self.denied_bytes += nbytes
        self.denied_total += 1
        return False

    def refund(self, nbytes: int) -> None:
        self._bucket.refund(nbytes)
        self.granted_bytes -= nbytes

    def retune(self, bytes_per_day: float, burst_bytes: int) -> None:
        """A new daily rate and burst from now on (SIGHUP); counters and held tokens stay."""
        self._bucket.retune(float(bytes_per_day) / SECONDS_PER_DAY, burst_bytes)
        self.bytes_per_day = float(bytes_per_day)

    def stats(self) -> BudgetStats:
        return BudgetStats(
            self._bucket.rate,
            self._bucket.burst,
            self._bucket.available(),
            self.granted_bytes,
            self.denied_bytes,
            self.denied_total,
        )
