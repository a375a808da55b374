"""Simulator speed: replaying the sample Mooncake trace through the real prefix index.

    python -m bench.simulate [--trace FILE] [--rounds 3]

Goal (issue 3): the whole sample trace (121,877 block references) replays in under 2 s on one
core at any capacity. Each configuration is replayed `--rounds` times; the median CPU seconds of
this process (`time.process_time`, not inflated by other processes on a shared machine) and the
median wall seconds are reported. Baselines, in the same run: the infinite-cache counting pass
(`kvtier.sim.ceilings.infinite_hits`, no eviction at all), and at every configuration a minimal
block-level LRU over an `OrderedDict` at the same total capacity (no tiers, leases, leaf-first
rule or admission: what the index's bookkeeping costs on top); the table gives replay / dict-LRU
CPU time. Belady MIN is timed too. Writes bench/results/simulate.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.sim.ceilings import belady, flatten, infinite_hits, next_uses
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import replay
from kvtier.sim.trace import Request, read_trace

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
RESULTS = Path(__file__).parent / "results" / "simulate.json"
GOAL_S = 2.0
CONFIGS = [
    TierConfig(440),  # ~1% of the 43,924 distinct blocks
    TierConfig(4_400),  # ~10%
    TierConfig(22_000),  # ~50%
    TierConfig(50_000),  # everything fits
    TierConfig(4_000, 16_000),  # k=2 with the default admission history (20,000 words)
    TierConfig(4_000, 16_000, admission_history=0),  # k=2, counts restart at a drop
    TierConfig(4_000, 16_000, ssd_admit_k=1),
    TierConfig(2_000, 40_000),
    TierConfig(2_000, 40_000, admission_history=0),
    TierConfig(4_400, 0, "slru"),
    TierConfig(4_000, 16_000, "slru"),
    TierConfig(100),  # requests longer than DRAM: the not-stored path
]


def _measure(fn: Callable[[], Any], rounds: int) -> tuple[float, float, Any]:
    cpu, wall = [], []
    out = None
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall), out


def dict_lru_hits(reqs: Sequence[Request], capacity: int) -> int:
    """Prefix hits of a plain per-block LRU (it may keep blocks whose parent it evicted)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in reqs:
        leading = True
        for h in r.hash_ids:
            if h in lru:
                lru.move_to_end(h)
                hits += leading
            else:
                leading = False
                lru[h] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
    return hits


def _label(c: TierConfig, history: int) -> str:
    return f"dram={c.dram_blocks} ssd={c.ssd_blocks} {c.policy} k={c.ssd_admit_k} h={history}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", default=str(SAMPLE))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    reqs = read_trace(args.trace)
    refs = flatten(reqs)
    n = len(refs)

    base_cpu, base_wall, inf = _measure(lambda: infinite_hits(reqs), args.rounds)
    nxt = next_uses(refs)
    rows: list[dict[str, Any]] = []
    print(f"{args.trace}: {len(reqs):,} requests, {n:,} block refs; rounds={args.rounds}")
    print(f"baseline (infinite-cache count): cpu {base_cpu * 1e3:.0f} ms, hit {inf / n:.4f}")
    head = f"{'configuration':<40} {'cpu s':>5} {'wall s':>6} {'dictLRU':>7} {'x':>5} {'hit':>6}"
    print(head + f" {'dLRUhit':>7} {'MIN':>6} {'MIN s':>5} {'SSD wr':>6}  goal<{GOAL_S:g}s")
    for cfg in CONFIGS:
        cpu, wall, stats = _measure(lambda c=cfg: replay(reqs, c), args.rounds)
        b_cpu, _, best = _measure(lambda c=cfg: belady(reqs, c.total_blocks, nxt).prefix_hits, 1)
        d_cpu, _, d_hits = _measure(lambda c=cfg: dict_lru_hits(reqs, c.total_blocks), 1)
        ok = cpu < GOAL_S
        label = _label(cfg, stats.history_size)
        rows.append(
            {
                "config": label,
                "dram_blocks": cfg.dram_blocks,
                "ssd_blocks": cfg.ssd_blocks,
                "policy": cfg.policy,
                "ssd_admit_k": cfg.ssd_admit_k,
                "admission_history": stats.history_size,
                "history_recalled": stats.history_recalled,
                "ssd_blocks_written": stats.ssd_blocks_written,
                "replay_cpu_s": cpu,
                "replay_wall_s": wall,
                "dict_lru_cpu_s": d_cpu,
                "ratio_to_dict_lru": cpu / d_cpu,
                "dict_lru_hit_ratio": d_hits / n,
                "refs_per_cpu_s": n / cpu,
                "hit_ratio": stats.hit_ratio,
                "belady_hit_ratio": best / n,
                "belady_cpu_s": b_cpu,
                "stranded_blocks": stats.stranded_blocks,
                "goal_met": ok,
            }
        )
        print(
            f"{label:<40} {cpu:5.2f} {wall:6.2f} {d_cpu:7.2f} {cpu / d_cpu:5.1f} "
            f"{stats.hit_ratio:6.4f} {d_hits / n:7.4f} {best / n:6.4f} {b_cpu:5.2f} "
            f"{stats.ssd_blocks_written:6}  "
            f"{'ok' if ok else 'MISSED'}"
        )
    worst = max(r["replay_cpu_s"] for r in rows)
    print(f"worst replay: {worst:.2f} s cpu ({'meets' if worst < GOAL_S else 'misses'} < 2 s)")
    doc = {
        "bench": "simulate",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "python": sys.version.split()[0],
        "command": "python -m bench.simulate " + " ".join(argv or sys.argv[1:]),
        "trace": args.trace,
        "requests": len(reqs),
        "block_refs": n,
        "rounds": args.rounds,
        "baseline": {"name": "infinite_hits", "cpu_s": base_cpu, "wall_s": base_wall},
        "median_replay_cpu_s": statistics.median(r["replay_cpu_s"] for r in rows),
        "median_ratio_to_dict_lru": statistics.median(r["ratio_to_dict_lru"] for r in rows),
        "worst_replay_cpu_s": worst,
        "goal_s": GOAL_S,
        "goal_met": worst < GOAL_S,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
