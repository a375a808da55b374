"""RateBook: seeds, windowed medians, outlier robustness, rejection of nonsense, thread safety."""

import math
import threading

import pytest

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates
from kvtier.daemon.rates.book import (
    DEFAULT_LINKS,
    DEFAULT_PREFILL_FLOPS_PER_S,
    Link,
    LinkRate,
    RateBook,
)


def test_defaults_come_from_design_physics():
    book = RateBook()
    assert book.snapshot() == PlanRates(48e9, 200e-6, 6.9e9, 300e-6, 0.6 * 989e12)
    assert abs(DEFAULT_PREFILL_FLOPS_PER_S - 5.934e14) < 1e11
    assert set(DEFAULT_LINKS) == set(Link)


def test_seed_then_measured_median_with_latency_subtracted():
    book = RateBook({Link.DRAM_READ: LinkRate(10e9, 1e-3)}, prefill_flops_per_s=1e14)
    assert book.bandwidth(Link.DRAM_READ) == 10e9
    # a whole request: 1 GB in 1.001 s with 1 ms latency → 1e9 / 1.0 = 1 GB/s exactly
    assert book.observe_transfer(Link.DRAM_READ, 1e9, 1.001, includes_latency=True)
    assert book.bandwidth(Link.DRAM_READ) == pytest.approx(1e9)
    assert book.prefill_flops_per_s() == 1e14
    # unmeasured links keep their seeds
    assert book.bandwidth(Link.SSD_READ) == DEFAULT_LINKS[Link.SSD_READ].bytes_per_s


def test_median_ignores_a_minority_of_outliers_but_follows_a_lasting_change():
    book = RateBook({Link.SSD_READ: LinkRate(5e9, 0.0)}, window=9)
    for _ in range(5):
        book.observe_transfer(Link.SSD_READ, 2e9, 1.0)  # 2 GB/s
    book.observe_transfer(Link.SSD_READ, 2e9, 0.01)  # page-cache hit: 200 GB/s
    book.observe_transfer(Link.SSD_READ, 2e9, 100.0)  # stalled: 20 MB/s
    assert book.bandwidth(Link.SSD_READ) == 2e9
    for _ in range(9):  # the drive gets busy: 0.5 GB/s from now on
        book.observe_transfer(Link.SSD_READ, 1e9, 2.0)
    assert book.bandwidth(Link.SSD_READ) == 0.5e9
    assert book.samples(Link.SSD_READ) == 9


@pytest.mark.parametrize(
    ("nbytes", "seconds"),
    [(0, 1.0), (-5, 1.0), (1e6, 0.0), (1e6, -1.0), (math.nan, 1.0), (1e6, math.inf),
     (math.inf, 1.0), (1e15, 1e-3), ("12", 1.0), (None, 1.0)],
)
def test_nonsense_transfer_samples_are_rejected_and_change_nothing(nbytes, seconds):
    book = RateBook()
    before = book.snapshot()
    assert book.observe_transfer(Link.DRAM_READ, nbytes, seconds) is False
    assert book.snapshot() == before
    assert book.rejected == 1


def test_latency_dominated_samples_are_skipped():
    book = RateBook({Link.DRAM_READ: LinkRate(10e9, 1e-3)})
    # 4 KiB in 1.5 ms with 1 ms latency: at most twice the latency → not a bandwidth sample
    assert book.observe_transfer(Link.DRAM_READ, 4096, 1.5e-3, includes_latency=True) is False
    assert (book.skipped, book.rejected) == (1, 0)
    assert book.bandwidth(Link.DRAM_READ) == 10e9
    # timed around the copy alone (the default), the same sample is pure bandwidth: 4096/1.5e-3
    assert book.observe_transfer(Link.DRAM_READ, 4096, 1.5e-3)
    assert book.bandwidth(Link.DRAM_READ) == pytest.approx(4096 / 1.5e-3)


def test_latency_observations_replace_the_seed():
    book = RateBook()
    for s in (1e-4, 2e-4, 9.0):
        assert book.observe_latency(Link.SSD_READ, s)
    assert book.latency(Link.SSD_READ) == 2e-4
    assert not book.observe_latency(Link.SSD_READ, -1.0)
    assert not book.observe_latency(Link.SSD_READ, math.nan)
    assert not book.observe_latency(Link.SSD_READ, 3600.0)


def test_prefill_rate_from_tokens_through_the_cost_model():
    cm = CostModel.dense("toy", active_params=1e9, layers=2, attn_dim=1000)
    book = RateBook()
    # 4 tokens after 4 cached: 4·2e9 + 26 pairs·8000 = 8,000,208,000 FLOPs in 0.001 s
    assert book.observe_prefill_tokens(cm, 4, 4, 1e-3)
    assert book.prefill_flops_per_s() == pytest.approx(8_000_208_000 / 1e-3)
    assert not book.observe_prefill_tokens(cm, 4, 0, 1e-3)
    assert not book.observe_prefill_tokens(cm, -1, 4, 1e-3)
    assert not book.observe_prefill(1e9, math.nan)
    assert not book.observe_prefill(1e30, 1.0)  # 1e30 FLOP/s: no such GPU
    assert book.samples() == 1


def test_invalid_seeds_raise():
    with pytest.raises(ValueError):
        RateBook({Link.DRAM_READ: LinkRate(0.0, 0.0)})
    with pytest.raises(ValueError):
        RateBook({Link.DRAM_READ: LinkRate(1e9, math.nan)})
    with pytest.raises(ValueError):
        RateBook(prefill_flops_per_s=math.inf)
    with pytest.raises(ValueError):
        RateBook(window=0)


def test_export_has_every_link_and_labels():
    out = RateBook().export()
    assert out["ssd_read_bytes_per_s"] == 6.9e9
    assert out["dram_write_latency_seconds"] == 200e-6
    assert out["rejected_total"] == 0
    assert {(x.tier, x.direction) for x in Link} == {
        ("dram", "read"), ("dram", "write"), ("ssd", "read"), ("ssd", "write"),
        ("remote", "read"), ("remote", "write"),
    }


def test_concurrent_observers_and_readers():
    book = RateBook({Link.DRAM_READ: LinkRate(1e9, 0.0)}, window=64)
    errors = []

    def writer(bw):
        for _ in range(2000):
            book.observe_transfer(Link.DRAM_READ, bw, 1.0)
            book.observe_prefill(bw * 1e3, 1.0)

    def reader():
        for _ in range(2000):
            r = book.snapshot()
            if r.h2d_bytes_per_s not in (1e9, 2e9, 3e9, 2.5e9, 1.5e9):
                errors.append(r)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (2e9, 3e9)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert book.samples(Link.DRAM_READ) == 64
    assert book.samples() == 64
