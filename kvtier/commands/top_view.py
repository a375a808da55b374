"""What `kvtier top` shows, computed from samples of each daemon (pure: no I/O, no clock).

A `Sample` is one reading of one daemon, from its /metrics text (`from_metrics`: everything) or
its Stats RPC (`from_stats`: no traffic or planner counters, which only /metrics has). `Row`
compares two samples of a source: the hit ratio over the interval and since start, its trend,
tier fill, lookups/s, traffic, leases, the planner's decisions over the interval, and the MRC's
headroom (the best gain in hit-ratio points from 2x..8x DRAM or SSD), or that the MRC is still
warming up (fewer than `MIN_SAMPLES` sampled blocks: no curve yet, never a curve of zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier.index.mrc import MIN_SAMPLES

SPARK = "▁▂▃▄▅▆▇█"
ACTIONS = ("use_hbm", "fetch_dram", "fetch_ssd", "recompute")


@dataclass(frozen=True)
class Sample:
    source: str
    t: float  # seconds, any monotonic origin
    ok: bool
    error: str = ""
    version: str = ""
    lookups: float = 0.0
    blocks_hit: float = 0.0  # DRAM + SSD (+ HBM from /metrics)
    blocks_missed: float = 0.0
    hits_by_tier: dict[str, float] = field(default_factory=dict)
    capacity_bytes: dict[str, float] = field(default_factory=dict)  # tier -> bytes
    used_bytes: dict[str, float] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)  # kind -> live leases
    moved_bytes: dict[str, float] | None = None  # "tier/direction" -> bytes (metrics only)
    plan_decisions: dict[str, float] | None = None  # action -> blocks (metrics only)
    # (scaled, factor) -> estimated hit ratio
    mrc: dict[tuple[str, float], float] = field(default_factory=dict)
    writeback_dropped: float = 0.0
    checksum_failures: float = 0.0
    mrc_samples: float | None = None  # block references the MRC has sampled (None: unknown)
    verified: float = 0.0  # shadow verification: blocks compared, of them mismatched
    mismatched: float = 0.0
    answered: bool = False  # a failed reading the daemon refused (reached, not down)


def down(source: str, t: float, error: str, answered: bool = False) -> Sample:
    """A failed reading; `answered`: the daemon was reached and refused (a bad token, say)."""
    return Sample(source, t, False, error, answered=answered)


def from_metrics(source: str, t: float, text: str) -> Sample:
    """A sample from a daemon's Prometheus exposition (`kvtier_*` families)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    by: dict[str, dict[str, float]] = {}
    mrc: dict[tuple[str, float], float] = {}
    version = ""

    def add(key: str, label: str, value: float) -> None:
        d = by.setdefault(key, {})
        d[label] = d.get(label, 0.0) + value

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, lb, v = s.name, s.labels, float(s.value)
            if name in ("kvtier_lookups_total", "kvtier_blocks_missed_total",
                        "kvtier_writeback_dropped_total", "kvtier_checksum_failures_total",
                        "kvtier_verify_verified_blocks_total",
                        "kvtier_verify_mismatched_blocks_total"):
                sums[name] = sums.get(name, 0.0) + v
            elif name == "kvtier_blocks_hit_total":
                add("hit", lb["tier"], v)
            elif name == "kvtier_pool_capacity_bytes":
                add("cap", lb["tier"], v)
            elif name == "kvtier_pool_used_bytes":
                add("used", lb["tier"], v)
            elif name == "kvtier_leases_active":
                add("leases", lb["kind"], v)
            elif name == "kvtier_moved_bytes_total":
                add("moved", f"{lb['tier']}/{lb['direction']}", v)
            elif name == "kvtier_plan_decisions_total":
                add("plan", lb["action"], v)
            elif name == "kvtier_mrc_hit_ratio":
                mrc[(lb["scaled"], float(lb["factor"]))] = v
            elif name == "kvtier_mrc_sampled_blocks_total":
                sums[name] = v
            elif name == "kvtier_build_info":
                version = lb.get("version", "")
    hits = by.get("hit", {})
    return Sample(
        source, t, True, version=version, lookups=sums.get("kvtier_lookups_total", 0.0),
        blocks_hit=sum(hits.values()), blocks_missed=sums.get("kvtier_blocks_missed_total", 0.0),
        hits_by_tier=hits, capacity_bytes=by.get("cap", {}), used_bytes=by.get("used", {}),
        leases=by.get("leases", {}), moved_bytes=by.get("moved", {}),
        plan_decisions=by.get("plan", {}), mrc=mrc,
        writeback_dropped=sums.get("kvtier_writeback_dropped_total", 0.0),
        checksum_failures=sums.get("kvtier_checksum_failures_total", 0.0),
        mrc_samples=sums.get("kvtier_mrc_sampled_blocks_total"),
        verified=sums.get("kvtier_verify_verified_blocks_total", 0.0),
        mismatched=sums.get("kvtier_verify_mismatched_blocks_total", 0.0),
    )


