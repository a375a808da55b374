"""What shadow verification costs in TTFT: `bench.vllm_ttft`'s workload (documents + a question,
a multi-turn chat; its model) served from kvtier's DRAM by engines that differ only in
`verify_sample`: 0 (off), the connector's default, and 1.0 (every hit recomputed: what one
sampled request costs). `python -m bench.verify_overhead [--quick] [--rounds 3] [--rounds-all N]`

One daemon; the prompts are stored once (by the `off` engine); then each round measures every
prompt on every engine, one request at a time, the engines' order rotating per prompt (so a
noisy neighbour on the machine hits each alike), vLLM's own prefix cache reset before each
request (a hit comes from kvtier). TTFT = `generate(max_tokens=1)` wall time. Reported per
engine: p50, p90, mean, how many requests were verified (answered as misses); and, since at 1%
a run of a few dozen requests samples none or one, the p50 and mean of the mixture the default
rate makes — each measured hit of `off` replaced by a measured request of `1.0` with the default
probability, 2,000 resamples (medians). `--rounds-all N`: the 1.0 engine (a full prefill a
request) only in the first N rounds, so many rounds of the other two stay affordable; the mixture
then replaces a hit by one of the same prompt's measured 1.0 requests. Writes
bench/results/verify_overhead.json.
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

from bench.vllm_ttft import BLOCK, pct, prompts
from kvtier.engine.local_daemon import LocalDaemon
from kvtier.integrations.vllm.settings import ConnectorSettings
from tests.support.vllm_engine import EngineProc, write_model

RESULTS = Path(__file__).parent / "results"
DEFAULT = ConnectorSettings().verify_sample


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verify_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-all", type=int, default=None,
                    help="rounds that also measure the 1.0 engine (default: every round)")
    ap.add_argument("--json", type=Path, default=RESULTS / "verify_overhead.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.doc_tokens, a.docs, a.turns, a.layers, a.rounds = 1024, 3, 3, 2, 2
    if a.rounds < 1 or (a.rounds_all is not None and not 1 <= a.rounds_all <= a.rounds):
        ap.error("--rounds must be >= 1 and --rounds-all between 1 and --rounds")
    rounds_all = a.rounds if a.rounds_all is None else a.rounds_all
    max_len = a.doc_tokens + 2048
    heads = max(1, a.hidden // 64)
    kv_heads = max(1, heads // 2)
    block_bytes = 2 * BLOCK * kv_heads * 64 * 2 * a.layers
    work = prompts(a)
    flat = [p for ps in work.values() for p in ps]
    root = Path(tempfile.mkdtemp(prefix="kvtier-verify-overhead-"))
    model = write_model(root / "model", hidden=a.hidden, layers=a.layers, heads=heads,
                        kv_heads=kv_heads, intermediate=a.hidden * 3, vocab=4096,
                        max_len=max_len)
    tokens = sum(len(p) for p in flat)
    dram = max(64, block_bytes * (tokens // BLOCK + 64) * 2 >> 20)
    d = LocalDaemon(root / "daemon", ["--dram-bytes", f"{dram}MiB", "--slot-bytes",
                                      f"{block_bytes // 1024}KiB", "--ssd-bytes", "0"]).start()
    rates = {"off": 0.0, "default": DEFAULT, "all": 1.0}
    engines = {name: EngineProc(root / name, model, d.socket,
                                extra={"retry_after_s": 0.5, "use_plan": True,
                                       "verify_sample": rate},
                                threads=a.threads,
                                engine_args={"max_model_len": max_len,
                                             "max_num_batched_tokens": max_len})
               for name, rate in rates.items()}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    print(f"model: {a.layers} layers, hidden {a.hidden}; {len(flat)} prompts "
          f"({tokens} tokens), {a.rounds} rounds; verify_sample off / {DEFAULT:g} / 1.0",
          file=sys.stderr)
    try:
        for e in engines.values():
            e.launch()
        for e in engines.values():
            e.wait_ready()
        warm = [[random.Random(9).randrange(3, 4000) for _ in range(256)]]
        for e in engines.values():
            e.generate(warm, max_tokens=1)
        for p in flat:
            engines["off"].generate([p], max_tokens=1)  # stores
        time.sleep(2.0)
        order = list(engines)
        k = 0
        for r in range(a.rounds):
            for i, p in enumerate(flat):
                for name in order[k % 3:] + order[:k % 3]:
                    if name == "all" and r >= rounds_all:
                        continue
                    e = engines[name]
                    e.reset_prefix_cache()
                    o = e.generate([p], max_tokens=1)[0]
                    rows[name].append({"ttft_s": o.seconds, "cached": o.cached,
                                       "prompt": len(p), "i": i, "round": r})
                k += 1
        verified = {name: e.metric("vllm:kvtier_verified_blocks") for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.request_exit()
        for e in engines.values():
            e.close()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)

    def summary(rs: list[dict[str, float]]) -> dict[str, float]:
        t = [r["ttft_s"] for r in rs]
        return {"p50_s": statistics.median(t), "p90_s": pct(t, 0.9), "mean_s": statistics.mean(t),
                "n": len(t), "misses": sum(1 for r in rs if r["cached"] == 0)}

    table = {name: summary(rs) for name, rs in rows.items()}
    # the default rate's mixture from the measured rows: per request, `all`'s TTFT with
    # probability DEFAULT (the same prompt, its measurement of the same round modulo those
    # measured), else `off`'s
    by_prompt: dict[int, list[dict[str, float]]] = {}
    for row in rows["all"]:
        by_prompt.setdefault(int(row["i"]), []).append(row)
    rng = random.Random(0)
    p50s, means = [], []
    for _ in range(2000):
        t = [(by_prompt[int(o["i"])][int(o["round"]) % rounds_all] if rng.random() < DEFAULT
              else o)["ttft_s"] for o in rows["off"]]
        p50s.append(statistics.median(t))
        means.append(statistics.mean(t))
    off = table["off"]
    mix = {"p50_s": statistics.median(p50s), "mean_s": statistics.median(means)}
    print(f"\n{'engine':<22}{'p50':>9}{'p90':>9}{'mean':>9}{'p50 vs off':>12}{'mean vs off':>13}"
          f"{'verified req':>14}")
    for name, s in table.items():
        label = {"off": "verify_sample 0", "default": f"verify_sample {DEFAULT:g}",
                 "all": "verify_sample 1.0"}[name]
        print(f"{label:<22}{s['p50_s'] * 1e3:>7.0f}ms{s['p90_s'] * 1e3:>7.0f}ms"
              f"{s['mean_s'] * 1e3:>7.0f}ms{s['p50_s'] / off['p50_s']:>11.3f}x"
              f"{s['mean_s'] / off['mean_s']:>12.3f}x{s['misses']:>10.0f}/{s['n']:.0f}")
    print(f"{'mixture at ' + format(DEFAULT, 'g'):<22}{mix['p50_s'] * 1e3:>7.0f}ms{'':>9}"
          f"{mix['mean_s'] * 1e3:>7.0f}ms{mix['p50_s'] / off['p50_s']:>11.3f}x"
          f"{mix['mean_s'] / off['mean_s']:>12.3f}x   (resampled)")
    overhead = table["default"]["p50_s"] / off["p50_s"] - 1
    print(f"TTFT p50 overhead at the default {DEFAULT:g}: measured {overhead:+.1%}, "
          f"resampled {mix['p50_s'] / off['p50_s'] - 1:+.1%} (goal <= 1%); blocks verified "
          f"per engine {verified}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "default_sample": DEFAULT, "summary": table, "mixture": mix,
        "verified_blocks": verified, "raw": rows}, indent=1))
    print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
