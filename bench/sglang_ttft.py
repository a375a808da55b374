"""TTFT of a real SGLang server (HiCache on, on this CPU) at `--tokens` (8K) tokens, in one
run: `python -m bench.sglang_ttft [--quick]` (SGLang venv: scripts/venv.sh `ensure_sglang_venv`,
or `$KVTIER_SGLANG_PYTHON`).

Systems, one SGLang server at a time (they would share the CPU), the same model and prompts:
  recompute    the kvtier server's first request of each prompt (nothing cached anywhere; its
               pages are stored to kvtier after it)
  kvtier       the same prompts after `/flush_cache` (SGLang's L1 and L2 emptied): every full
               page from kvtier's DRAM through the v1 path (`use_plan: false`: the planner's
               default rates are a GPU's, and would send this small model to recompute)
  file         SGLang's own `file` L3 backend (`SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` in the
               run's temp dir), measured like kvtier: first request, flush, again
Both L3s run with `--hicache-storage-prefetch-policy wait_complete` and `prefetch_threshold`
one page, so a hit is always loaded before the prefill. TTFT = wall time of one `/generate`
with `max_new_tokens=1`; medians over `--prompts` prompts. Goals (issue 27): kvtier >= 5x
faster than recompute, kvtier <= 0.8x the file backend's TTFT. Writes
bench/results/sglang_ttft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from kvtier.engine.local_daemon import LocalDaemon
from tests.support.sglang_engine import (
    PAGE,
    Gen,
    SglangServer,
    page_bytes,
    sglang_python,
    write_model,
)

RESULTS = Path(__file__).parent / "results"


def prompts(n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(n)]


def measure(srv: SglangServer, work: list[list[int]]) -> tuple[list[Gen], list[Gen]]:
    """(first requests, requests after a flush)."""
    cold = [srv.generate(p, max_new_tokens=1, timeout=900) for p in work]
    time.sleep(3)  # SGLang writes pages back to L3 after the request
    srv.flush()
    warm = []
    for p in work:
        warm.append(srv.generate(p, max_new_tokens=1, timeout=900))
    return cold, warm


def summary(rows: list[Gen]) -> dict[str, float]:
    return {"p50_s": statistics.median(r.seconds for r in rows),
            "max_s": max(r.seconds for r in rows),
            "storage_tokens": statistics.median(r.storage for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="1K tokens, 2 prompts (a smoke run)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=RESULTS / "sglang_ttft.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.prompts = 1024, 2
    if sglang_python() is None:
        print("no SGLang venv (scripts/venv.sh ensure_sglang_venv, or $KVTIER_SGLANG_PYTHON)",
              file=sys.stderr)
        return 2
    heads = max(1, a.hidden // 64)
    kv_heads = max(1, heads // 2)
    block = page_bytes(layers=a.layers, kv_heads=kv_heads)
    pages = a.prompts * (a.tokens // PAGE + 1)
    root = Path(tempfile.mkdtemp(prefix="kvtier-sglang-ttft-"))
    model = write_model(root / "model", hidden=a.hidden, layers=a.layers, heads=heads,
                        kv_heads=kv_heads, intermediate=a.hidden * 3)
    work = prompts(a.prompts, a.tokens)
    max_tokens = max(16384, 2 * (a.tokens + 64))
    print(f"model: {a.layers} layers, hidden {a.hidden}, {heads} heads ({kv_heads} KV), bf16, "
          f"{block // 1024} KiB per {PAGE}-token page; {a.prompts} prompts of {a.tokens} "
          f"tokens; {a.threads} threads", file=sys.stderr)
    results: dict[str, dict[str, list[Gen]]] = {}
    daemon_args = ["--dram-bytes", f"{max(64, 2 * pages * block >> 20)}MiB",
                   "--slot-bytes", f"{block // 1024}KiB", "--ssd-bytes", "256MiB"]
    try:
        with LocalDaemon(root / "daemon", daemon_args) as d, SglangServer(
                root / "kvtier", model, socket=d.socket, extra={"use_plan": False},
                max_tokens=max_tokens, threads=a.threads) as srv:
            srv.start()
            cold, warm = measure(srv, work)
            results["recompute"] = {"rows": cold}
            results["kvtier"] = {"rows": warm}
        with SglangServer(root / "file", model, storage="file", max_tokens=max_tokens,
                          threads=a.threads) as srv:
            srv.start()
            results["file"] = {"rows": measure(srv, work)[1]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = {s: summary(r["rows"]) for s, r in results.items()}
    base, file_ = table["recompute"]["p50_s"], table["file"]["p50_s"]
    print(f"\n{'system':<11}{'TTFT p50':>10}{'max':>9}{'L3 tokens':>11}{'vs recompute':>14}"
          f"{'vs file':>9}")
    for s, row in table.items():
        print(f"{s:<11}{row['p50_s'] * 1e3:>8.0f}ms{row['max_s'] * 1e3:>7.0f}ms"
              f"{row['storage_tokens']:>11.0f}{base / row['p50_s']:>13.1f}x"
              f"{row['p50_s'] / file_:>8.2f}x")
    k = table["kvtier"]["p50_s"]
    print(f"goal kvtier >= 5x recompute: {'reached' if base / k >= 5 else 'NOT reached'} "
          f"({base / k:.1f}x); goal kvtier <= 0.8x file: "
          f"{'reached' if k / file_ <= 0.8 else 'NOT reached'} ({k / file_:.2f}x)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "args": {k: v for k, v in vars(a).items() if k != "json"},
        "summary": table,
        "raw": {s: [r._asdict() for r in v["rows"]] for s, v in results.items()}},
        indent=1, default=str))
    print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
