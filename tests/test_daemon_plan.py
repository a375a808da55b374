"""The cache's planner bookkeeping in-process (real shm pool, real LMDB; its calls awaited as the
transports await them): plan decisions by action, the prediction-error histogram on Release and
on SSD promotion, and the rates it learns from."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.costmodel import CostModel
from kvtier.core.keys import layout_id
from kvtier.core.planner import Reason
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.rates.book import Link, LinkRate, RateBook
from tests.cache_calls import run

FINGERPRINT = b"plan-test-layout"
MODEL = "plan-test-model"
LID = layout_id(MODEL, FINGERPRINT)  # what data calls name
BLOCK = 4096
TOKENS = 16
T = Tenant("t")
COST = CostModel.dense("test", 8.0e9, 32, 4096)


def make(tmp: Path, rates: RateBook, slots: int = 8, ssd: str = "0") -> Cache:
    cfg = config.load({
        "socket": str(tmp / "s.sock"), "data_dir": str(tmp / "data"), "slot_bytes": "4KiB",
        "dram_bytes": str(slots * BLOCK), "ssd_bytes": ssd, "metrics": "",
        "ssd_admit_after": "1",
        "writeback_queue_bytes": str(slots * BLOCK),  # tiny pools: the default quarter is 1 slot
    }, {"HOME": str(tmp)})
    cache = Cache(config.cache_spec(cfg), DaemonMetrics(), rates=rates)
    cache.register_layout(T, MODEL, FINGERPRINT, BLOCK, TOKENS, 32, COST)
    return cache


@pytest.fixture
def closing() -> Iterator[list[Cache]]:
    opened: list[Cache] = []
    yield opened
    for c in opened:
        c.close()


def keys(tag: int, n: int) -> bytes:
    return b"".join(bytes([tag, i]) + bytes(30) for i in range(n))


def store(c: Cache, k: bytes) -> None:
    a = run(c.allocate_async(T, LID, k, 32, b"", 0))
    for off in a.offsets:
        c.slot_view(off, BLOCK)[:] = bytes([9]) * BLOCK
    c.commit(T, a.lease_id)


def ratio(c: Cache, link: str) -> tuple[float, float]:
    """(count, sum) of kvtier_plan_fetch_time_ratio{link}."""
    v = c.metrics.value
    return (v("kvtier_plan_fetch_time_ratio_count", link=link),
            v("kvtier_plan_fetch_time_ratio_sum", link=link))


def test_release_observes_realized_over_predicted_copy_time(
    tmp_path: Path, closing: list[Cache]
) -> None:
    c = make(tmp_path, RateBook({Link.DRAM_READ: LinkRate(1e9, 200e-6)}))
    closing.append(c)
    store(c, keys(1, 2))
    first = run(c.acquire_async(T, LID, keys(1, 2), 32, 0))
    second = run(c.acquire_async(T, LID, keys(1, 2), 32, 0))  # also predicted at 1 GB/s
    # predicted copy of 2 x 4096 B at 1e9 B/s = 8.192 us (no latency: Release times the copy
    # alone); the client reports 16.384 us -> ratio 2.0, and the DRAM-read estimate becomes
    # 8192 / 16.384e-6 = 5e8 B/s.
    c.release(T, first.lease_id, 2 * BLOCK, 16.384e-6)
    assert ratio(c, "dram_read") == (1, pytest.approx(2.0))
    assert c.metrics.value("kvtier_plan_fetch_time_ratio_bucket", link="dram_read",
                           le="1.25") == 0
    assert c.metrics.value("kvtier_plan_fetch_time_ratio_bucket", link="dram_read",
                           le="2.0") == 1
    assert c.rates.bandwidth(Link.DRAM_READ) == pytest.approx(5e8)
    # the second lease keeps its Acquire-time prediction (1 GB/s): 8.192 us realized -> 1.0
    c.release(T, second.lease_id, 2 * BLOCK, 8.192e-6)
    assert ratio(c, "dram_read") == (2, pytest.approx(3.0))
    # a new lease is predicted at the learned rate: the median of {5e8, 1e9} = 7.5e8 B/s, so a
    # half-block copy (2048 B) predicted at 2048 / 7.5e8 = 2.7307 us, realized 5.4613 us -> 2.0
    third = run(c.acquire_async(T, LID, keys(1, 2), 32, 0))
    c.release(T, third.lease_id, 2048, 2 * 2048 / 7.5e8)
    assert ratio(c, "dram_read") == (3, pytest.approx(5.0))


def test_release_without_timing_observes_nothing(tmp_path: Path, closing: list[Cache]) -> None:
    c = make(tmp_path, RateBook())
    closing.append(c)
    store(c, keys(1, 1))
    for nbytes, seconds in ((BLOCK, 0.0), (0, 1e-3)):
        got = run(c.acquire_async(T, LID, keys(1, 1), 32, 0))
        c.release(T, got.lease_id, nbytes, seconds)
    assert ratio(c, "dram_read") == (0, 0)
    assert c.rates.samples(Link.DRAM_READ) == 0 and c.rates.export()["rejected_total"] == 0


def test_plan_decisions_are_counted_by_action(tmp_path: Path, closing: list[Cache]) -> None:
    # SSD at 1 kB/s: a 4 KiB block takes 4 s to promote, far beyond its ~0.5 ms of recompute;
    # DRAM at the 48 GB/s default is ~85 ns per block. So the cut lands on the first SSD block.
    c = make(tmp_path, RateBook({Link.SSD_READ: LinkRate(1e3, 300e-6)}), slots=4, ssd="1MiB")
    closing.append(c)
    store(c, keys(1, 2))
    assert c.flush(10)
    store(c, keys(2, 4))  # the pool is full: chain 1 drops to its SSD copies
    assert c.flush(10)
    assert run(c.lookup_async(T, LID, keys(1, 2), 32)).tiers == [Tier.SSD] * 2
    res = run(c.lookup_async(T, LID, keys(2, 2), 32, want_plan=True))
    assert res.plan is not None and res.plan.cut == 2 and res.plan.reason is Reason.FETCH_ALL
    v = c.metrics.value
    assert v("kvtier_plan_decisions_total", action="fetch_dram") == 2
    assert v("kvtier_plans_total", reason="fetch_all") == 1
    saved = res.plan.saved_s
    assert saved > 0 and v("kvtier_plan_saved_prefill_seconds_total") == pytest.approx(saved)
    slow = run(c.lookup_async(T, LID, keys(1, 2), 32, want_plan=True))
    assert slow.plan is not None and slow.plan.cut == 0
    assert slow.plan.reason is Reason.SSD_SLOWER_THAN_RECOMPUTE
    assert slow.plan.promote_in_background == (0, 1)
    assert v("kvtier_plan_decisions_total", action="recompute") == 2
    assert v("kvtier_plan_decisions_total", action="fetch_ssd") == 0
    assert v("kvtier_plans_total", reason="ssd_slower_than_recompute") == 1
    assert v("kvtier_plan_saved_prefill_seconds_total") == pytest.approx(saved)  # +0


def test_promotions_are_timed_into_the_rates_and_the_error_histogram(
    tmp_path: Path, closing: list[Cache]
) -> None:
    c = make(tmp_path, RateBook(), slots=4, ssd="1MiB")
    closing.append(c)
    store(c, keys(1, 3))
    assert c.flush(10)
    store(c, keys(2, 4))
    assert c.flush(10)
    assert run(c.lookup_async(T, LID, keys(1, 3), 32)).tiers == [Tier.SSD] * 3
    assert c.rates.samples(Link.SSD_READ) == 0
    got = run(c.acquire_async(T, LID, keys(1, 3), 32, 0))
    assert got.source_tiers == [Tier.SSD] * 3
    assert c.rates.samples(Link.SSD_READ) == 1  # one timed LMDB read + verify of the batch
    count, total = ratio(c, "ssd_read")
    assert count == 1 and math.isfinite(total) and total > 0
    c.release(T, got.lease_id)
    assert c.leaked_slots() == 0
