"""Hit ratio of every index policy at small capacities, against LRU, the best peer and Belady MIN.

    python -m bench.policies [--trace FILE] [--seeds 3] [--requests 2000] [--jobs 1] [--quick]

Workloads: the shared Mooncake trace (``../shared/traces/synthetic_trace.jsonl`` next to the
repository, or ``--trace``; skipped with a note when absent) and the generators of
`kvtier.sim.workloads` — chat, docqa, agentic, rag, longreuse, docchat, tenants, and the
held-out drift and conversation (the latter at 6x ``--requests``) — at ``--seeds`` seeds each.
Every policy of
`kvtier.index.policies.POLICIES` (``lmcache-lfu`` is ``sglang-lfu``, run once) is replayed
through the real index (`kvtier.sim.replay`) DRAM-only at 1, 2, 5, 10 and 20% of the workload's
distinct blocks, and Belady MIN is computed at each capacity. A two-tier run per workload (DRAM
2% + SSD 8% of the distinct blocks, SSD admission k = 2) adds the SSD blocks written.

Per workload and capacity (hit ratios averaged over seeds): kvtier's hit ratio, LRU's, the best
peer's (`PEERS`, by mean hit ratio), kvtier / LRU, kvtier / best peer, kvtier / Belady, Belady / LRU
(the clairvoyant bound on any policy's ×LRU: where it is under 1.2 no policy can reach the 1.2x
goal) and the worst seed's kvtier / LRU; the best peer is the best of LRU and every peer, so
×peer is kvtier / max(LRU, every peer). The summary row is the minimum over the DRAM-only cells of
×LRU, of ×peer (goals: >= 0.99 and >= 0.97 in every cell, the held-out shapes' too, and >= 1.2x
LRU at 1% on the shared trace) and of kvtier / max(LRU, vllm-reuse). Per cell also kvtier's mode
switches (mean over seeds) and the smallest gain over LRU its window resolved for the probation
(S3-FIFO-like) mode at the run's end, relative to LRU's hits: where that is above the gain the
mode would bring, kvtier stays exactly LRU. The
held-out shapes `drift` and `conversation` (`kvtier.sim.workloads.HELD_OUT`, never used to tune
the policy) are run too, kept out of the summary row (they have their own minimum row) but not
out of the every-cell goals. Earlier goals:
kvtier >= 1.2x LRU at 1-5%, never below LRU by more than 1% anywhere, ahead of the best peer at
<= 5%, replay CPU time <= 2x LRU's (median over all DRAM-only runs). Also the kvtier policy's
own state (sketch, predictor, tracker, history)
in bytes per block of capacity. Writes bench/results/policies.json, the table as policies.md and one
PNG per workload (bench/results/policies_<workload>.png). ``--quick``: 1 seed, 400 requests, trace
cut to 600 requests, capacities 2% and 5% — a smoke run for CI.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.index.policies import PEERS, POLICIES
from kvtier.index.policies.adaptive.policy import AdaptivePolicy
from kvtier.sim.ceilings import belady, flatten, next_uses
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import new_index, replay
from kvtier.sim.trace import Request, read_trace
from kvtier.sim.workloads import HELD_OUT, WORKLOADS, generate

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
RESULTS = Path(__file__).parent / "results"
CAPACITIES = (0.01, 0.02, 0.05, 0.10, 0.20)
TWO_TIER = (0.02, 0.08)
OURS = "kvtier"
RUN = [p for p in POLICIES if p != "lmcache-lfu"]
LONG = {"conversation": 6}
"""Workloads run at this many times ``--requests``: the held-out conversation shape at 12,000
requests by default, the length of the production conversation trace it stands for (its warm-up
is part of its character)."""
S3 = 0.1
"""kvtier's probation (S3-FIFO-like) mode: the candidate whose resolution the table shows."""
FILTER = "vllm-reuse"
"""The reuse filter: with LRU, the candidates issue 29 bounds kvtier by (x max(LRU, filter))."""


