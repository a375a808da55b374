"""Prometheus metrics of one daemon, on a dedicated registry (never the process-global one).

Names follow DESIGN: `kvtier_*`, base units (`_bytes`, `_seconds`), counters end in `_total`, and
labels are bounded (tier ∈ hbm/dram/ssd, method ∈ the RPC names, code ∈ gRPC status names,
direction/reason/result/action ∈ small fixed sets below) — never a key, tenant token or request id.

Counters and histograms are updated by the cache and the service as things happen; pool gauges
(capacity, usage, blocks, active leases, wear budget) and the planner's rate estimates
(`kvtier_rate_*`, `kvtier.daemon.rates.gauges`) are read at scrape time, so they can never drift
from the truth.

Planner metrics: `kvtier_plan_decisions_total{action}` counts looked-up blocks by what the plan
does with them (`PLAN_ACTIONS`), `kvtier_plans_total{reason}` plans by `planner.Reason`, and
`kvtier_plan_fetch_time_ratio{link}` is the prediction error as realized / predicted time of
the fetch part a lease actually did (1.0 = exact; see `observe_fetch`).

The shell serves the registry over HTTP with the probes (`kvtier.daemon.httpd`). Thread-safe
(prometheus-client's primitives are). Imports no other daemon module: everything records here.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier._version import __version__
from kvtier.core.planner import Plan, Reason
from kvtier.index.mrc import MIN_SAMPLES

DIRECTIONS = ("to_client", "from_client", "promote", "demote")
EVICTION_REASONS = ("capacity", "quota", "checksum", "expired_write", "rekeyed", "operator",
                    "quarantine")
QUARANTINE_TIERS = ("dram", "ssd", "remote")
LEASE_KINDS = ("read", "write")
OPERATOR_ACTIONS = ("evict", "clear", "pin", "unpin", "prefetch", "pin_hint", "prefetch_hint")
PENDING_WAITS = ("committed", "aborted", "timeout")
"""How a Lookup's wait for blocks being written ended: they came (committed), their write
ended without them (aborted), or the wait's bound passed (timeout)."""
MOVES = (("dram", "to_client"), ("dram", "from_client"), ("ssd", "promote"), ("ssd", "demote"),
         ("remote", "promote"))
"""(tier, direction) pairs of `kvtier_moved_bytes_total` the daemon produces."""
PLAN_ACTIONS = ("fetch_dram", "fetch_ssd", "fetch_remote", "recompute", "use_hbm")
"""Per looked-up block: fetch it from DRAM / from SSD / from the remote store, recompute it, or
use the replica's own GPU copy (an HBM block inside the cut costs nothing)."""
KV_EVENT_RESULTS = ("published", "dropped_queue", "dropped_hwm")
SSD_DAMAGE = ("store_moved_aside", "undecodable_entry")
FETCH_LINKS = ("dram_read", "ssd_read", "remote_read")
"""The links (`kvtier.daemon.rates.book.Link`) whose fetches are predicted and timed."""
RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2.0, 4.0, 10.0)


class PoolGauges(NamedTuple):
    """What the scrape-time collector reads (supplied by the cache)."""

    capacity_bytes: dict[str, int]  # tier label -> bytes
    used_bytes: dict[str, int]
    blocks: dict[str, int]
    leases: dict[str, int]  # lease kind -> count
    ssd_wear_budget_used_ratio: float
    writeback_queue_depth: int
    ssd_write_budget_bytes_per_second: float = 0.0  # the wear budget's long-run rate (0 = none)
    group_bytes: dict[tuple[str, str], dict[str, int]] = {}  # noqa: RUF012 (never mutated)
    """(model id, KV cache group) -> tier label -> bytes, for layouts that declared groups."""


class _PoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], PoolGauges]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        cap = GaugeMetricFamily("kvtier_pool_capacity_bytes", "Tier capacity", labels=["tier"])
        used = GaugeMetricFamily("kvtier_pool_used_bytes", "Bytes held in a tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvtier_pool_blocks", "Blocks held in a tier", labels=["tier"])
        for tier, value in snap.capacity_bytes.items():
            cap.add_metric([tier], value)
        for tier, value in snap.used_bytes.items():
            used.add_metric([tier], value)
        for tier, value in snap.blocks.items():
            blocks.add_metric([tier], value)
        leases = GaugeMetricFamily("kvtier_leases_active", "Live leases", labels=["kind"])
        for kind, value in snap.leases.items():
            leases.add_metric([kind], value)
        yield from (cap, used, blocks, leases)
        yield group_family(snap.group_bytes)
        yield GaugeMetricFamily(
            "kvtier_ssd_wear_budget_used_ratio",
            "Fraction of today's SSD write budget spent",
            value=snap.ssd_wear_budget_used_ratio,
        )
        yield GaugeMetricFamily(
            "kvtier_writeback_queue_depth", "Blocks waiting to be written to SSD",
            value=snap.writeback_queue_depth,
        )
        yield GaugeMetricFamily(
            "kvtier_ssd_write_budget_bytes_per_second",
            "Long-run SSD write rate the wear budget allows (0: no SSD tier)",
            value=snap.ssd_write_budget_bytes_per_second,
        )


