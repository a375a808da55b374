"""Fleet routing on the shared trace: what prefix-aware routing and a shared remote tier are worth.

    python -m bench.fleet [--trace FILE] [--nodes 8] [--out FILE.json]

Runs `kvtier simulate --nodes` (the CLI, `--json`, one process per row) on the shared Mooncake
trace: 8 nodes of Llama-3-8B, each with 32 GiB DRAM and 128 GiB SSD (the fleet's total is
docs/simulation.md's single-node trace example, 256 GiB + 1 TiB), with round-robin, least-loaded and
prefix-aware routing, without and with a shared 1 TiB remote tier (written at kvtier serve's default
rate, 200 MB/s per node, and without a write limit); then prefix-aware with its router seeing node
contents 1 s and 10 s late, without its load guard, and with the remote fetched at 12.5 GB/s (100
GbE) instead of kvtier serve's seed (1.2 GB/s). Baselines in the same run: round-robin (the router
that sees nothing) and one node holding the fleet's whole capacity.

Issue 26's goal: prefix-aware routing with load imbalance (max / mean requests per node) <= 1.25.
Prints a table and writes JSON (default: a file in the temp directory; the path is printed).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
GOAL_IMBALANCE = 1.25
MODEL = ["--preset", "Llama-3-8B"]
NODE = ["--dram-bytes", "32GiB", "--ssd-bytes", "128GiB"]
REMOTE = ["--remote-bytes", "1TiB"]
UNLIMITED = [*REMOTE, "--remote-write-rate", "off"]
REMOTES = [("", []), (", remote 1 TiB", REMOTE), (", remote 1 TiB, writes unlimited", UNLIMITED)]


def rows(nodes: int) -> list[tuple[str, list[str]]]:
    fleet = [*NODE, "--nodes", str(nodes)]
    out: list[tuple[str, list[str]]] = []
    for suffix, remote in REMOTES:
        for routing in ("round-robin", "least-loaded", "prefix-aware"):
            out.append((f"{routing}{suffix}", [*fleet, "--routing", routing, *remote]))
    out += [
        ("prefix-aware, events 1 s late", [*fleet, "--routing", "prefix-aware",
                                           "--event-lag", "1s"]),
        ("prefix-aware, events 10 s late", [*fleet, "--routing", "prefix-aware",
                                            "--event-lag", "10s"]),
        ("prefix-aware, no load guard", [*fleet, "--routing", "prefix-aware",
                                         "--balance", "inf"]),
        ("prefix-aware, remote unlimited, 12.5 GB/s", [*fleet, "--routing", "prefix-aware",
                                                       *UNLIMITED, "--remote-bandwidth",
                                                       "12.5GB"]),
        ("one node, 256 GiB DRAM + 1 TiB SSD", ["--dram-bytes", "256GiB", "--ssd-bytes",
                                                "1TiB"]),
    ]
    return out


def simulate(trace: Path, args: list[str]) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, "-m", "kvtier", "simulate", "--trace", str(trace), *MODEL, *args,
           "--json", "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout), time.perf_counter() - t0


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**40:.2f} TiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", type=Path, default=SAMPLE)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--out", type=Path,
                    default=Path(tempfile.gettempdir()) / "kvtier-bench-fleet.json")
    a = ap.parse_args(argv)
    results = []
    head = (f"{'configuration':<44} {'hit':>6} {'DRAM':>6} {'SSD':>6} {'remote':>6} "
            f"{'imbal':>6} {'work':>5} {'saved s':>8} {'net read':>10} {'net write':>10} "
            f"{'Belady/node':>11} {'pooled':>6} {'run s':>6}")
    print(head, flush=True)
    for name, args in rows(a.nodes):
        doc, wall = simulate(a.trace, args)
        fleet = "nodes" in doc
        tiers = doc["hit_ratio_by_tier"]
        net = doc.get("network") or {}
        row = {
            "name": name, "args": args, "hit_ratio": doc["hit_ratio"],
            "dram": tiers["dram"], "ssd": tiers["ssd"], "remote": tiers.get("remote", 0.0),
            "imbalance": doc["imbalance"] if fleet else 1.0,
            "work_imbalance": doc["work_imbalance"] if fleet else 1.0,
            "prefill_seconds_saved": doc.get("prefill_seconds_saved"),
            "remote_bytes_read": net.get("remote_bytes_read"),
            "remote_bytes_written": net.get("remote_bytes_written"),
            "belady_per_node": doc["belady_per_node_hit_ratio"] if fleet
            else doc["belady_hit_ratio"],
            "pooled_belady": doc["pooled_belady_hit_ratio"] if fleet
            else doc["belady_hit_ratio"],
            "wall_s": wall,
        }
        results.append(row)
        saved = row["prefill_seconds_saved"]
        print(f"{name:<44} {row['hit_ratio']:>6.1%} {row['dram']:>6.1%} {row['ssd']:>6.1%} "
              f"{row['remote']:>6.1%} {row['imbalance']:>6.2f} {row['work_imbalance']:>5.2f} "
              f"{'-' if saved is None else f'{saved:,.0f}':>8} "
              f"{_gib(row['remote_bytes_read']):>10} {_gib(row['remote_bytes_written']):>10} "
              f"{row['belady_per_node']:>11.1%} {row['pooled_belady']:>6.1%} {wall:>6.1f}",
              flush=True)
    rr = next(r for r in results if r["name"] == "round-robin")
    pa = next(r for r in results if r["name"] == "prefix-aware")
    aware = [r for r in results if r["name"].startswith("prefix-aware")]
    worst = max(r["imbalance"] for r in aware)
    reached = worst <= GOAL_IMBALANCE
    print(f"\nprefix-aware / round-robin hit ratio (no remote): "
          f"{pa['hit_ratio'] / rr['hit_ratio']:.2f}x; prefix-aware imbalance at most {worst:.2f} "
          f"over its rows; goal <= {GOAL_IMBALANCE}: {'reached' if reached else 'NOT reached'}")
    doc_out = {
        "bench": "fleet", "trace": str(a.trace), "nodes": a.nodes,
        "when": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "goal_imbalance": GOAL_IMBALANCE, "goal_reached": reached, "rows": results,
    }
    a.out.write_text(json.dumps(doc_out, indent=2) + "\n")
    print(f"results: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
