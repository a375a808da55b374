"""The kvtier Grafana dashboards, built from code with grafana-foundation-sdk.

    python deploy/grafana/dashboards.py        # rewrites deploy/grafana/kvtier-{fleet,node}.json

Two dashboards over the recording rules of deploy/prometheus/kvtier.rules.yml (load them) and the
raw `kvtier_*` metrics: **fleet** (every daemon of a Prometheus datasource, by model, tenant and
node) and **node** (one or more daemons picked with the `instance` variable). Each panel is a
`Panel` below: its title, what it means (shown as the panel's description and in docs/fleet.md's
"Watching a fleet"), its PromQL and unit. tests/test_grafana.py checks that the committed JSON is
what this builds, and evaluates every query against a real Prometheus scraping real daemons.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
DS = "${datasource}"
NODE = 'instance=~"$instance"'


class Query(NamedTuple):
    expr: str
    legend: str = ""


class Panel(NamedTuple):
    title: str
    meaning: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat", "bargauge", "table"
    width: int = 12
    stack: bool = False


FLEET: tuple[Panel, ...] = (
    Panel("Fleet hit ratio",
          "Blocks found in any tier / blocks looked up, all daemons, last 5 minutes.",
          (Query("fleet:kvtier_hit_ratio:rate5m"),), "percentunit", "stat", 6),
    Panel("Daemons up",
          "Daemons Prometheus scrapes successfully / daemons it should scrape.",
          (Query('sum(up{job=~"kvtier.*"}) / count(up{job=~"kvtier.*"})'),),
          "percentunit", "stat", 6),
    Panel("Prefill seconds saved / s",
          "GPU prefill seconds the planner predicts the fleet saves per second by loading "
          "cached blocks instead of recomputing them.",
          (Query("fleet:kvtier_saved_prefill_seconds:rate5m"),), "s", "stat", 6),
    Panel("Bytes served from cache / s",
          "KV bytes the daemons hand to engines per second (what the engines did not "
          "recompute).",
          (Query("fleet:kvtier_served_bytes:rate5m"),), "Bps", "stat", 6),
    Panel("Hit ratio by model",
          "Block hit ratio per model (the `model` label; beyond the cap, models read "
          "`other`).",
          (Query("model:kvtier_hit_ratio:rate5m", "{{model}}"),), "percentunit"),
    Panel("Hit ratio by tenant",
          "Block hit ratio per tenant (capped like `model`).",
          (Query("tenant:kvtier_hit_ratio:rate5m", "{{tenant}}"),), "percentunit"),
    Panel("Hits by tier",
          "Where hits come from: blocks/s found in HBM (the replica's own GPU copy), DRAM and "
          "SSD.",
          (Query("fleet:kvtier_blocks_hit:rate5m", "{{tier}}"),), "short", stack=True),
    Panel("Hit ratio by node",
          "Block hit ratio of each daemon; one low line is a node problem, all low is a "
          "workload change.",
          (Query("instance:kvtier_hit_ratio:rate5m", "{{instance}}"),), "percentunit"),
    Panel("Tier fill",
          "Used / capacity of the DRAM and SSD tiers, fleet-wide.",
          (Query("fleet:kvtier_pool_fill:ratio", "{{tier}}"),), "percentunit"),
    Panel("Would more capacity pay off? (MRC)",
          "The daemons' own estimate (online miss-ratio curve) of the hit ratio with DRAM or "
          "SSD scaled by 0.25x..8x, averaged over nodes; `none x1` is the capacity they have.",
          (Query("avg by (scaled, factor) (kvtier_mrc_hit_ratio)", "{{scaled}} x{{factor}}"),),
          "percentunit", "bargauge"),
    Panel("SSD writes vs wear budget",
          "SSD bytes written over the last hour / the long-run rate the wear budget allows, "
          "per node (1 = writing exactly the budget).",
          (Query("instance:kvtier_ssd_write_budget:ratio_rate1h", "{{instance}}"),),
          "percentunit"),
    Panel("Problems",
          "Write-backs dropped per second and SSD checksum failures in the last hour, fleet "
          "sums (both should be 0; see the alerts).",
          (Query("sum(instance:kvtier_writeback_dropped:rate5m)", "write-backs dropped / s"),
           Query("sum(instance:kvtier_checksum_failures:increase1h)",
                 "checksum failures (1h)")), "short"),
)

NODE_PANELS: tuple[Panel, ...] = (
    Panel("Hit ratio",
          "Blocks found / blocks looked up on the selected daemons.",
          (Query(f"instance:kvtier_hit_ratio:rate5m{{{NODE}}}", "{{instance}}"),),
          "percentunit"),
    Panel("Lookups",
          "Lookups per second, by outcome (hit = at least one block found).",
          (Query(f"instance:kvtier_lookups:rate5m{{{NODE}}}", "{{instance}} {{result}}"),),
          "reqps"),
    Panel("Hits by tier",
          "Blocks/s found in HBM, DRAM and SSD.",
          (Query(f"instance:kvtier_blocks_hit:rate5m{{{NODE}}}", "{{instance}} {{tier}}"),),
          "short", stack=True),
    Panel("Tier fill",
          "Used / capacity of each tier.",
          (Query(f"instance:kvtier_pool_fill:ratio{{{NODE}}}", "{{instance}} {{tier}}"),),
          "percentunit"),
    Panel("Traffic",
          "Payload bytes/s moved: to and from clients (DRAM), promoted from and demoted to SSD.",
          (Query(f"instance:kvtier_moved_bytes:rate5m{{{NODE}}}",
                 "{{instance}} {{tier}} {{direction}}"),), "Bps"),
    Panel("Leases",
          "Live leases (READ pins loaded blocks, WRITE holds slots until Commit), grants/s and "
          "expiries/s (a client that died or was too slow).",
          (Query(f"kvtier_leases_active{{{NODE}}}", "{{instance}} active {{kind}}"),
           Query(f"instance:kvtier_leases_granted:rate5m{{{NODE}}}",
                 "{{instance}} granted/s {{method}}"),
           Query(f"instance:kvtier_leases_expired:rate5m{{{NODE}}}",
                 "{{instance}} expired/s {{kind}}")), "short"),
    Panel("Planner decisions",
          "Looked-up blocks/s by what the plan does with them: use the replica's HBM copy, "
          "fetch from DRAM, fetch from SSD, or recompute.",
          (Query(f"instance:kvtier_plan_decisions:rate5m{{{NODE}}}",
                 "{{instance}} {{action}}"),), "short", stack=True),
    Panel("Planner prediction error",
          "Median realized / predicted fetch time per link (1 = the planner's rates are "
          "right; the alert fires outside 0.5..2).",
          (Query(f"instance:kvtier_plan_fetch_time_ratio:median5m{{{NODE}}}",
                 "{{instance}} {{link}}"),), "short"),
    Panel("MRC: hit ratio at other capacities",
          "This daemon's estimate of its hit ratio with DRAM or SSD scaled by 0.25x..8x "
          "(`none x1`: as configured); the gap to `none` is the headroom.",
          (Query(f"kvtier_mrc_hit_ratio{{{NODE}}}", "{{instance}} {{scaled}} x{{factor}}"),),
          "percentunit", "bargauge"),
    Panel("SSD writes and budget",
          "SSD bytes written per second (1 h rate) against the wear budget's long-run rate.",
          (Query(f"instance:kvtier_ssd_written_bytes:rate1h{{{NODE}}}", "{{instance}} written"),
           Query(f"kvtier_ssd_write_budget_bytes_per_second{{{NODE}}}",
                 "{{instance}} budget")), "Bps"),
    Panel("Write-back",
          "Blocks waiting in the write-back queue, write-backs dropped per second, and the "
          "share of the wear bucket spent.",
          (Query(f"kvtier_writeback_queue_depth{{{NODE}}}", "{{instance}} queued"),
           Query(f"instance:kvtier_writeback_dropped:rate5m{{{NODE}}}",
                 "{{instance}} dropped/s"),
           Query(f"kvtier_ssd_wear_budget_used_ratio{{{NODE}}}",
                 "{{instance}} bucket spent")), "short"),
    Panel("Evictions",
          "Blocks/s dropped from a tier, by reason (capacity, tenant quota, checksum failure, "
          "expired write).",
          (Query(f"sum by (instance, tier, reason) "
                 f"(rate(kvtier_evictions_total{{{NODE}}}[$__rate_interval]))",
                 "{{instance}} {{tier}} {{reason}}"),), "short"),
    Panel("RPCs",
          "Calls/s by method, and the share that failed.",
          (Query(f"sum by (instance, method) "
                 f"(rate(kvtier_rpcs_total{{{NODE}}}[$__rate_interval]))",
                 "{{instance}} {{method}}"),
           Query(f"instance:kvtier_rpc_errors:ratio_rate5m{{{NODE}}}",
                 "{{instance}} error share")), "reqps"),
    Panel("RPC latency p99",
          "99th percentile of RPC handling time, by method.",
          (Query(f"histogram_quantile(0.99, sum by (instance, method, le) "
                 f"(rate(kvtier_rpc_duration_seconds_bucket{{{NODE}}}[$__rate_interval])))",
                 "{{instance}} {{method}}"),), "s"),
    Panel("Planner rates",
          "The bandwidths the planner currently assumes, per tier and direction (measured "
          "median, else calibration or defaults).",
          (Query(f"kvtier_rate_bandwidth_bytes_per_second{{{NODE}}}",
                 "{{instance}} {{tier}} {{direction}}"),), "Bps"),
    Panel("Build",
          "What each daemon runs (kvtier and Python versions).",
          (Query(f"kvtier_build_info{{{NODE}}}", "{{instance}} {{version}} py{{python}}"),),
          "short", "table"),
)


def _panel(p: Panel, x: int, y: int) -> Any:
    from grafana_foundation_sdk.builders import bargauge, common, prometheus, stat, table
    from grafana_foundation_sdk.builders import timeseries as ts
    from grafana_foundation_sdk.models.common import StackingMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

    kinds: dict[str, Callable[[], Any]] = {
        "timeseries": ts.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel,
        "table": table.Panel}
    height = 5 if p.kind == "stat" else 8
    b = (kinds[p.kind]().title(p.title).description(p.meaning).unit(p.unit)
         .datasource(DataSourceRef(type_val="prometheus", uid=DS))
         .grid_pos(GridPos(h=height, w=p.width, x=x, y=y)))
    for i, q in enumerate(p.queries):
        target = prometheus.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i))
        if q.legend:
            target = target.legend_format(q.legend)
        if p.kind in ("bargauge", "table", "stat"):
            target = target.instant()
        b = b.with_target(target)
    if p.stack:
        b = b.stacking(common.StackingConfig().mode(StackingMode.NORMAL))
    return b


def build(uid: str, title: str, panels: tuple[Panel, ...], node: bool) -> dict[str, object]:
    from grafana_foundation_sdk.builders import dashboard
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    d = (dashboard.Dashboard(title).uid(uid).tags(["kvtier"]).refresh("30s")
         .time("now-6h", "now").timezone("browser")
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source")
                        .type("prometheus")))
    if node:
        d = d.with_variable(
            dashboard.QueryVariable("instance").label("Daemon")
            .datasource(DataSourceRef(type_val="prometheus", uid=DS))
            .query('label_values(kvtier_build_info, instance)').multi(True).include_all(True)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    x = y = row_h = 0
    for p in panels:
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        d = d.with_panel(_panel(p, x, y))
        x += p.width
        row_h = max(row_h, 5 if p.kind == "stat" else 8)
    doc: dict[str, object] = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))
    return doc


def dashboards() -> dict[str, dict[str, object]]:
    """File name -> dashboard JSON."""
    return {
        "kvtier-fleet.json": build("kvtier-fleet", "kvtier fleet", FLEET, node=False),
        "kvtier-node.json": build("kvtier-node", "kvtier node", NODE_PANELS, node=True),
    }


def render(doc: dict[str, object]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main() -> int:
    for name, doc in dashboards().items():
        (HERE / name).write_text(render(doc))
        print(f"wrote {HERE / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
