"""The connector's counters through vLLM's connector-stats hooks: workers (and the scheduler side,
for its tier events) report per-step deltas (`KvtierConnectorStats`), vLLM aggregates them across
ranks, logs them with its throughput line and exports them as Prometheus counters
`vllm:kvtier_<name>_total` (`KvtierPromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

FIELDS = {
    "loaded_blocks": "Blocks loaded from kvtier into vLLM's KV cache",
    "loaded_bytes": "Bytes copied from kvtier into vLLM's KV cache (hybrid models: only the "
                    "pages each KV cache group needs, such as a sliding window's)",
    "load_failed_blocks": "Blocks kvtier promised but could not load (vLLM recomputed them)",
    "stored_blocks": "Blocks stored into kvtier",
    "load_seconds": "Seconds spent copying blocks from kvtier (and releasing leases)",
    "store_seconds": "Seconds spent storing blocks into kvtier",
    "verified_blocks": "Blocks recomputed for shadow verification and compared with the bytes "
                       "kvtier held for them",
    "verify_mismatched_blocks": "Verified blocks that differed from kvtier's bytes beyond the "
                                "engine's numerical spread (the daemon quarantined them)",
    "dropped_tier_events": "kvtier tier events left out of vLLM's KV-event stream because the "
                           "connector's queue was full (a router did not see them)",
}


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[str, int], Any] = {}
        for name, doc in FIELDS.items():
            counter = self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc,
                                        labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._bound[(name, engine)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in FIELDS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self._bound[(name, engine_idx)].inc(value)
