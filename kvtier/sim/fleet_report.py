"""A fleet simulation's result (`kvtier.sim.fleet`): JSON document, human table and plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvtier.core.units import format_bytes
from kvtier.sim.fleet import FleetResult, NodeCeiling
from kvtier.sim.sweep import save_plot


class FleetReport(NamedTuple):
    """A fleet replay with its ceilings; `cost_name`: the model prefill seconds are priced
    with (None: none given, no seconds)."""

    source: str
    distinct_blocks: int
    block_bytes: int | None
    result: FleetResult
    node_ceilings: list[NodeCeiling]
    pooled_belady_hits: int
    infinite_hits: int
    cost_name: str | None

    @property
    def refs(self) -> int:
        return sum(n.stats.block_refs for n in self.result.nodes)

    @property
    def hits(self) -> int:
        return sum(n.stats.hits for n in self.result.nodes)

    def tier_hits(self) -> dict[str, int]:
        nodes = self.result.nodes
        return {"dram": sum(n.stats.hits_dram for n in nodes),
                "ssd": sum(n.stats.hits_ssd for n in nodes),
                "remote": sum(n.stats.hits_remote for n in nodes)}

    @property
    def saved_s(self) -> float | None:
        saved = [n.saved_s for n in self.result.nodes]
        return None if any(s is None for s in saved) else sum(s or 0.0 for s in saved)

    @property
    def pooled_capacity(self) -> int:
        c = self.result.config
        return c.nodes * c.tiers.total_blocks + c.remote_blocks


def _ratio(n: float, d: float) -> float:
    return n / d if d else 0.0


def _bytes(blocks: int | None, block_bytes: int | None) -> int | None:
    return None if blocks is None or block_bytes is None else blocks * block_bytes


def to_json(r: FleetReport) -> dict[str, Any]:
    """The `--json` document of `kvtier simulate --nodes` (ratios are of block references)."""
    res, cfg, refs, bb = r.result, r.result.config, r.refs, r.block_bytes
    t = cfg.tiers
    th = r.tier_hits()
    nodes = []
    for i, (n, c) in enumerate(zip(res.nodes, r.node_ceilings, strict=True)):
        s = n.stats
        nodes.append({
            "node": i, "requests": s.requests, "block_refs": s.block_refs, "hits": s.hits,
            "hit_ratio": s.hit_ratio,
            "hit_ratio_by_tier": {"dram": _ratio(s.hits_dram, s.block_refs),
                                  "ssd": _ratio(s.hits_ssd, s.block_refs),
                                  "remote": _ratio(s.hits_remote, s.block_refs)},
            "belady_hit_ratio": _ratio(c.belady_hits, s.block_refs),
            "infinite_hit_ratio": _ratio(c.infinite_hits, s.block_refs),
            "prefill_tokens": n.missed_tokens, "peak_backlog_s": n.peak_backlog_s,
            "prefill_seconds_saved": n.saved_s, "promotions": s.promotions,
            "demotions": s.demotions, "ssd_blocks_written": s.ssd_blocks_written,
            "ssd_writes_refused": s.ssd_writes_refused, "stranded_blocks": s.stranded_blocks,
        })
    remote = None if res.remote_reads is None else {
        "remote_blocks_read": res.remote_reads,
        "remote_blocks_written": res.remote_writes,
        "remote_bytes_read": _bytes(res.remote_reads, bb),
        "remote_bytes_written": _bytes(res.remote_writes, bb),
        "remote_blocks_evicted": res.remote_evicted,
        "remote_writes_dropped": res.remote_dropped,
        "remote_write_bytes_per_s": cfg.remote_write_bytes_per_s,
    }
    return {
        "source": r.source,
        "requests": len(res.assignment),
        "block_refs": refs,
        "distinct_blocks": r.distinct_blocks,
        "nodes": cfg.nodes,
        "routing": cfg.routing,
        "event_lag_s": cfg.event_lag_s,
        "balance": cfg.balance if cfg.balance != float("inf") else None,
        "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
        "capacity": {
            "dram_blocks": t.dram_blocks, "ssd_blocks": t.ssd_blocks, "block_bytes": bb,
            "dram_bytes": _bytes(t.dram_blocks, bb), "ssd_bytes": _bytes(t.ssd_blocks, bb),
            "remote_blocks": cfg.remote_blocks, "remote_bytes": _bytes(cfg.remote_blocks, bb),
        },
        "policy": t.policy,
        "ssd_admit_k": t.ssd_admit_k,
        "hits": r.hits,
        "hit_ratio": _ratio(r.hits, refs),
        "hit_ratio_by_tier": {k: _ratio(v, refs) for k, v in th.items()},
        "requests_per_node": res.requests_per_node,
        "imbalance": res.imbalance,
        "work_imbalance": res.work_imbalance,
        "prefill_seconds_saved": r.saved_s,
        "cost_model": r.cost_name,
        "network": remote,
        "belady_per_node_hit_ratio": _ratio(sum(c.belady_hits for c in r.node_ceilings), refs),
        "pooled_belady_hit_ratio": _ratio(r.pooled_belady_hits, refs),
        "pooled_capacity_blocks": r.pooled_capacity,
        "infinite_hit_ratio": _ratio(r.infinite_hits, refs),
        "stranded_blocks": sum(n.stats.stranded_blocks for n in res.nodes),
        "per_node": nodes,
        "replay_seconds": res.seconds,
        "replay_cpu_seconds": res.cpu_seconds,
    }


def _cap(blocks: int, block_bytes: int | None) -> str:
    text = f"{blocks:,} blocks"
    return text if block_bytes is None else f"{text} ({format_bytes(blocks * block_bytes)})"


def _lag(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if 0 < seconds < 1 else f"{seconds:g} s"


def routing_line(r: FleetReport) -> str:
    cfg = r.result.config
    if cfg.routing == "prefix-aware":
        guard = ("no load guard" if cfg.balance == float("inf")
                 else f"at most {cfg.balance:g}x the mean requests per node")
        what = f"prefix-aware (router sees node contents {_lag(cfg.event_lag_s)} late; {guard})"
    elif cfg.routing == "least-loaded":
        what = "least-loaded (smallest queued prefill)"
    else:
        what = "round-robin"
    return f"routing: {what}; prefill {cfg.prefill_tokens_per_s:,.0f} tokens/s per node"


def format_table(r: FleetReport) -> str:
    """The human report of `kvtier simulate --nodes` without `--json`."""
    res, cfg, refs, bb = r.result, r.result.config, r.refs, r.block_bytes
    t = cfg.tiers
    remote = "no shared remote tier"
    if cfg.remote_blocks:
        rate = cfg.remote_write_bytes_per_s
        remote = (f"shared remote tier {_cap(cfg.remote_blocks, bb)}, written at " + (
            "any rate" if rate is None else f"up to {format_bytes(int(rate))}/s per node"))
    head = [
        f"{r.source}: {len(res.assignment):,} requests, {refs:,} block refs (512 tokens each), "
        f"{r.distinct_blocks:,} distinct blocks",
        f"fleet: {cfg.nodes} nodes, each DRAM {_cap(t.dram_blocks, bb)}, SSD "
        f"{_cap(t.ssd_blocks, bb)}; policy {t.policy}; SSD admission on access {t.ssd_admit_k}; "
        f"{remote}",
        routing_line(r),
        "",
    ]
    cols = ("node", "requests", "block refs", "hit ratio", "DRAM", "SSD", "remote",
            "Belady MIN", "peak queue")
    rows: list[tuple[str, ...]] = []
    for i, (n, c) in enumerate(zip(res.nodes, r.node_ceilings, strict=True)):
        s = n.stats
        rows.append((str(i), f"{s.requests:,}", f"{s.block_refs:,}", f"{s.hit_ratio:.1%}",
                     f"{_ratio(s.hits_dram, s.block_refs):.1%}",
                     f"{_ratio(s.hits_ssd, s.block_refs):.1%}",
                     f"{_ratio(s.hits_remote, s.block_refs):.1%}",
                     f"{_ratio(c.belady_hits, s.block_refs):.1%}", f"{n.peak_backlog_s:.1f} s"))
    th = r.tier_hits()
    belady_sum = sum(c.belady_hits for c in r.node_ceilings)
    rows.append(("fleet", f"{len(res.assignment):,}", f"{refs:,}", f"{_ratio(r.hits, refs):.1%}",
                 f"{_ratio(th['dram'], refs):.1%}", f"{_ratio(th['ssd'], refs):.1%}",
                 f"{_ratio(th['remote'], refs):.1%}", f"{_ratio(belady_sum, refs):.1%}",
                 f"{max(n.peak_backlog_s for n in res.nodes):.1f} s"))
    widths = [max(len(x[k]) for x in [cols, *rows]) for k in range(len(cols))]
    grid = ["  ".join(x[k].rjust(widths[k]) if k else x[k].ljust(widths[k])
                      for k in range(len(cols))) for x in [cols, *rows]]
    saved = r.saved_s
    lines: list[tuple[str, str, str]] = [
        ("fleet prefix hits", f"{r.hits:,}", f"{_ratio(r.hits, refs):.1%}"),
        ("ceiling: Belady MIN per node (sum)", f"{belady_sum:,}",
         f"{_ratio(belady_sum, refs):.1%}"),
        (f"ceiling: one pooled cache, Belady MIN at {r.pooled_capacity:,} blocks",
         f"{r.pooled_belady_hits:,}", f"{_ratio(r.pooled_belady_hits, refs):.1%}"),
        ("ceiling: infinite cache", f"{r.infinite_hits:,}",
         f"{_ratio(r.infinite_hits, refs):.1%}"),
        ("load imbalance (max / mean requests per node)", f"{res.imbalance:.2f}",
         "requests " + " ".join(str(c) for c in res.requests_per_node)),
        ("prefill work imbalance (max / mean tokens)", f"{res.work_imbalance:.2f}", ""),
        ("prefill seconds saved (planner)",
         "n/a" if saved is None else f"{saved:,.1f} s",
         "give --preset or --hf-config" if saved is None else f"{r.cost_name}"),
    ]
    if res.remote_reads is not None:
        lines += [
            ("network: blocks read from the remote tier", f"{res.remote_reads:,}",
             "" if bb is None else format_bytes(res.remote_reads * bb)),
            ("network: blocks written to the remote tier", f"{res.remote_writes:,}",
             "" if bb is None or res.remote_writes is None
             else format_bytes(res.remote_writes * bb)),
            ("remote writes dropped by the write rate", f"{res.remote_dropped:,}", ""),
            ("evicted from the remote tier", f"{res.remote_evicted:,}", ""),
        ]
    lines += [
        ("stranded blocks (checked on every node)",
         f"{sum(n.stats.stranded_blocks for n in res.nodes):,}", ""),
        ("replay time (wall)", f"{res.seconds:.2f} s", f"{res.cpu_seconds:.2f} s CPU"),
    ]
    w0 = max(len(a) for a, _, _ in lines)
    w1 = max(len(b) for _, b, _ in lines)
    body = [f"{a:<{w0}}  {b:>{w1}}  {x}".rstrip() for a, b, x in lines]
    foot = [
        "",
        "hits = longest cached prefix of each request on its node (then the remote tier); Belady",
        "MIN per node = the best that node's DRAM+SSD could do on the requests routed to it;",
        "pooled = the best any fleet of this total capacity could do (kvtier.sim.fleet)",
    ]
    return "\n".join([*head, *grid, "", *body, *foot])


def compare_json(reports: Sequence[FleetReport]) -> list[dict[str, Any]]:
    """One row per routing of the `--plot` comparison."""
    return [{"routing": r.result.config.routing, "hit_ratio": _ratio(r.hits, r.refs),
             "imbalance": r.result.imbalance,
             "per_node_hit_ratio": [n.stats.hit_ratio for n in r.result.nodes],
             "prefill_seconds_saved": r.saved_s} for r in reports]


def plot(reports: Sequence[FleetReport], title: str, path: str) -> None:
    """Fleet hit ratio and imbalance per routing (left), each node's hit ratio per routing
    (right), with the pooled Belady MIN and infinite ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = reports[0]
    refs = first.refs
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5), dpi=120,
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    names = [r.result.config.routing for r in reports]
    ratios = [_ratio(r.hits, r.refs) for r in reports]
    bars = left.bar(names, ratios, color=["tab:gray", "tab:orange", "tab:blue"][: len(names)])
    for bar, r in zip(bars, reports, strict=True):
        left.annotate(f"{bar.get_height():.1%}\nimbalance {r.result.imbalance:.2f}",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    for ax in (left, right):
        ax.axhline(_ratio(first.pooled_belady_hits, refs), color="tab:green", linestyle="--",
                   label=f"pooled Belady MIN ({first.pooled_capacity:,} blocks)")
        ax.axhline(_ratio(first.infinite_hits, refs), color="gray", linestyle=":",
                   label="infinite cache")
        ax.set_ylim(0, 1)
        ax.grid(True, axis="y", alpha=0.3)
    left.set_ylabel("fleet prefix-hit ratio")
    left.tick_params(axis="x", labelsize=8)
    for r in reports:
        xs = list(range(len(r.result.nodes)))
        right.plot(xs, [n.stats.hit_ratio for n in r.result.nodes], "o-",
                   label=r.result.config.routing)
    right.set_xlabel("node")
    right.set_ylabel("node prefix-hit ratio")
    right.legend(loc="upper right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_plot(fig, path)
