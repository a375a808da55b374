"""A fast sweep of one policy (or a variant of it) against LRU and the peers, for policy work.

    python -m bench.policy_sweep [--policy kvtier] [--patch FILE] [--peers] [--jobs 2]

The same replays as `bench.policies` (the real index through `kvtier.sim.replay`; the shared trace
and every generator of `kvtier.sim.workloads.WORKLOADS` at ``--seeds`` seeds x ``--requests``
requests — ``--held-out`` adds the held-out shapes, to check a variant on traffic it was not
tuned on; DRAM-only at 1, 2, 5, 10, 20% of each workload's distinct blocks plus DRAM 2% + SSD 8%),
but only the policy under test and LRU (and with ``--peers`` every peer of
`kvtier.index.policies.PEERS`), no Belady, in ``--jobs`` processes: about a minute instead of
six. So its ×LRU figures equal `bench.policies`' to the last digit (the replay is deterministic).

``--trace-samples K``: the trace has a single seed, and kvtier's choice of eviction order comes
from mini simulations over a 1-in-16 key sample, so one trace cell moves by several percent with
the sample; K > 1 replays the trace under K samples (`AdaptivePolicy.sample_shift`: fingerprint
bytes 7, 6, ...) and reports their mean, with the range on a second line;
``--samples-everywhere`` does the same on every seed of the generated workloads.

``--patch FILE`` (repeatable): a Python file executed in each worker before its replays, to
measure a variant of a policy without editing the tree (it may monkeypatch
`kvtier.index.policies.adaptive`, read environment variables, ...); `bench/variants/` holds the
ones docs/benchmarks.md reports.

Prints, per workload, the policy's hit ratio / LRU's per capacity (mean over seeds) and, with
``--peers``, / the best peer's; then the geometric means over the DRAM-only cells and over the
1-5% cells and the minimum. Writes bench/results/policy_sweep.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.policies import CAPACITIES, LONG, SAMPLE, TWO_TIER, ratio
from kvtier.index.policies import PEERS
from kvtier.index.policies.adaptive.policy import AdaptivePolicy
from kvtier.sim.ceilings import flatten
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import replay
from kvtier.sim.trace import read_trace
from kvtier.sim.workloads import HELD_OUT, WORKLOADS, generate

RESULTS = Path(__file__).parent / "results"
Job = tuple[str, int, str, str, int, int]
"""(workload, seed, trace path, policy, requests, kvtier's sample shift)."""


def _patch(paths: list[str]) -> None:
    """Worker initializer: apply the variants once per process (the policy under test only runs
    in those processes; LRU and the peers run in unpatched ones)."""
    for path in paths:
        runpy.run_path(path)


def _work(job: Job) -> tuple[str, int, str, dict[str, float]]:
    name, seed, trace, policy, requests, shift = job
    AdaptivePolicy.sample_shift = shift
    reqs = (read_trace(Path(trace)) if name == "trace"
            else generate(name, requests * LONG.get(name, 1), seed))
    distinct = len(set(flatten(reqs)))
    out: dict[str, float] = {}
    for f in CAPACITIES:
        cfg = TierConfig(max(1, round(distinct * f)), 0, policy)
        out[f"{f:.0%}"] = replay(reqs, cfg).hit_ratio
    dram, ssd = (max(1, round(distinct * x)) for x in TWO_TIER)
    out["2-tier"] = replay(reqs, TierConfig(dram, ssd, policy)).hit_ratio
    return name, seed, policy, out


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(max(x, 1e-12)) for x in xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    ap.add_argument("--policy", default="kvtier")
    ap.add_argument("--patch", action="append", default=[],
                    help="Python file run in each worker first (repeatable: in order)")
    ap.add_argument("--peers", action="store_true", help="also replay every peer policy")
    ap.add_argument("--trace", default=str(SAMPLE))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--trace-samples", type=int, default=1, choices=range(1, 9), metavar="1-8",
                    help="replay the trace under this many of kvtier's key samples (the "
                    "fingerprint byte its mini simulations sample on): the trace has one seed")
    ap.add_argument("--samples-everywhere", action="store_true",
                    help="apply --trace-samples to the generated workloads' seeds too")
    ap.add_argument("--held-out", action="store_true",
                    help="also replay the held-out shapes (kvtier.sim.workloads.HELD_OUT, at "
                    "bench.policies' lengths): to check a variant, never to tune one")
    ap.add_argument("--out", default=str(RESULTS / "policy_sweep.json"))
    args = ap.parse_args(argv)
    for patch in args.patch:
        if not Path(patch).is_file():
            ap.error(f"--patch {patch}: no such file")
    names = WORKLOADS + (HELD_OUT if args.held_out else ())
    loads: list[tuple[str, int]] = [(w, s) for w in names for s in range(args.seeds)]
    if Path(args.trace).exists():
        loads.insert(0, ("trace", 0))
    else:
        print(f"note: {args.trace} not found: the shared trace is skipped (--trace FILE)")
    others = ["lru"] + ([p for p in PEERS if p not in ("lru", args.policy)] if args.peers else [])
    shifts = [56 - 8 * i for i in range(args.trace_samples)]
    ours: list[Job] = [(w, s, args.trace, args.policy, args.requests, sh) for w, s in loads
                       for sh in (shifts if w == "trace" or args.samples_everywhere
                                  else shifts[:1])]
    rest: list[Job] = [(w, s, args.trace, p, args.requests, 56) for p in others
                       for w, s in loads]
    workers = max(1, args.jobs)
    init = (_patch, (args.patch,)) if args.patch else (None, ())
    with ProcessPoolExecutor(workers, initializer=init[0], initargs=init[1]) as pool:
        results = list(pool.map(_work, ours))
    with ProcessPoolExecutor(workers) as pool:
        results += pool.map(_work, rest)
    hit: dict[tuple[str, str, str], list[float]] = {}
    for name, _seed, policy, out in results:
        for cell, h in out.items():
            hit.setdefault((policy, name, cell), []).append(h)
    mean = {k: statistics.fmean(v) for k, v in hit.items()}
    cells = [f"{f:.0%}" for f in CAPACITIES] + ["2-tier"]
    workloads = list(dict.fromkeys(w for w, _ in loads))
    print(f"{' + '.join([args.policy, *args.patch])}: hit ratio / LRU"
          + (" (/ best peer)" if args.peers else ""))
    print(f"{'workload':<9}" + "".join(f"{c:>14}" for c in cells))
    summary: list[dict[str, Any]] = []
    for w in workloads:
        line = f"{w:<9}"
        for c in cells:
            ours, lru = mean[(args.policy, w, c)], mean[("lru", w, c)]
            row: dict[str, Any] = {"workload": w, "cell": c, "hit": ours, "lru": lru,
                                   "vs_lru": ratio(ours, lru)}
            text = f"{row['vs_lru']:.3f}"
            if args.peers:
                peer = max((p for p in PEERS if p != args.policy),
                           key=lambda p, w=w, c=c: mean[(p, w, c)])
                row["best_peer"], row["vs_peer"] = peer, ratio(ours, mean[(peer, w, c)])
                text += f" ({row['vs_peer']:.2f})"
            line += f"{text:>14}"
            summary.append(row)
        print(line)
        if w == "trace" and args.trace_samples > 1:
            spread = "".join(
                f"{min(hit[(args.policy, w, c)]) / mean[('lru', w, c)]:>7.3f}-"
                f"{max(hit[(args.policy, w, c)]) / mean[('lru', w, c)]:.3f}" for c in cells)
            print(f"{'  samples':<9}{spread}")
    dram = [r for r in summary if r["cell"] != "2-tier" and r["workload"] not in HELD_OUT]
    held = [r for r in summary if r["cell"] != "2-tier" and r["workload"] in HELD_OUT]
    small = [r for r in dram if r["cell"] in ("1%", "2%", "5%")]
    totals: dict[str, Any] = {
        "geomean_vs_lru": _geomean([r["vs_lru"] for r in dram]),
        "geomean_vs_lru_at_1_5pct": _geomean([r["vs_lru"] for r in small]),
        "min_vs_lru": min(r["vs_lru"] for r in dram),
    }
    if args.peers:
        totals["min_vs_best_peer_at_1_5pct"] = min(r["vs_peer"] for r in small)
        totals["min_vs_best_peer"] = min(r["vs_peer"] for r in dram)
    if held:  # reported apart: a variant is checked on them, never chosen by them
        totals["held_out_min_vs_lru"] = min(r["vs_lru"] for r in held)
        if args.peers:
            totals["held_out_min_vs_best_peer"] = min(r["vs_peer"] for r in held)
    print("  ".join(f"{k} {v:.4f}" for k, v in totals.items()))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": "policy_sweep", "policy": args.policy, "patch": args.patch,
           "seeds": args.seeds, "trace_samples": args.trace_samples,
           "samples_everywhere": args.samples_everywhere,
           "requests": args.requests, "totals": totals, "summary": summary}
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
