"""Reference engine TTFT at long contexts, kvtier DRAM hits vs recompute, and their logits.

    python -m bench.engine_ttft --device cuda                 # 8K and 32K tokens, bf16
    python -m bench.engine_ttft --quick                       # tiny model, short prompts (CPU)

For each context length N (`--contexts`), one random N-token prompt:
  recompute  the engine alone (`Engine.prefill`), `--repeats` times: TTFT and the logits, whose
             spread between the repeats is the engine's own run-to-run spread;
  cold       kvtier with nothing cached (planner off): lookup misses, the engine recomputes, and
             the prompt's full blocks are stored from the engine's pool into the daemon's DRAM;
  hits       kvtier again, `--repeats` times: every usable block (all but the last position's)
             fetched from DRAM into the pool, then the rest prefilled.
TTFT = lookup + load + prefill (`ServeResult.ttft_s`; the recompute's is its prefill). Every
serve's logits are compared with the first recompute's: bit-exact or not, and the largest
absolute difference. The peer is the recompute of the same prompt in the same run; the table
reports medians and hits/recompute speedups. JSON (written after each context, so a run cut
short keeps what it measured) goes to bench/results/engine_ttft.json (`--json PATH`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_ttft", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--contexts", default="8192,32768",
                    help="prompt lengths in tokens, comma-separated (default 8192,32768)")
    ap.add_argument("--repeats", type=int, default=3, help="recomputes and hit serves each")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model and 128/256-token prompts, one repeat (a smoke run)")
    ap.add_argument("--json", type=Path, default=RESULTS / "engine_ttft.json")
    a = ap.parse_args(argv)
    try:
        a.contexts = [int(x) for x in str(a.contexts).split(",")]
    except ValueError:
        ap.error(f"--contexts: comma-separated token counts, got {a.contexts!r}")
    if a.quick:
        a.contexts, a.repeats = [128, 256], 1
    if a.repeats < 1 or min(a.contexts) < 32:
        ap.error("--repeats must be >= 1 and every context >= 32 tokens")
    return a


def model_config(a: argparse.Namespace) -> Any:
    from kvtier.engine import ModelConfig, get_config

    longest = max(a.contexts) + 16
    if a.quick:
        return get_config("tiny").with_dtype(a.dtype)
    # 8 layers of GQA (8 query heads over 2 KV heads of 64): 4 KiB of bf16 KV per token, 64 KiB
    # per 16-token block; small weights, so a 32K prefill's cost is the engine's chunked
    # attention over the context, as in a real model's long prefill.
    return ModelConfig(vocab_size=4096, hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64,
                       mlp_hidden=1536, block_tokens=16, max_positions=longest, dtype=a.dtype)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch

    from kvtier.engine import Engine, Sequence
    from kvtier.engine.kvtier_adapter import KvtierEngine, LinkOptions
    from kvtier.engine.local_daemon import LocalDaemon

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.engine_ttft: --device cuda: no CUDA device visible to torch")
    cfg = model_config(a)
    if max(a.contexts) > cfg.max_positions:
        raise SystemExit(f"bench.engine_ttft: contexts above the model's {cfg.max_positions}")
    bt = cfg.block_tokens
    engine = Engine(cfg, num_blocks=max(a.contexts) // bt + 64, device=a.device)
    slot = max(cfg.block_bytes(), 4096)
    dram = max(64 << 20, 2 * slot * sum(n // bt + 1 for n in a.contexts))
    report: dict[str, Any] = {
        "bench": "engine_ttft", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "device": a.device,
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
        "torch": torch.__version__, "model": cfg.model_id(), "dtype": cfg.dtype,
        "kv_bytes_per_block": cfg.block_bytes(), "args": {k: str(v) for k, v in vars(a).items()},
        "contexts": []}
    gen = torch.Generator().manual_seed(5)
    print(f"reference engine: {cfg.layers} layers, {cfg.kv_bytes_per_token()} B KV/token, "
          f"{cfg.dtype}, {a.device}; DRAM pool {dram >> 20} MiB of {slot >> 10} KiB slots",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-ttft-") as tmp:
        daemon = LocalDaemon(Path(tmp) / "daemon", [
            "--dram-bytes", str(dram), "--slot-bytes", str(slot), "--ssd-bytes", "0"]).start()
        try:
            replica = KvtierEngine(engine, LinkOptions(socket=daemon.socket, use_plan=False,
                                                       timeout_s=60.0))
            with replica:
                for n in a.contexts:
                    prompt: list[int] = torch.randint(0, cfg.vocab_size, (n,),
                                                      generator=gen).tolist()
                    row = context_run(engine, replica, Sequence, prompt, a.repeats)
                    report["contexts"].append(row)
                    write(a.json, report)
                    print(f"  {n} tokens: recompute {row['recompute_p50_s'] * 1e3:.1f} ms, "
                          f"hits {row['hits_p50_s'] * 1e3:.1f} ms", file=sys.stderr)
        finally:
            daemon.stop()
    print_table(report)
    write(a.json, report)
    return 0 if all(r["hits_exact"] and r["cold_exact"] for r in report["contexts"]) else 1


def context_run(engine: Any, replica: Any, sequence: Any, prompt: list[int],
                repeats: int) -> dict[str, Any]:
    import torch

    redo: list[float] = []
    refs = []
    for _ in range(repeats):
        seq = sequence()
        res = engine.prefill(seq, prompt)
        engine.release(seq)
        redo.append(res.seconds)
        refs.append(res.logits)
    ref = refs[0]

    def diff(x: torch.Tensor) -> float:
        return float((x - ref).abs().max())

    cold = replica.serve(prompt)
    engine.release(cold.seq)
    hits = []
    for _ in range(repeats):
        out = replica.serve(prompt)
        engine.release(out.seq)
        hits.append(out)
    usable = (len(prompt) - 1) // engine.block_tokens
    if cold.fallback or any(h.fallback for h in hits):
        raise RuntimeError(f"kvtier fell back: {cold.fallback or hits[0].fallback}")
    return {
        "tokens": len(prompt), "usable_blocks": usable, "stored_blocks": cold.stored_blocks,
        "loaded_blocks": [h.loaded_blocks for h in hits],
        "recompute_s": redo, "recompute_p50_s": median(redo),
        "recompute_spread": max(diff(r) for r in refs),
        "cold_ttft_s": cold.ttft_s, "cold_exact": bool(torch.equal(cold.logits, ref)),
        "cold_max_abs_diff": diff(cold.logits),
        "hits_ttft_s": [h.ttft_s for h in hits], "hits_p50_s": median([h.ttft_s for h in hits]),
        "hits_lookup_p50_s": median([h.lookup_s for h in hits]),
        "hits_load_p50_s": median([h.load_s for h in hits]),
        "hits_prefill_p50_s": median([h.prefill_s for h in hits]),
        "hits_exact": all(torch.equal(h.logits, ref) for h in hits),
        "hits_max_abs_diff": max(diff(h.logits) for h in hits),
        "speedup_p50": median(redo) / median([h.ttft_s for h in hits]),
        "all_hit": all(h.loaded_blocks == usable for h in hits),
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"\nreference engine TTFT, {report['dtype']} on {report['gpu'] or report['device']} "
          "(medians; logits vs the first recompute)")
    print(f"{'tokens':>7} {'recompute':>11} {'hits TTFT':>10} {'lookup':>8} {'load':>8} "
          f"{'prefill':>8} {'speedup':>8} {'loaded':>7} {'exact':>6} {'max |d|':>8} "
          f"{'spread':>8}")
    for r in report["contexts"]:
        print(f"{r['tokens']:>7} {r['recompute_p50_s'] * 1e3:>9.1f}ms "
              f"{r['hits_p50_s'] * 1e3:>8.1f}ms {r['hits_lookup_p50_s'] * 1e3:>6.1f}ms "
              f"{r['hits_load_p50_s'] * 1e3:>6.1f}ms {r['hits_prefill_p50_s'] * 1e3:>6.1f}ms "
              f"{r['speedup_p50']:>7.1f}x {min(r['loaded_blocks']):>7} "
              f"{r['hits_exact'] and r['cold_exact']!s:>6} {r['hits_max_abs_diff']:>8.2g} "
              f"{r['recompute_spread']:>8.2g}")


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"bench.engine_ttft: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
