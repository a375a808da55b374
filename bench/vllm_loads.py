"""The vLLM connector's load path alone: `python -m bench.vllm_loads [--device cuda]`.

Times the worker side's loads (`WorkerSide.start_load_kv`, `wait_for_layer_load` of every layer
in order, as vLLM's forward calls it, `get_block_ids_with_load_errors`) of `--blocks` blocks
from a real daemon's DRAM into KV views laid out as vLLM's `create_kv_cache_views` lays them
(LBHNC, the layout the connector asks for; `bench.vllm_views`, checked against vLLM where it is
installed, so this runs on a GPU machine without vLLM), for each `transfer` setting: "torch"
(synchronous torch copies) and "engine" (kvtier's TransferEngine, one job per layer: its CPU
backend, or on `--device cuda` its CUDA backend). The peer, "one copy", is a single contiguous
copy of the same bytes from pinned host memory to the device (`--device cpu`: between two host
buffers). The three alternate within each repetition, so all see the same machine. Reports per
load ms p50/p90, GB/s of payload at the p50, when layer 0 was usable (ms after the start, p50),
and each setting over one copy. Writes bench/results/vllm_loads[_cuda].json (`--json PATH`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.vllm_views import connector_base, kv_views, page_bytes

RESULTS = Path(__file__).parent / "results"


def views(a: argparse.Namespace, blocks: int, seed: int) -> list[Any]:
    import torch

    size = a.layers * blocks * page_bytes(a.kv_heads, a.block_tokens, a.head_size, 2)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), generator=g, dtype=torch.int8).to(a.device)
    return kv_views(raw, a.layers, blocks, a.kv_heads, a.block_tokens, a.head_size,
                    torch.bfloat16, "LBHNC")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_loads", description=__doc__,
                                 allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per load (one request)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    base = connector_base()

    import torch

    from kvtier.client.sync_client import Client
    from kvtier.core.keys import block_keys
    from kvtier.engine.local_daemon import LocalDaemon
    from kvtier.integrations.vllm.layout import EngineKV, Shard
    from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob
    from kvtier.integrations.vllm.settings import ConnectorSettings
    from kvtier.integrations.vllm.worker import WorkerSide

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.vllm_loads: --device cuda: no CUDA device visible to torch")
    page = page_bytes(a.kv_heads, a.block_tokens, a.head_size, 2)
    names = tuple(f"l{i}" for i in range(a.layers))
    kv = EngineKV("bench/vllm-loads@1", "bfloat16", a.block_tokens, names, page, a.kv_heads,
                  a.head_size, a.device, Shard(0, 1, True))
    block = kv.block_bytes
    pool = a.blocks * 2 + 8
    root = Path(tempfile.mkdtemp(prefix="kvtier-vllm-loads-"))
    d = LocalDaemon(root / "daemon", ["--dram-bytes", f"{pool * block // 1024}KiB",
                                      "--slot-bytes", f"{block // 1024}KiB",
                                      "--ssd-bytes", "0"]).start()
    rows: dict[str, list[float]] = {"torch": [], "engine": [], "one copy": []}
    first: dict[str, list[float]] = {t: [] for t in rows}
    nbytes = a.blocks * block
    try:
        keys = block_keys([random.Random(0).randrange(3, 4000)
                           for _ in range(a.blocks * a.block_tokens + 1)], a.block_tokens)
        rng = random.Random(1)
        with Client(d.socket, layout=kv.decl()) as c:
            for i in range(0, a.blocks, 64):
                part = keys[i:i + 64]
                c.store(part, [rng.randbytes(block) for _ in part], keys[i - 1] if i else b"")
        total = a.blocks + 16
        workers = {}
        for t in ("torch", "engine"):
            w = WorkerSide(ConnectorSettings(socket=str(d.socket), use_plan=False,
                                             transfer=t), kv, 0)
            w.register_kv_caches(dict(zip(names, views(a, total, 2), strict=True)))
            workers[t] = w
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=a.device == "cuda")
        host.fill_(7)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
        targets = list(range(total))
        with torch.inference_mode():
            for r in range(a.repeats + 2):
                order = list(rows) if r % 2 == 0 else list(reversed(rows))
                for t in order:
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    if t == "one copy":
                        t0 = time.perf_counter()
                        dev.copy_(host, non_blocking=True)
                        if a.device == "cuda":
                            torch.cuda.synchronize()
                        t1 = t2 = time.perf_counter()
                    else:
                        w = workers[t]
                        rng.shuffle(targets)  # vLLM's free blocks are scattered
                        job = LoadJob(f"q{r}", targets[:a.blocks], keys, 0)
                        t0 = time.perf_counter()
                        w.start_load_kv(KvtierMetadata(loads=[job]))
                        w.wait_for_layer_load(names[0])
                        t1 = time.perf_counter()
                        for n in names[1:]:
                            w.wait_for_layer_load(n)
                        errors = w.take_load_errors()
                        if a.device == "cuda":
                            torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        assert not errors, (t, sorted(errors)[:5])
                    if r >= 2:  # warm-ups: mapping, registration, engine build
                        rows[t].append(t2 - t0)
                        first[t].append(t1 - t0)
        for w in workers.values():
            w.close()
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    table = {t: {"p50_ms": statistics.median(xs) * 1e3, "p90_ms": pct(xs, 0.9) * 1e3,
                 "gbps_p50": nbytes / statistics.median(xs) / 1e9,
                 "layer0_p50_ms": statistics.median(first[t]) * 1e3, "n": len(xs)}
             for t, xs in rows.items()}
    one = table["one copy"]["p50_ms"]
    for row in table.values():
        row["over_one_copy"] = row["p50_ms"] / one
        row["layer0_over_one_copy"] = row["layer0_p50_ms"] / one
    ratio = table["engine"]["p50_ms"] / table["torch"]["p50_ms"]
    print(f"{a.blocks} blocks of {block // 1024} KiB ({a.layers} layers x {page // 1024} KiB "
          f"pages, LBHNC, bf16) per load, {a.device}, {a.repeats} loads each, alternating; "
          f"connector base: {base}")
    print(f"{'transfer':<9}{'p50 (last layer)':>17}{'p90':>10}{'GB/s':>8}{'layer 0 ready':>15}"
          f"{'/ one copy':>11}{'layer 0 / one copy':>20}")
    for t, row in table.items():
        print(f"{t:<9}{row['p50_ms']:>15.2f}ms{row['p90_ms']:>8.2f}ms{row['gbps_p50']:>8.2f}"
              f"{row['layer0_p50_ms']:>13.2f}ms{row['over_one_copy']:>10.2f}x"
              f"{row['layer0_over_one_copy']:>19.2f}x")
    print(f"engine / torch (p50 time): {ratio:.2f}x")
    out = a.json or RESULTS / f"vllm_loads{'_cuda' if a.device == 'cuda' else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(a).items()},
        "connector_base": base, "summary": table, "engine_over_torch": ratio, "raw": rows},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
