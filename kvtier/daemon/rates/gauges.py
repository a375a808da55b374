"""The planner's rate estimates as Prometheus gauges, read from a `RateBook` at scrape time
(`kvtier_rate_*`), so they can never drift from what the planner prices with."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.daemon.rates.book import Link, RateBook


class RateCollector(Collector):
    """The planner's current estimates: the windowed median of samples, else the seed
    (calibration or defaults); `*_samples` says which (0 = seed)."""

    def __init__(self, book: RateBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        book = self._book
        snap = book.export()
        labels = ["tier", "direction"]
        bw = GaugeMetricFamily("kvtier_rate_bandwidth_bytes_per_second",
                               "Planner's bandwidth estimate per tier and direction", labels=labels)
        lat = GaugeMetricFamily("kvtier_rate_latency_seconds",
                                "Planner's fixed per-request latency estimate", labels=labels)
        n = GaugeMetricFamily("kvtier_rate_samples",
                              "Bandwidth samples in the estimate's window (0: seeded value)",
                              labels=labels)
        for link in Link:
            tier_dir = [link.tier, link.direction]
            bw.add_metric(tier_dir, snap[f"{link}_bytes_per_s"])
            lat.add_metric(tier_dir, snap[f"{link}_latency_seconds"])
            n.add_metric(tier_dir, book.samples(link))
        yield from (bw, lat, n)
        yield GaugeMetricFamily("kvtier_rate_prefill_flops_per_second",
                                "Planner's achieved prefill FLOP-rate estimate (one GPU)",
                                value=snap["prefill_flops_per_s"])
        yield GaugeMetricFamily("kvtier_rate_prefill_samples",
                                "Prefill samples in the estimate's window (0: seeded value)",
                                value=book.samples(None))
        yield CounterMetricFamily(
            "kvtier_rate_samples_rejected",
            "Rate samples refused as impossible (non-positive, NaN, too high)",
            value=snap["rejected_total"])
        yield CounterMetricFamily(
            "kvtier_rate_samples_skipped",
            "Whole-request samples too short to say anything about bandwidth",
            value=snap["skipped_total"])