def _workloads(args: argparse.Namespace) -> list[tuple[str, int, list[Request]]]:
    out: list[tuple[str, int, list[Request]]] = []
    trace = Path(args.trace)
    if trace.exists():
        reqs = read_trace(trace)
        out.append(("trace", 0, reqs[: args.trace_requests] if args.trace_requests else reqs))
    else:
        print(f"note: {trace} not found: the shared trace is skipped (--trace FILE)")
    for name in WORKLOADS + HELD_OUT:
        for seed in range(args.seeds):
            out.append((name, seed, generate(name, args.requests * LONG.get(name, 1), seed)))
    return out


def _run(name: str, seed: int, reqs: Sequence[Request], fracs: Sequence[float]
         ) -> list[dict[str, Any]]:
    refs = flatten(reqs)
    distinct = len(set(refs))
    nxt = next_uses(refs)
    rows: list[dict[str, Any]] = []
    for f in fracs:
        cap = max(1, round(distinct * f))
        best = belady(reqs, cap, nxt).prefix_hits / len(refs)
        for pol in RUN:
            cfg = TierConfig(cap, 0, pol)
            idx = new_index(cfg)
            s = replay(reqs, cfg, index=idx)
            row = {"workload": name, "seed": seed, "tiers": "dram", "fraction": f,
                   "dram_blocks": cap, "ssd_blocks": 0, "policy": pol,
                   "hit_ratio": s.hit_ratio, "belady_hit_ratio": best,
                   "cpu_s": s.cpu_seconds, "ssd_blocks_written": s.ssd_blocks_written,
                   "bypassed": s.bypassed, "stranded_blocks": s.stranded_blocks}
            if isinstance(idx._policy, AdaptivePolicy):
                row["policy_state_bytes"] = idx._policy.nbytes() + idx.history.nbytes()
                ms = idx._policy.minisims
                row["mode_switches"] = ms.switches
                row["final_mode"] = ms.best
                row["resolution"] = ms.resolution  # {candidate mode: smallest gain resolved}
            rows.append(row)
    dram, ssd = (max(1, round(distinct * x)) for x in TWO_TIER)
    best = belady(reqs, dram + ssd, nxt).prefix_hits / len(refs)
    for pol in RUN:
        s = replay(reqs, TierConfig(dram, ssd, pol))
        rows.append({"workload": name, "seed": seed, "tiers": "dram+ssd",
                     "fraction": TWO_TIER[0] + TWO_TIER[1], "dram_blocks": dram,
                     "ssd_blocks": ssd, "policy": pol, "hit_ratio": s.hit_ratio,
                     "belady_hit_ratio": best, "cpu_s": s.cpu_seconds,
                     "ssd_blocks_written": s.ssd_blocks_written, "bypassed": s.bypassed,
                     "stranded_blocks": s.stranded_blocks})
    print(f"  {name} seed {seed}: {len(reqs):,} requests, {len(refs):,} refs, "
          f"{distinct:,} distinct blocks", flush=True)
    return rows