def group_family(group_bytes: dict[tuple[str, str], dict[str, int]]) -> GaugeMetricFamily:
    """kvtier_group_bytes{model, group, tier}: the models holding the most bytes keep their
    label (at most MAX_MODEL_LABELS), the rest are summed under "other"."""
    fam = GaugeMetricFamily("kvtier_group_bytes", "Bytes a model's KV cache group holds in a "
                            "tier (layouts that declared their groups)",
                            labels=["model", "group", "tier"])
    totals: dict[str, int] = {}
    for (model, _), per_tier in group_bytes.items():
        totals[model] = totals.get(model, 0) + sum(per_tier.values())
    kept = set(sorted(totals, key=lambda m: (-totals[m], m))[:MAX_MODEL_LABELS - 1]
               if len(totals) > MAX_MODEL_LABELS else totals)
    out: dict[tuple[str, str, str], int] = {}
    for (model, group), per_tier in group_bytes.items():
        label = model if model in kept else OTHER
        for tier, value in per_tier.items():
            out[(label, group, tier)] = out.get((label, group, tier), 0) + value
    for labels, value in sorted(out.items()):
        fam.add_metric(list(labels), value)
    return fam


MAX_TENANT_LABELS = 32
MAX_MODEL_LABELS = 16
OTHER = "other"


class LabelCap:
    """Bounded label values: the first `cap` distinct values keep their name, every later one
    reads `OTHER`, so a fleet of many tenants or models cannot blow up the series count.
    Thread-safe."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.cap and value != OTHER:
                self._seen.add(value)
                return value
        return OTHER


class MrcPoint(NamedTuple):
    scaled: str  # "none" (the daemon as it is), "dram" or "ssd"
    factor: float
    dram_blocks: int
    ssd_blocks: int
    dram_hit_ratio: float
    hit_ratio: float


class MrcGauges(NamedTuple):
    """What the MRC collector reads: per (scaled tier, factor) the estimated hit ratios
    (published once the estimator has sampled `MIN_SAMPLES` block references: `sampled_blocks`),
    and the estimator's own cost."""

    points: list[MrcPoint]
    sampling_ratio: float
    tracked_keys: int
    memory_bytes: int
    sampled_blocks: int = 0


class _MrcCollector(Collector):
    def __init__(self, points: Callable[[], MrcGauges]) -> None:
        self._points = points

    def collect(self) -> Iterator[Metric]:
        snap = self._points()
        labels = ["scaled", "factor"]
        hit = GaugeMetricFamily(
            "kvtier_mrc_hit_ratio",
            "Estimated hit ratio (DRAM + SSD blocks) with the `scaled` tier's capacity x factor "
            "(absent until enough block references were sampled)",
            labels=labels)
        dram = GaugeMetricFamily(
            "kvtier_mrc_dram_hit_ratio",
            "Estimated DRAM-only hit ratio with the `scaled` tier's capacity x factor (absent "
            "until enough block references were sampled)",
            labels=labels)
        for p in snap.points if snap.sampled_blocks >= MIN_SAMPLES else ():  # no zeros early
            hit.add_metric([p.scaled, f"{p.factor:g}"], p.hit_ratio)
            dram.add_metric([p.scaled, f"{p.factor:g}"], p.dram_hit_ratio)
        yield from (hit, dram)
        yield CounterMetricFamily("kvtier_mrc_sampled_blocks",
                                  "Block references the MRC estimator has sampled (its hit "
                                  f"ratios are published from {MIN_SAMPLES} on)",
                                  value=snap.sampled_blocks)
        yield GaugeMetricFamily("kvtier_mrc_sampling_ratio",
                                "Share of block keys the MRC estimator samples",
                                value=snap.sampling_ratio)
        yield GaugeMetricFamily("kvtier_mrc_tracked_keys", "Keys the MRC estimator tracks",
                                value=snap.tracked_keys)
        yield GaugeMetricFamily("kvtier_mrc_memory_bytes",
                                "Estimated memory of the MRC estimator's tables",
                                value=snap.memory_bytes)


