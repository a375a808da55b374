"""Prometheus metrics of one daemon, on a dedicated registry (never the process-global one).

Names follow DESIGN: `kvtier_*`, base units (`_bytes`, `_seconds`), counters end in `_total`, and
labels are bounded (tier ∈ hbm/dram/ssd, method ∈ the RPC names, code ∈ gRPC status names,
direction/reason/result/action ∈ small fixed sets below) — never a key, tenant token or request id.

Counters and histograms are updated by the cache and the service as things happen; pool gauges
(capacity, usage, blocks, active leases, wear budget) are read from a snapshot callable at scrape
time, so they can never drift from the truth.

Thread-safe (prometheus-client's primitives are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DIRECTIONS = ("to_client", "from_client", "promote", "demote")
EVICTION_REASONS = ("capacity", "quota", "checksum", "expired_write")


class PoolGauges(NamedTuple):
    """What the scrape-time collector reads (supplied by the cache)."""

    capacity_bytes: dict[str, int]  # tier label -> bytes
    used_bytes: dict[str, int]
    blocks: dict[str, int]
    leases: dict[str, int]  # lease kind -> count
    ssd_wear_budget_used_ratio: float
    writeback_queue_depth: int


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
        leases = GaugeMetricFamily("kvtier_active_leases", "Live leases", labels=["kind"])
        for kind, value in snap.leases.items():
            leases.add_metric([kind], value)
        yield from (cap, used, blocks, leases)
        yield GaugeMetricFamily(
            "kvtier_ssd_wear_budget_used_ratio",
            "Fraction of today's SSD write budget spent",
            value=snap.ssd_wear_budget_used_ratio,
        )
        yield GaugeMetricFamily(
            "kvtier_writeback_queue_depth", "Blocks waiting to be written to SSD",
            value=snap.writeback_queue_depth,
        )


class DaemonMetrics:
    """All of one daemon's metrics. `attach_pool()` once the cache exists; `serve()` for HTTP."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.lookups = Counter(
            "kvtier_lookups", "Lookups by outcome (hit = at least one block)", ["result"],
            registry=r,
        )
        self.blocks_hit = Counter(
            "kvtier_blocks_hit", "Looked-up blocks found, by tier", ["tier"], registry=r
        )
        self.blocks_missed = Counter(
            "kvtier_blocks_missed", "Looked-up blocks not found", registry=r
        )
        self.bytes_moved = Counter(
            "kvtier_bytes_moved", "Payload bytes moved, by tier and direction",
            ["tier", "direction"], registry=r,
        )
        self.evictions = Counter(
            "kvtier_evictions", "Blocks dropped from a tier, by reason", ["tier", "reason"],
            registry=r,
        )
        self.ssd_bytes_written = Counter(
            "kvtier_ssd_bytes_written", "Bytes written to the SSD tier", registry=r
        )
        self.writeback_dropped = Counter(
            "kvtier_writeback_dropped", "Write-backs dropped (queue full or over budget)",
            registry=r,
        )
        self.checksum_failures = Counter(
            "kvtier_checksum_failures", "SSD blocks that failed verification (never served)",
            registry=r,
        )
        self.leases_expired = Counter(
            "kvtier_leases_expired", "Leases reclaimed after their TTL", ["kind"], registry=r
        )
        self.plan_decisions = Counter(
            "kvtier_plan_decisions", "Planned blocks by action", ["action"], registry=r
        )
        self.predicted_seconds_saved = Counter(
            "kvtier_predicted_prefill_seconds_saved", "Planner's predicted recompute time avoided",
            registry=r,
        )
        self.rpcs = Counter(
            "kvtier_rpcs", "RPCs by method and status", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "kvtier_rpc_duration_seconds", "RPC handling time", ["method"], registry=r,
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5),
        )
        self.copy_seconds = Histogram(
            "kvtier_client_copy_seconds", "Client-reported copy time per lease", ["direction"],
            registry=r, buckets=(1e-4, 1e-3, 5e-3, 2e-2, 0.1, 0.5, 2.0),
        )
        self._http: object | None = None

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0 when it was never set), e.g. for the Stats RPC."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def attach_pool(self, snapshot: Callable[[], PoolGauges]) -> None:
        self.registry.register(_PoolCollector(snapshot))

    def serve(self, host: str, port: int) -> int:
        """Starts /metrics on a daemon thread; returns the bound port (useful when port is 0)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        server = self._http
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._http = None