def from_stats(source: str, t: float, s: Any) -> Sample:
    """A sample from a `StatsResponse` (node totals; see the module docstring)."""
    names = {2: "dram", 3: "ssd", 1: "hbm"}
    cap = {names.get(x.tier, str(x.tier)): float(x.capacity_bytes) for x in s.tiers}
    used = {names.get(x.tier, str(x.tier)): float(x.used_bytes) for x in s.tiers}
    return Sample(
        source, t, True, version=s.version, lookups=float(s.lookups),
        blocks_hit=float(s.blocks_hit), blocks_missed=float(s.blocks_missed),
        capacity_bytes=cap, used_bytes=used, leases={"all": float(s.active_leases)},
        mrc={(p.scaled, float(p.factor)): float(p.hit_ratio) for p in s.mrc
             if s.mrc_sampled_blocks >= MIN_SAMPLES},  # (an older daemon sends zeros early)
        writeback_dropped=float(s.writeback_dropped),
        checksum_failures=float(s.checksum_failures),
        mrc_samples=float(s.mrc_sampled_blocks) if s.node_wide else None,
        verified=float(s.verify_verified_blocks), mismatched=float(s.verify_mismatched_blocks),
    )


class Row(NamedTuple):
    source: str
    ok: bool
    error: str
    version: str
    hit_ratio: float | None  # over the last interval (None: no lookups in it)
    hit_ratio_total: float | None  # since the daemon started
    trend: list[float]  # interval hit ratios, oldest first
    fill: dict[str, float]  # tier -> used / capacity
    lookups_per_s: float
    traffic_bytes_per_s: dict[str, float] | None  # "tier/direction" -> bytes/s
    leases: dict[str, float]
    plan_share: dict[str, float] | None  # action -> share of looked-up blocks in the interval
    mrc: dict[str, float]  # "dram x2" -> estimated hit ratio
    mrc_headroom: dict[str, float]  # "dram", "ssd" -> best gain (points) over `none x1`
    writeback_dropped: float
    checksum_failures: float
    mrc_samples: float | None = None  # block references the MRC has sampled (None: unknown)
    verified: float = 0.0  # shadow verification since start: blocks compared, mismatched
    mismatched: float = 0.0


def _ratio(hit: float, missed: float) -> float | None:
    return hit / (hit + missed) if hit + missed > 0 else None


def _rates(a: dict[str, float] | None, b: dict[str, float] | None, dt: float
           ) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {k: max(0.0, (b[k] - a.get(k, 0.0)) / dt) if dt > 0 else 0.0 for k in sorted(b)}


def row(prev: Sample | None, cur: Sample, trend: Sequence[float] = ()) -> Row:
    """The view of `cur`, with interval figures against `prev` (None: since start)."""
    if not cur.ok:
        return Row(cur.source, False, cur.error, "", None, None, list(trend), {}, 0.0, None, {},
                   None, {}, {}, 0.0, 0.0)
    base = prev if prev is not None and prev.ok else None
    dt = cur.t - base.t if base is not None else 0.0
    if base is not None:
        interval = _ratio(cur.blocks_hit - base.blocks_hit, cur.blocks_missed - base.blocks_missed)
        lookups = (cur.lookups - base.lookups) / dt if dt > 0 else 0.0
        traffic = _rates(base.moved_bytes, cur.moved_bytes, dt)
        plan = _rates(base.plan_decisions, cur.plan_decisions, 1.0)
    else:
        interval = _ratio(cur.blocks_hit, cur.blocks_missed)
        lookups, traffic, plan = 0.0, None, cur.plan_decisions
    share = None
    if plan is not None:
        total = sum(plan.get(a, 0.0) for a in ACTIONS)
        share = {a: plan.get(a, 0.0) / total if total else 0.0 for a in ACTIONS}
    fill = {t: cur.used_bytes.get(t, 0.0) / c for t, c in sorted(cur.capacity_bytes.items()) if c}
    now = cur.mrc.get(("none", 1.0))
    headroom = {}
    if now is not None:
        for tier in ("dram", "ssd"):
            gains = [v - now for (s, f), v in cur.mrc.items() if s == tier and f > 1]
            if gains:
                headroom[tier] = max(gains)
    mrc = {f"{s} x{f:g}": v for (s, f), v in sorted(cur.mrc.items())}
    new_trend = [*trend, interval] if interval is not None else list(trend)
    return Row(cur.source, True, "", cur.version, interval,
               _ratio(cur.blocks_hit, cur.blocks_missed), new_trend[-60:], fill, lookups,
               traffic, dict(sorted(cur.leases.items())), share, mrc, headroom,
               cur.writeback_dropped, cur.checksum_failures, cur.mrc_samples, cur.verified,
               cur.mismatched)