class DaemonMetrics:
    """All of one daemon's metrics. `attach_pool()` once the cache exists; the shell serves
    `registry` over HTTP (`kvtier.daemon.httpd`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.tenants = LabelCap(MAX_TENANT_LABELS)
        self.models = LabelCap(MAX_MODEL_LABELS)
        self.build_info = Gauge(
            "kvtier_build_info", "Always 1; the labels say what is running",
            ["version", "python"], registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.lookups = Counter(
            "kvtier_lookups", "Lookups by outcome (hit = at least one block)",
            ["result", "tenant", "model"], registry=r,
        )
        self.blocks_hit = Counter(
            "kvtier_blocks_hit", "Looked-up blocks found, by tier",
            ["tier", "tenant", "model"], registry=r,
        )
        self.blocks_missed = Counter(
            "kvtier_blocks_missed", "Looked-up blocks not found", ["tenant", "model"],
            registry=r,
        )
        self.bytes_moved = Counter(
            "kvtier_moved_bytes", "Payload bytes moved, by tier and direction",
            ["tier", "direction"], registry=r,
        )
        self.evictions = Counter(
            "kvtier_evictions", "Blocks dropped from a tier, by reason", ["tier", "reason"],
            registry=r,
        )
        self.ssd_bytes_written = Counter(
            "kvtier_ssd_written_bytes", "Bytes written to the SSD tier", registry=r
        )
        self.writeback_dropped = Counter(
            "kvtier_writeback_dropped", "Write-backs dropped (queue full or over budget)",
            registry=r,
        )
        self.checksum_failures = Counter(
            "kvtier_checksum_failures", "SSD blocks that failed verification (never served)",
            registry=r,
        )
        self.dram_moved_blocks = Counter(
            "kvtier_dram_moved_blocks", "Blocks moved inside the DRAM pool to empty a page for "
            "another size class", registry=r,
        )
        self.ssd_damage = Counter(
            "kvtier_ssd_damage", "SSD store damage found at start: stores moved aside, index "
            "entries skipped", ["kind"], registry=r,
        )
        for kind in SSD_DAMAGE:
            self.ssd_damage.labels(kind)
        self.kv_events = Counter(
            "kvtier_kv_event_blocks", "Blocks in the KV events of the ZMQ stream (--kv-events): "
            "published, or dropped (publisher queue full; a subscriber at the high-water mark)",
            ["result"], registry=r,
        )
        for result in KV_EVENT_RESULTS:
            self.kv_events.labels(result)
        self.leases_expired = Counter(
            "kvtier_leases_expired",
            "Leases reclaimed after their TTL or with their client's session", ["kind"], registry=r
        )
        # known label values start at 0, so rate() and dashboards see them before the first event
        for kind in LEASE_KINDS:
            self.leases_expired.labels(kind)
        for tier, direction in MOVES:
            self.bytes_moved.labels(tier, direction)
        for tier in ("dram", "ssd"):
            for reason in EVICTION_REASONS:
                self.evictions.labels(tier, reason)
        self.plan_decisions = Counter(
            "kvtier_plan_decisions", "Looked-up blocks by planned action", ["action"], registry=r
        )
        for action in PLAN_ACTIONS:
            self.plan_decisions.labels(action)
        self.plans = Counter("kvtier_plans", "Plans by reason", ["reason"], registry=r)
        for reason in Reason:
            self.plans.labels(reason.value)
        self.predicted_seconds_saved = Counter(
            "kvtier_plan_saved_prefill_seconds",
            "Planner's predicted prefill seconds saved against recomputing everything",
            registry=r,
        )
        self.fetch_time_ratio = Histogram(
            "kvtier_plan_fetch_time_ratio",
            "Realized / predicted time of a lease's fetch (ssd_read: promotions in Acquire; "
            "dram_read: the client's copy reported on Release)", ["link"], registry=r,
            buckets=RATIO_BUCKETS,
        )
        self.rpcs = Counter(
            "kvtier_rpcs", "RPCs by method and status", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "kvtier_rpc_duration_seconds", "RPC handling time", ["method"], registry=r,
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5),
        )
        self.operator_actions = Counter(
            "kvtier_operator_actions", "Operators' actions on the cache (evict, clear, pin, "
            "unpin, prefetch; pin_hint and prefetch_hint: a request's hints from an engine)",
            ["action"], registry=r,
        )
        self.operator_blocks = Counter(
            "kvtier_operator_blocks", "Blocks operators' actions changed: removed (evict, "
            "clear), newly pinned, unpinned, brought into DRAM (prefetch)", ["action"],
            registry=r,
        )
        for action in OPERATOR_ACTIONS:
            self.operator_actions.labels(action)
            self.operator_blocks.labels(action)
        self.pinned_blocks = Gauge(
            "kvtier_pinned_blocks", "Blocks operators (or requests' hints) pinned, until their "
            "deadline", registry=r,
        )
        self.pending_waits = Counter(
            "kvtier_pending_waits", "Lookups that waited for blocks another client was writing "
            "(dram: a lease here; remote: another daemon's hand-off), by how the wait ended",
            ["tier", "result"], registry=r,
        )
        self.pending_wait_seconds = Histogram(
            "kvtier_pending_wait_seconds", "Time Lookups waited for blocks being written",
            ["tier"], registry=r,
            buckets=(1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.pending_waiting = Gauge(
            "kvtier_pending_waits_active", "Lookups waiting now for blocks being written",
            registry=r,
        )
        for tier in ("dram", "remote"):
            for result in PENDING_WAITS:
                self.pending_waits.labels(tier, result)
        self.verify_verified = Counter(
            "kvtier_verify_verified_blocks", "Blocks an engine recomputed and compared with the "
            "stored bytes (shadow verification)", ["tenant", "model"], registry=r,
        )
        self.verify_matched = Counter(
            "kvtier_verify_matched_blocks", "Verified blocks within the engine's numerical "
            "spread", ["tenant", "model"], registry=r,
        )
        self.verify_mismatched = Counter(
            "kvtier_verify_mismatched_blocks", "Verified blocks that did not match: wrong KV "
            "held under the right key (quarantined with their descendants)",
            ["tenant", "model"], registry=r,
        )
        self.verify_quarantined = Counter(
            "kvtier_verify_quarantined_blocks", "Blocks removed from a tier for a verification "
            "mismatch (the block and its descendants; remote: copies deleted)", ["tier"],
            registry=r,
        )
        for tier in QUARANTINE_TIERS:
            self.verify_quarantined.labels(tier)
        self.copy_seconds = Histogram(
            "kvtier_client_copy_seconds", "Client-reported copy time per lease", ["direction"],
            registry=r, buckets=(1e-4, 1e-3, 5e-3, 2e-2, 0.1, 0.5, 2.0),
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0 when it was never set), e.g. for the Stats RPC."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
        want = labels.items()
        return sum(
            s.value for metric in self.registry.collect() for s in metric.samples
            if s.name == name and want <= s.labels.items()
        )

    def record_lookup(self, tenant: str, model: str, hits: Mapping[str, int], missed: int) -> None:
        """One Lookup: its outcome and its hit blocks by tier label (only tiers with hits), under
        capped tenant/model labels."""
        t, m = self.tenants.label(tenant), self.models.label(model)
        self.lookups.labels("hit" if hits else "miss", t, m).inc()
        for tier, count in hits.items():
            self.blocks_hit.labels(tier, t, m).inc(count)
        if missed:
            self.blocks_missed.labels(t, m).inc(missed)

    def record_pending_wait(self, tier: str, result: str, seconds: float) -> None:
        """One Lookup's wait for blocks being written (`PENDING_WAITS`)."""
        self.pending_waits.labels(tier, result).inc()
        self.pending_wait_seconds.labels(tier).observe(seconds)
    def record_verification(self, tenant: str, model: str, matched: int, mismatched: int
                            ) -> None:
        """One verification report: blocks that matched and that did not (capped labels)."""
        t, m = self.tenants.label(tenant), self.models.label(model)
        self.verify_verified.labels(t, m).inc(matched + mismatched)
        self.verify_matched.labels(t, m).inc(matched)
        self.verify_mismatched.labels(t, m).inc(mismatched)

    def attach_mrc(self, points: Callable[[], MrcGauges]) -> None:
        self.registry.register(_MrcCollector(points))

    def attach_pool(self, snapshot: Callable[[], PoolGauges]) -> None:
        self.registry.register(_PoolCollector(snapshot))

    def attach(self, collector: Collector) -> None:
        """A collector read at scrape time (the planner's rates: `kvtier.daemon.rates.gauges`)."""
        self.registry.register(collector)

    def record_plan(self, plan: Plan) -> None:
        """Counts one Lookup's plan: its blocks by action, its reason, the seconds it saves."""
        hbm, dram, ssd, remote = plan.blocks_by_tier
        for action, count in (("use_hbm", hbm), ("fetch_dram", dram), ("fetch_ssd", ssd),
                              ("fetch_remote", remote), ("recompute", plan.recompute_blocks)):
            if count:
                self.plan_decisions.labels(action).inc(count)
        self.plans.labels(plan.reason.value).inc()
        self.predicted_seconds_saved.inc(max(0.0, plan.saved_s))

    def observe_fetch(self, link: str, realized_s: float, predicted_s: float) -> None:
        """One fetch's prediction error, as realized / predicted seconds of the same work: the
        bytes moved over `link` divided by the link's bandwidth estimate when the lease was
        granted — transfer time only, no per-request latency, like the realized time.

        A ratio rather than a difference, so fetches of 1 block and of 1,000 share the buckets.
        Ignored unless both are finite and > 0."""
        if link not in FETCH_LINKS or not (0 < realized_s < 1e6 and 0 < predicted_s < 1e6):
            return
        self.fetch_time_ratio.labels(str(link)).observe(realized_s / predicted_s)
