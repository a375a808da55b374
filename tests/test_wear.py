"""Wear budget: endurance arithmetic and the token bucket, with an injected clock."""

from __future__ import annotations

import pytest

from kvtier.core.errors import UsageError
from kvtier.core.wear import Endurance, TokenBucket, WriteBudget

TB = 10**12


def test_dwpd_bytes_per_day() -> None:
    # 3.84 TB drive at 1 DWPD, half of it for the cache: 3.84e12 * 1 * 0.5 = 1.92e12 bytes/day
    assert Endurance(drive_bytes=3_840 * 10**9, dwpd=1.0, share=0.5).bytes_per_day() == 1.92e12


def test_tbw_bytes_per_day() -> None:
    # 7008 TBW over 5 years: 7008e12 / (365 * 5) = 3.84e12 bytes/day
    e = Endurance(drive_bytes=3_840 * 10**9, tbw_bytes=7008 * TB, warranty_years=5)
    assert e.bytes_per_day() == pytest.approx(3.84e12)


@pytest.mark.parametrize(
    "bad",
    [
        Endurance(drive_bytes=10**12),
        Endurance(drive_bytes=10**12, dwpd=0.0),
        Endurance(drive_bytes=10**12, dwpd=1.0, share=0.0),
        Endurance(drive_bytes=10**12, tbw_bytes=TB, warranty_years=0),
    ],
)
def test_bad_endurance_is_usage_error(bad: Endurance) -> None:
    with pytest.raises(UsageError):
        bad.bytes_per_day()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_burst_then_rate() -> None:
    clock = Clock()
    b = TokenBucket(rate=1000.0, burst=5000.0, clock=clock)
    assert b.take(5000)  # starts full
    assert not b.take(1)
    clock.t += 2.0  # 2 s * 1000 B/s = 2000 tokens
    assert not b.take(2001)  # all-or-nothing: a denied take removes nothing
    assert b.take(2000)
    clock.t += 100.0  # refill caps at burst
    assert b.available() == 5000.0
    assert not b.take(5001)  # larger than burst: never


def test_budget_counts_and_refunds() -> None:
    clock = Clock()
    # 86_400_000 bytes/day = 1000 bytes/s
    w = WriteBudget(86_400_000, burst_bytes=3000, clock=clock)
    assert w.try_spend(2000) and not w.try_spend(2000)
    assert (w.granted_bytes, w.denied_bytes, w.denied_total) == (2000, 2000, 1)
    w.refund(2000)
    assert w.try_spend(3000)
    clock.t += 1.5
    s = w.stats()
    assert s.rate_bytes_per_s == 1000.0 and s.available_bytes == 1500.0


def test_budget_limits_a_day_of_writes() -> None:
    clock = Clock()
    day = 86_400.0
    w = WriteBudget.from_endurance(Endurance(drive_bytes=10**9, dwpd=1.0), 10**7, clock)
    written = 0
    for _ in range(100_000):
        clock.t += day / 100_000
        if w.try_spend(2 << 20):
            written += 2 << 20
    # one day: at most burst + 1 drive write = 1e7 + 1e9 bytes
    assert 10**9 - (2 << 20) <= written <= 10**9 + 10**7


def test_bad_bucket() -> None:
    with pytest.raises(UsageError):
        TokenBucket(rate=-1, burst=10)