def sparkline(values: Sequence[float], width: int = 20) -> str:
    """Hit ratios in [0, 1] as block characters (0 -> ▁, 1 -> █), the last `width`."""
    return "".join(SPARK[min(len(SPARK) - 1, max(0, int(v * len(SPARK))))]
                   for v in values[-width:])


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [r._asdict() for r in rows]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _bytes_rate(v: float) -> str:
    from kvtier.core.units import format_bytes

    return f"{format_bytes(int(v))}/s"


WIDE = 120
"""Terminals at least this wide get one table line per daemon; narrower ones (80 columns) a
block of labelled lines per daemon."""
COLUMNS = ("daemon", "hit ratio", "trend", "fill", "lookups/s", "traffic", "leases", "planner",
           "MRC headroom", "problems")


def _cells(r: Row) -> list[str]:
    """A daemon's values in `COLUMNS` order (after the daemon itself)."""
    if not r.ok:
        return ["[red]down[/red]", "", "", "", "", "", "", "", r.error]
    fill = " ".join(f"{k} {v:.0%}" for k, v in r.fill.items())
    if r.traffic_bytes_per_s is None:
        traffic = "(metrics URL)"
    else:
        out = r.traffic_bytes_per_s.get("dram/to_client", 0.0)
        inn = r.traffic_bytes_per_s.get("dram/from_client", 0.0)
        traffic = f"out {_bytes_rate(out)} in {_bytes_rate(inn)}"
    leases = " ".join(f"{k} {v:g}" for k, v in r.leases.items())
    if r.plan_share is None:
        planner = "(metrics URL)"
    else:
        planner = " ".join(f"{a.removeprefix('fetch_')} {r.plan_share[a]:.0%}"
                           for a in ACTIONS if r.plan_share[a])
    head = " ".join(f"{k} x2+: {100 * v:+.1f} pts" for k, v in r.mrc_headroom.items())
    if not r.mrc and r.mrc_samples is not None and r.mrc_samples < MIN_SAMPLES:
        head = f"warming up ({r.mrc_samples:.0f} of {MIN_SAMPLES} sampled blocks)"
    problems = []
    if r.writeback_dropped:
        problems.append(f"{r.writeback_dropped:g} write-backs dropped")
    if r.checksum_failures:
        problems.append(f"[red]{r.checksum_failures:g} checksum failures[/red]")
    if r.mismatched:
        problems.append(f"[red]{r.mismatched:g} of {r.verified:g} verified blocks wrong "
                        f"(quarantined)[/red]")
    verified = f" ({r.verified:g} blocks verified)" if r.verified and not r.mismatched else ""
    return [f"{_pct(r.hit_ratio)} (total {_pct(r.hit_ratio_total)})", sparkline(r.trend), fill,
            f"{r.lookups_per_s:.1f}", traffic, leases, planner or "-", head or "-",
            (", ".join(problems) or "none") + verified]


def render(rows: Sequence[Row], interval_s: float, width: int = WIDE) -> Any:
    """A rich renderable: a table of one line per daemon at `WIDE` columns or more, else one
    block of labelled lines per daemon (fits 80 columns)."""
    from rich.console import Group
    from rich.table import Table

    title = f"kvtier top — every {interval_s:g} s"
    if width >= WIDE:
        t = Table(title=title, expand=True)
        for col in COLUMNS:
            t.add_column(col, overflow="fold")
        for r in rows:
            cells = _cells(r)
            if r.ok:
                cells[0] = cells[0].replace(" (total", "\n(total")
            t.add_row(f"{r.source}\n{r.version}" if r.ok else r.source, *cells)
        return t
    blocks: list[Any] = [title]
    for r in rows:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        t.add_row("daemon", f"{r.source} {r.version}".strip())
        for name, value in zip(COLUMNS[1:], _cells(r), strict=True):
            if value:
                t.add_row(name, value)
        blocks.append(t)
    return Group(*blocks)
