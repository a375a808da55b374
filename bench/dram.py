"""DRAM tier benchmark: put/get of 2 MiB blocks in batches of 64 through
`kvtier.tiers.dram.DramPool`.

    python -m bench.dram [--total-mib 1024] [--rounds 5]

Baseline, in the same run: `numpy.copyto` of the same bytes between two private, pre-faulted
numpy arrays of the same size (plain memory bandwidth of this machine). Put copies a source array
into pool slots (`DramPool.write_many`); get copies slots out (`DramPool.read_many_into`). Every
buffer is touched once before timing (page faults excluded); rounds alternate API and baseline;
medians are reported. Goal: API >= 0.8x baseline. Writes bench/results/dram.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from kvtier.tiers.dram import DramPool, DramSpec

BLOCK = 2 << 20
BATCH = 64
RESULTS = Path(__file__).parent / "results" / "dram.json"


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.total_mib * (1 << 20) // BLOCK // BATCH * BATCH
    total = n * BLOCK
    src = np.arange(total // 8, dtype=np.uint64).view(np.uint8)
    dst = np.ones(total, dtype=np.uint8)
    blocks = [src[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]
    outs = [dst[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]
    spec = DramSpec(f"kvt-bench-{uuid.uuid4().hex[:8]}", BLOCK, n)
    with DramPool.create(spec) as pool:
        slots = pool.alloc_many(n)
        assert slots is not None
        batches = [(slots[i : i + BATCH], i) for i in range(0, n, BATCH)]

        def put() -> None:
            for bs, i in batches:
                pool.write_many(bs, blocks[i : i + BATCH])

        def get() -> None:
            for bs, i in batches:
                pool.read_many_into(bs, outs[i : i + BATCH])

        def copy_in() -> None:
            for i in range(n):
                np.copyto(outs[i], blocks[i])

        put()  # fault the segment in
        get()
        if not np.array_equal(dst, src):
            raise SystemExit("DRAM round trip mismatch")
        times: dict[str, list[float]] = {"put": [], "get": [], "copyto": []}
        for _ in range(args.rounds):
            times["copyto"].append(_timed(copy_in))
            times["put"].append(_timed(put))
            times["get"].append(_timed(get))
        stats = pool.stats()
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "block_bytes": BLOCK,
        "batch": BATCH,
        "total_bytes": total,
        "rounds": args.rounds,
        "median_gb_per_s": gbps,
        "ratio_put": gbps["put"] / gbps["copyto"],
        "ratio_get": gbps["get"] / gbps["copyto"],
        "goal_ratio": 0.8,
        "mlocked": stats.mlocked,
        "seconds": times,
    }
    print(f"DRAM tier, {n} blocks of 2 MiB in batches of {BATCH} ({total / 2**30:.2f} GiB), "
          f"median of {args.rounds}")
    print(f"{'op':<10}{'GB/s':>8}{'vs copyto':>11}")
    print(f"{'copyto':<10}{gbps['copyto']:>8.2f}{1.0:>10.2f}x")
    for op in ("put", "get"):
        ratio = result[f"ratio_{op}"]
        mark = "reached" if ratio >= 0.8 else "NOT reached"
        print(f"{op:<10}{gbps[op]:>8.2f}{ratio:>10.2f}x  (goal 0.8x: {mark})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
