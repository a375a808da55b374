"""Planner benchmark: break-even bandwidths, fetch/recompute ratios, and decision time.

    python -m bench.planner [--data-dir DIR | --defaults | --calibrate-quick] [--repeats N]

Rates: a `kvtier calibrate` file in the data dir when present; else (or with `--defaults`) the
DESIGN.md physics defaults of `kvtier.daemon.rates.book` (H100-class: 48 GB/s H2D, 6.9 GB/s NVMe,
593 TFLOP/s achieved prefill); `--calibrate-quick` measures this machine first. The source is
printed and saved.

Per preset, tier (DRAM, SSD) and context (1K, 8K, 32K, 128K tokens, one request's whole prefix):
  fetch/recompute = predicted fetch time of the prefix (latency + transfer) / its recompute time;
  break-even      = the tier's read bandwidth at which the two are equal (SSD: with the H2D hop at
                    the rates' DRAM bandwidth); "never" when latency alone exceeds recompute.
Decision time: `plan()` on a 4,096-block chain (half DRAM, half SSD) against a brute-force
baseline that prices each of the 4,097 cuts from scratch, in the same run (goal <= 1 ms).
Writes bench/results/planner.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates, Prefix, plan
from kvtier.core.presets import get_preset, list_presets
from kvtier.core.types import Tier
from kvtier.daemon.rates.book import RateBook
from kvtier.daemon.rates.calibrate import calibration_path, load_calibration, run_calibration

CONTEXTS = (1024, 8192, 32768, 131072)
RESULTS = Path(__file__).parent / "results" / "planner.json"


def _rates(args: argparse.Namespace) -> tuple[PlanRates, str]:
    data_dir = Path(args.data_dir or os.environ.get("KVTIER_DATA_DIR")
                    or Path.home() / ".local" / "share" / "kvtier")
    if args.calibrate_quick:
        cal = run_calibration(data_dir, quick=True, progress=False)
        return RateBook.from_calibration(cal).snapshot(), "quick calibration of this machine"
    path = calibration_path(data_dir)
    if not args.defaults and path.exists():
        cal = load_calibration(path)
        return RateBook.from_calibration(cal).snapshot(), f"calibration {path}"
    return RateBook().snapshot(), "DESIGN physics defaults (kvtier.daemon.rates.book; H100-class)"


def tier_row(cm: CostModel, r: PlanRates, tier: Tier, ctx: int) -> dict[str, Any]:
    nbytes = cm.kv_bytes_per_token * ctx
    recompute = cm.prefill_flops(0, ctx) / r.prefill_flops_per_s
    fixed = r.h2d_latency_s
    extra = 0.0
    if tier is Tier.SSD:
        fixed += r.ssd_latency_s
        extra = nbytes / r.h2d_bytes_per_s
        fetch = fixed + nbytes / r.ssd_bytes_per_s + extra
    else:
        fetch = fixed + nbytes / r.h2d_bytes_per_s
    fetch += cm.fetch_flops_per_token * ctx / r.prefill_flops_per_s
    slack = recompute - fixed - extra - cm.fetch_flops_per_token * ctx / r.prefill_flops_per_s
    return {
        "tokens": ctx,
        "fetch_s": fetch,
        "recompute_s": recompute,
        "ratio": fetch / recompute,
        "break_even_bytes_per_s": nbytes / slack if slack > 0 else None,
    }


def _chain_inputs(n: int) -> tuple[bytes, CostModel, PlanRates]:
    cm = CostModel.from_spec(get_preset("Llama-3-8B"))
    rates = PlanRates(48e9, 2e-4, 6.9e9, 3e-4, 5.934e14)
    return bytes([Tier.DRAM] * (n // 2) + [Tier.SSD] * (n - n // 2)), cm, rates


def brute_force_cut(p: Prefix, cm: CostModel, r: PlanRates) -> tuple[int, float]:
    """Baseline: price every cut from scratch (O(n) each, O(n²) in all)."""
    n = len(p)
    end = int(p.start + p.tokens.sum())
    best = (0, float("inf"))
    for k in range(n + 1):
        head = p.tiers[:k]
        moved = head != Tier.HBM
        ssd = head == Tier.SSD
        lat = (r.h2d_latency_s if moved.any() else 0.0) + (r.ssd_latency_s if ssd.any() else 0.0)
        fetch = lat + float((p.nbytes[:k] * ssd).sum()) / r.ssd_bytes_per_s
        fetch += float((p.nbytes[:k] * moved).sum()) / r.h2d_bytes_per_s
        pos = int(p.start + p.tokens[:k].sum())
        t = fetch + cm.prefill_flops(pos, end - pos) / r.prefill_flops_per_s
        if t < best[1]:
            best = (k, t)
    return best


def interior_cuts(seed: int = 0) -> dict[str, Any]:
    """`plan` against `brute_force_cut` where the optimum is an interior cut (some blocks
    fetched, the rest recomputed): DRAM heads and SSD tails, tiers mixed at random, SSD and
    prefill rates from slow to fast. Cases whose best cut is 0 or everything are dropped (a
    plan that always fetched all, or nothing, would agree there)."""
    rng = np.random.default_rng(seed)
    cm = CostModel.from_spec(get_preset("Llama-3-8B"))
    cases, same = 0, 0
    worst: list[tuple[int, int, int]] = []
    for n in (16, 64, 256):
        for ssd_bw in (0.2e9, 1e9, 3e9, 6.9e9):
            for prefill in (2e13, 1e14, 5.934e14):
                for mix in ("split", "random"):
                    if mix == "split":
                        tiers = [Tier.DRAM] * (n // 3) + [Tier.SSD] * (n - n // 3)
                    else:
                        tiers = [Tier(int(t)) for t in rng.choice(
                            [int(Tier.DRAM), int(Tier.SSD)], size=n, p=[0.4, 0.6])]
                    rates = PlanRates(48e9, 2e-4, ssd_bw, 3e-4, prefill)
                    p = Prefix.uniform(bytes(tiers), 16, 2 << 20)
                    ref = brute_force_cut(p, cm, rates)[0]
                    if not 0 < ref < n:
                        continue
                    cases += 1
                    got = plan(p, cm, rates).cut
                    same += got == ref
                    if got != ref:
                        worst.append((n, got, ref))
    return {"interior_cases": cases, "same_cut": same, "differ": worst[:10]}


def decision_time(n: int, repeats: int) -> dict[str, Any]:
    tiers, cm, rates = _chain_inputs(n)
    as_list = [Tier(t) for t in tiers]

    def timed(fn: Any, reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    from_bytes = timed(lambda: plan(Prefix.uniform(tiers, 16, 2 << 20), cm, rates), repeats)
    from_list = timed(lambda: plan(Prefix.uniform(as_list, 16, 2 << 20), cm, rates), repeats)
    p = Prefix.uniform(tiers, 16, 2 << 20)
    brute = timed(lambda: brute_force_cut(p, cm, rates), 3)
    got, ref = plan(p, cm, rates), brute_force_cut(p, cm, rates)
    med = statistics.median(from_bytes)
    return {
        "blocks": n,
        "plan_median_s": med,
        "plan_p90_s": float(np.percentile(from_bytes, 90)),
        "plan_from_list_median_s": statistics.median(from_list),
        "brute_force_median_s": statistics.median(brute),
        "speedup": statistics.median(brute) / med,
        "same_cut": got.cut == ref[0],
        "cut": got.cut,
        "goal_s": 1e-3,
        "goal_met": med <= 1e-3,
    }


def _fmt_bw(v: float | None) -> str:
    return "never" if v is None else f"{v / 1e9:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.planner", description=__doc__.split("\n")[0],
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--defaults", action="store_true", help="ignore any calibration file")
    src.add_argument("--calibrate-quick", action="store_true", help="measure this machine first")
    ap.add_argument("--data-dir", help="where calibration.json is looked for")
    ap.add_argument("--repeats", type=int, default=300, help="plan() timings (default 300)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    rates, source = _rates(args)
    print(f"rates: {source}")
    print(f"  h2d {rates.h2d_bytes_per_s / 1e9:.2f} GB/s + {rates.h2d_latency_s * 1e6:.0f} µs; "
          f"ssd {rates.ssd_bytes_per_s / 1e9:.2f} GB/s + {rates.ssd_latency_s * 1e6:.0f} µs; "
          f"prefill {rates.prefill_flops_per_s / 1e12:.4g} TFLOP/s")
    rows = []
    head = f"{'preset':<16}{'tier':<5}" + "".join(
        f"{f'{c // 1024}K ratio':>11}{'B/E GB/s':>10}" for c in CONTEXTS
    )
    print(head)
    for name in list_presets():
        cm = CostModel.from_spec(get_preset(name))
        for tier in (Tier.DRAM, Tier.SSD):
            cells = [tier_row(cm, rates, tier, c) for c in CONTEXTS]
            rows.append({"preset": name, "tier": tier.label, "contexts": cells})
            print(f"{name:<16}{tier.label:<5}" + "".join(
                f"{c['ratio']:>11.3g}{_fmt_bw(c['break_even_bytes_per_s']):>10}" for c in cells
            ))
    dt = decision_time(4096, args.repeats)
    print(f"\nplan() on {dt['blocks']} blocks: median {dt['plan_median_s'] * 1e6:.0f} µs "
          f"(p90 {dt['plan_p90_s'] * 1e6:.0f} µs; from a list of Tier "
          f"{dt['plan_from_list_median_s'] * 1e6:.0f} µs); brute force "
          f"{dt['brute_force_median_s'] * 1e3:.1f} ms → {dt['speedup']:.0f}x; same cut: "
          f"{dt['same_cut']}; goal <= 1 ms {'met' if dt['goal_met'] else 'NOT met'}")
    cuts = interior_cuts()
    print(f"interior optima: plan() = brute force on {cuts['same_cut']} of "
          f"{cuts['interior_cases']} cases")
    doc = {
        "interior_cuts": cuts,
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "rates_source": source,
        "rates": rates._asdict(),
        "tiers": rows,
        "decision_time": dt,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