def ratio(a: float, b: float) -> float:
    """a / b, 1 when both are 0 (a cell where nothing hits: a policy ties, it does not lose)."""
    return 1.0 if a == b else a / max(b, 1e-12)


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (workload, tiers, fraction): means over seeds and the ratios of the goals."""
    groups: dict[tuple[str, str, float], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        groups[(r["workload"], r["tiers"], r["fraction"])][r["policy"]].append(r)
    out = []
    for (w, tiers, f), by in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        mean = {p: statistics.fmean(x["hit_ratio"] for x in rs) for p, rs in by.items()}
        peer = max((p for p in PEERS if p in mean), key=lambda p: mean[p])
        ours, lru = mean[OURS], mean["lru"]
        bound = max(lru, mean.get(FILTER, 0.0))
        per_seed = [ratio(o["hit_ratio"], lr["hit_ratio"])
                    for o, lr in zip(by[OURS], by["lru"], strict=True)]
        out.append({
            "workload": w, "tiers": tiers, "fraction": f, "seeds": len(by[OURS]),
            "kvtier": ours, "lru": lru, "best_peer": peer, "best_peer_hit": mean[peer],
            "belady": statistics.fmean(x["belady_hit_ratio"] for x in by[OURS]),
            "vs_lru": ratio(ours, lru), "vs_peer": ratio(ours, mean[peer]),
            "vs_filter": ratio(ours, bound), "held_out": w in HELD_OUT,
            "vs_belady": ours / max(statistics.fmean(x["belady_hit_ratio"] for x in by[OURS]),
                                    1e-12),
            "belady_vs_lru": statistics.fmean(x["belady_hit_ratio"] for x in by[OURS])
            / max(lru, 1e-12),
            "worst_seed_vs_lru": min(per_seed),
            "ssd_written": {p: statistics.fmean(x["ssd_blocks_written"] for x in rs)
                            for p, rs in by.items()},
            "switches": statistics.fmean(x.get("mode_switches", 0) for x in by[OURS]),
            "resolution": _mean_resolution(by[OURS]),
            "hit": mean,
        })
    return out


def _mean_resolution(rows: Sequence[dict[str, Any]]) -> float | None:
    """Mean over seeds of the smallest gain over LRU that kvtier's window resolved at the run's
    end for its probation candidate (None where it has none: two tiers, or LRU never hit)."""
    xs = [r["resolution"][S3] for r in rows if S3 in r.get("resolution", {})]
    return statistics.fmean(xs) if xs else None


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(max(x, 1e-12)) for x in xs))


def goals(summary: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    dram = [s for s in summary if s["tiers"] == "dram" and not s.get("held_out", False)]
    small = [s for s in dram if s["fraction"] <= 0.05 + 1e-9]
    cpu = defaultdict(list)
    for r in rows:
        if r["tiers"] == "dram":
            cpu[(r["workload"], r["seed"], r["fraction"])].append(r)
    time_ratios = []
    for rs in cpu.values():
        by = {r["policy"]: r["cpu_s"] for r in rs}
        time_ratios.append(by[OURS] / max(by["lru"], 1e-9))
    state = [r["policy_state_bytes"] / r["dram_blocks"] for r in rows
             if r["policy"] == OURS and "policy_state_bytes" in r]
    worst_lru = min(s["vs_lru"] for s in dram)
    worst_peer = min(s["vs_peer"] for s in dram)
    worst_filter = min(s["vs_filter"] for s in dram)
    trace_1 = [s["vs_lru"] for s in dram if s["workload"] == "trace" and s["fraction"] == 0.01]
    every = [s for s in summary if s["tiers"] == "dram"]  # the held-out shapes too
    return {
        "min_vs_lru_every_cell": min(s["vs_lru"] for s in every),
        "min_vs_best_peer_every_cell": min(s["vs_peer"] for s in every),
        "goal_lru_099_and_peer_097_every_cell": (min(s["vs_lru"] for s in every) >= 0.99
                                                 and min(s["vs_peer"] for s in every) >= 0.97),
        "goal_trace_1_2x_lru_at_1pct": trace_1[0] >= 1.2 if trace_1 else None,
        "min_vs_best_peer_anywhere": worst_peer,
        "goal_bounded_by_candidates": worst_lru >= 0.99 and worst_peer >= 0.97,
        "min_vs_lru_or_reuse_filter": worst_filter,
        "goal_099_of_lru_or_reuse_filter": worst_filter >= 0.99,
        "held_out_min_row": minimum(summary, held_out=True),
        "trace_vs_lru_at_1pct": trace_1[0] if trace_1 else None,
        "goal_trace_1_5x_lru_at_1pct": trace_1[0] >= 1.5 if trace_1 else None,
        "geomean_vs_lru": _geomean([s["vs_lru"] for s in dram]),
        "geomean_vs_lru_at_1_5pct": _geomean([s["vs_lru"] for s in small]) if small else None,
        "min_vs_lru_at_1_5pct": min(s["vs_lru"] for s in small) if small else None,
        "goal_1_2x_lru_at_1_5pct": all(s["vs_lru"] >= 1.2 for s in small),
        "cells_1_5pct_where_belady_under_1_2x_lru": [
            f"{s['workload']} {s['fraction']:.0%}" for s in small if s["belady_vs_lru"] < 1.2],
        "min_vs_lru_anywhere": worst_lru,
        "goal_never_below_lru_1pct": worst_lru >= 0.99,
        "min_vs_best_peer_at_1_5pct": min(s["vs_peer"] for s in small) if small else None,
        "goal_ahead_of_best_peer_at_1_5pct": all(s["vs_peer"] > 1.0 for s in small),
        "median_replay_time_vs_lru": statistics.median(time_ratios),
        "max_replay_time_vs_lru": max(time_ratios),
        "goal_replay_time_2x": statistics.median(time_ratios) <= 2.0,
        "kvtier_state_bytes_per_capacity_block_median": statistics.median(state) if state else None,
        "kvtier_state_bytes_per_capacity_block_max": max(state) if state else None,
    }


def minimum(summary: Sequence[dict[str, Any]], held_out: bool = False) -> dict[str, Any] | None:
    """The summary row: the worst DRAM-only cell of kvtier / LRU, of kvtier / max(LRU, the reuse
    filter) and of kvtier / max(LRU, every peer), and where each is — over the tuned workloads,
    or with `held_out` over the held-out ones (None when there is no such cell)."""
    dram = [s for s in summary if s["tiers"] == "dram" and s.get("held_out", False) == held_out]
    if not dram:
        return None
    lo_lru = min(dram, key=lambda s: s["vs_lru"])
    lo_filter = min(dram, key=lambda s: s["vs_filter"])
    lo_peer = min(dram, key=lambda s: s["vs_peer"])
    return {"vs_lru": lo_lru["vs_lru"],
            "vs_lru_at": f"{lo_lru['workload']} {lo_lru['fraction']:.0%}",
            "vs_filter": lo_filter["vs_filter"],
            "vs_filter_at": f"{lo_filter['workload']} {lo_filter['fraction']:.0%}",
            "vs_peer": lo_peer["vs_peer"],
            "vs_peer_at": f"{lo_peer['workload']} {lo_peer['fraction']:.0%} "
                          f"({lo_peer['best_peer']})"}


def print_table(summary: Sequence[dict[str, Any]]) -> None:
    print(f"{'workload':<8} {'tiers':<8} {'cap':>4} {'kvtier':>7} {'LRU':>7} {'best peer':<15}"
          f"{'hit':>7} {'xLRU':>6} {'xpeer':>6} {'xMIN':>6} {'MINxLRU':>7} {'worst':>6} "
          f"{'sw':>4} {'res':>5} {'SSD wr k/LRU':>13}")
    for s in summary:
        ssd = s["ssd_written"]
        wr = f"{ssd[OURS]:.0f}/{ssd['lru']:.0f}" if s["tiers"] != "dram" else ""
        res = "" if s.get("resolution") is None else f"{s['resolution']:.2f}"
        print(f"{s['workload']:<8} {s['tiers']:<8} {s['fraction']:4.0%} {s['kvtier']:7.4f} "
              f"{s['lru']:7.4f} {s['best_peer']:<15}{s['best_peer_hit']:7.4f} "
              f"{s['vs_lru']:6.2f} {s['vs_peer']:6.2f} {s['vs_belady']:6.2f} "
              f"{s['belady_vs_lru']:7.2f} {s['worst_seed_vs_lru']:6.2f} "
              f"{s.get('switches', 0):4.1f} {res:>5} {wr:>13}")
    for held, what in ((False, "tuned"), (True, "held-out")):
        lo = minimum(summary, held)
        if lo is not None:
            print(f"min over {what} DRAM cells: xLRU {lo['vs_lru']:.3f} ({lo['vs_lru_at']}), "
                  f"x max(LRU, reuse filter) {lo['vs_filter']:.3f} ({lo['vs_filter_at']}), "
                  f"xbest peer {lo['vs_peer']:.3f} ({lo['vs_peer_at']})")


def markdown(summary: Sequence[dict[str, Any]]) -> str:
    """The table of `print_table` as Markdown (for docs/benchmarks.md and docs/simulation.md)."""
    lines = ["| workload | tiers | capacity | kvtier | LRU | best peer | peer hit | ×LRU | ×peer "
             "| ×Belady | Belady ×LRU | worst seed ×LRU | switches | resolved | "
             "SSD writes kvtier / LRU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        ssd = s["ssd_written"]
        wr = f"{ssd[OURS]:,.0f} / {ssd['lru']:,.0f}" if s["tiers"] != "dram" else ""
        lines.append(
            f"| {s['workload']} | {s['tiers']} | {s['fraction']:.0%} | {s['kvtier']:.4f} | "
            f"{s['lru']:.4f} | {s['best_peer']} | {s['best_peer_hit']:.4f} | {s['vs_lru']:.2f} | "
            f"{s['vs_peer']:.2f} | {s['vs_belady']:.2f} | {s['belady_vs_lru']:.2f} | "
            f"{s['worst_seed_vs_lru']:.2f} | {s.get('switches', 0):.1f} | "
            f"{'' if s.get('resolution') is None else format(s['resolution'], '.2f')} | {wr} |")
    for held, what in ((False, "DRAM cells"), (True, "held-out DRAM cells")):
        lo = minimum(summary, held)
        if lo is not None:
            lines.append(f"| **min** ({what}) | dram | 1–20% | | | {lo['vs_peer_at']} | | "
                         f"**{lo['vs_lru']:.3f}** ({lo['vs_lru_at']}) | **{lo['vs_peer']:.3f}** "
                         f"| | | | | | |")
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict[str, Any]], workload: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [s for s in summary if s["workload"] == workload and s["tiers"] == "dram"]
    xs = [s["fraction"] * 100 for s in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot(xs, [s["belady"] for s in pts], "k--", label="Belady MIN")
    for pol in RUN:
        style = "o-" if pol == OURS else ".-"
        lw = 2.5 if pol == OURS else 1.0
        ax.plot(xs, [s["hit"][pol] for s in pts], style, lw=lw, label=pol)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}%" for x in xs])
    ax.set_xlabel("DRAM capacity (% of distinct blocks)")
    ax.set_ylabel("prefix-hit ratio")
    ax.set_title(f"{workload}: hit ratio by policy (mean over {pts[0]['seeds']} seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    ap.add_argument("--trace", default=str(SAMPLE), help="Mooncake JSONL trace (the shared one)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="requests per generated workload")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, small workloads")
    ap.add_argument("--jobs", type=int, default=1,
                    help="replay the workloads in this many processes (the replay is "
                    "deterministic: the same figures, not the same CPU times)")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON and PNGs")
    args = ap.parse_args(argv)
    args.trace_requests = 0
    fracs: Sequence[float] = CAPACITIES
    if args.quick:
        args.seeds, args.requests, args.trace_requests = 1, 400, 600
        fracs = (0.02, 0.05)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"policies: {', '.join(RUN)}; capacities {', '.join(f'{f:.0%}' for f in fracs)}")
    rows: list[dict[str, Any]] = []
    loads = _workloads(args)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for part in pool.map(_run, *zip(*loads, strict=True), [fracs] * len(loads)):
                rows.extend(part)
    else:
        for name, seed, reqs in loads:
            rows.extend(_run(name, seed, reqs, fracs))
    summary = summarise(rows)
    print_table(summary)
    g = goals(summary, rows)
    g["min_row"] = minimum(summary)
    for k, v in g.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    plots = []
    try:
        for w in sorted({s["workload"] for s in summary}):
            path = out_dir / f"policies_{w}.png"
            plot(summary, w, path)
            plots.append(str(path))
    except ImportError:
        print("note: matplotlib missing, no plots")
    doc = {
        "bench": "policies",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "python": sys.version.split()[0],
        "command": "python -m bench.policies " + " ".join(argv or sys.argv[1:]),
        "policies": {p: POLICIES[p].source for p in POLICIES},
        "goals": g,
        "summary": summary,
        "rows": rows,
        "plots": plots,
    }
    path = out_dir / "policies.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "policies.md").write_text(markdown(summary))
    print(f"wrote {path} and {len(plots)} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
