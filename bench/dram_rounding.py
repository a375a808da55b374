"""DRAM lost to rounding: size classes on pages vs one slot size, through real daemons.

    python -m bench.dram_rounding [--dram-mib 1024] [--requests 600] [--seed 7]

For each mix of layouts (block sizes real models use) the same request replay runs against two
real daemons (`kvtier serve`, real shm, real client) in the same run:

- classes: today's default pool — size classes on pages (`--slot-bytes 16KiB`, blocks up to
  8 MiB; `kvtier.tiers.dram_pages`);
- one slot size: the design before it — every block in one slot of the mix's largest block
  (`--slot-bytes` = `--max-block-bytes` = that size), the only way one daemon could serve the
  mix then.

A request picks a layout (by its share of the bytes asked for), then a prefix chain from that
layout's working set (Zipf-like: chain i with weight 1/(i+1)), looks it up and stores the blocks
it missed. The working sets are 3x the DRAM pool; requests run until 3x the pool's bytes were
stored (full and churning), then `--requests` more are measured. After the replay,
every chain of every layout is looked up: KV bytes held = sum of hit blocks x block size.
Reported per mix and design: KV bytes held per DRAM byte (goal for classes: >= 0.90, i.e. at
most 10% of DRAM lost to rounding, page heads/tails and fragmentation), the DRAM left unused
after each measured request (1 - slot bytes used / DRAM: mean and worst; for classes slot bytes
= KV bytes, the strides of these blocks being the block sizes; one slot size loses its bytes
inside slots, which this does not count; the end-of-run figure is one snapshot of a churning
pool, this is its spread) and the block hit ratio of the measured
requests; a store the pool cannot hold at all (a chain of more slots than
the pool has, one slot size) is refused and counted. No SSD tier (DRAM only). Writes
bench/results/dram_rounding.json (dram_rounding_<MiB>mib.json for another --dram-mib).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.engine.local_daemon import LocalDaemon

KiB, MiB = 1 << 10, 1 << 20
RESULTS = Path(__file__).parent / "results" / "dram_rounding.json"


@dataclass(frozen=True)
class Model:
    name: str
    block_bytes: int
    chain_blocks: int  # blocks per prompt prefix
    share: float  # of the bytes requests ask for


MIXES: dict[str, list[Model]] = {
    # Llama-3-8B bf16 on CPU, 32-token blocks (128 KiB/token) + a small model's 32 KiB block
    "llama8b-cpu-4MiB + small-32KiB": [
        Model("llama-3-8b/cpu32", 4 * MiB, 4, 0.5), Model("small/32k", 32 * KiB, 16, 0.5)],
    # a spread of powers of two, 16 KiB .. 8 MiB
    "16KiB + 256KiB + 2MiB + 8MiB": [
        Model("tiny/16k", 16 * KiB, 16, 0.25), Model("mid/256k", 256 * KiB, 16, 0.25),
        Model("llama-3-8b/gpu16", 2 * MiB, 8, 0.25), Model("wide/8m", 8 * MiB, 2, 0.25)],
    # sizes that are not powers of two: DeepSeek-V3 MLA (61 x 576 x 2 B x 16 tokens), Qwen2-1.5B
    # (28 layers x 2 x 2 heads x 128 x 2 B x 16), Llama-3-70B on a TP8 rank (80 x 2 x 1 x 128 x
    # 2 B x 16), Llama-3-8B CPU block
    "odd: MLA 1.07MiB + 448KiB + 640KiB + 4MiB": [
        Model("deepseek-v3/mla16", 61 * 576 * 2 * 16, 8, 0.25),
        Model("qwen2-1.5b/16", 28 * 2 * 2 * 128 * 2 * 16, 8, 0.25),
        Model("llama-3-70b/tp8r0", 80 * 2 * 1 * 128 * 2 * 16, 8, 0.25),
        Model("llama-3-8b/cpu32", 4 * MiB, 4, 0.25)],
}


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def layout(m: Model) -> LayoutDecl:
    return LayoutDecl(m.name.encode().ljust(16, b"."), m.block_bytes, 16, model_id=m.name)


def chain_keys(model: int, chain: int, n: int) -> list[bytes]:
    return [bytes([model]) + chain.to_bytes(4, "big") + i.to_bytes(2, "big") + bytes(25)
            for i in range(n)]


def replay(socket: Path, mix: list[Model], dram: int, requests: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    clients = [Client(socket, layout=layout(m)) for m in mix]
    # working sets: 3x the pool per layout, in chains
    chains = [max(4, 3 * dram // (m.block_bytes * m.chain_blocks)) for m in mix]
    weights = [[1 / (i + 1) for i in range(c)] for c in chains]
    picks = [m.share / (m.block_bytes * m.chain_blocks) for m in mix]  # requests by bytes
    hit = asked = refused = stored = measured = 0
    free_samples: list[float] = []
    warm = 3 * dram  # payload bytes stored before measuring: the pool is full and churning
    started = time.perf_counter()
    try:
        while stored < warm or measured < requests:
            li = rng.choices(range(len(mix)), picks)[0]
            m, kv = mix[li], clients[li]
            c = rng.choices(range(chains[li]), weights[li])[0]
            keys = chain_keys(li, c, m.chain_blocks)
            got = kv.lookup(keys).hit_blocks
            counted = stored >= warm
            if counted:
                hit, asked, measured = hit + got, asked + len(keys), measured + 1
            if got < len(keys):
                data = [bytes([li + 1]) * m.block_bytes] * (len(keys) - got)
                try:
                    kv.store(keys[got:], data, parent=keys[got - 1] if got else b"")
                    stored += len(data) * m.block_bytes
                except KvtierRpcError as exc:  # the pool cannot hold the chain at all
                    if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    refused += 1
                    stored += len(data) * m.block_bytes
            if counted:
                d = next(t for t in kv.stats().tiers if t.tier == 2)  # TIER_DRAM
                free_samples.append(1 - d.used_bytes / dram)
        held = 0
        per_layout = {}
        for li, (m, kv) in enumerate(zip(mix, clients, strict=True)):
            blocks = sum(kv.lookup(chain_keys(li, c, m.chain_blocks)).hit_blocks
                         for c in range(chains[li]))
            per_layout[m.name] = blocks
            held += blocks * m.block_bytes
        dram_stats = next(t for t in clients[0].stats().tiers if t.tier == 2)  # TIER_DRAM
    finally:
        for kv in clients:
            kv.close()
    return {
        "kv_bytes_held": held, "dram_bytes": dram, "kv_per_dram_byte": held / dram,
        "lost_fraction": 1 - held / dram, "hit_ratio_measured": hit / max(1, asked),
        "free_fraction_mean": sum(free_samples) / max(1, len(free_samples)),
        "free_fraction_max": max(free_samples, default=0.0),
        "payload_bytes_stored": stored,
        "dram_used_bytes": int(dram_stats.used_bytes), "blocks_held": per_layout,
        "stores_refused": refused,
        "seconds": time.perf_counter() - started,
    }


def run_design(root: Path, name: str, args: list[str], mix: list[Model], dram: int,
               requests: int, seed: int) -> dict[str, Any]:
    daemon = LocalDaemon(root / name, ["--dram-bytes", str(dram), "--ssd-bytes", "0",
                                       "--log-level", "warning", *args]).start()
    try:
        return replay(daemon.socket, mix, dram, requests, seed)
    finally:
        daemon.stop()
        daemon.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dram-mib", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--page-mib", type=int, default=0, help="DRAM page size (0: automatic)")
    args = ap.parse_args(argv)
    dram = args.dram_mib * MiB
    rows: list[dict[str, Any]] = []
    print(f"{'mix':44} {'design':14} {'KV/DRAM':>8} {'lost':>7} {'unused mean/max':>16} "
          f"{'hit ratio':>9} {'s':>6}")
    with tempfile.TemporaryDirectory(prefix="kvt-bench-rounding-") as tmp:
        for mi, (mix_name, mix) in enumerate(MIXES.items()):
            big = round_up(max(m.block_bytes for m in mix), 4096)
            designs = {
                "classes": ["--slot-bytes", "16KiB", "--max-block-bytes", "8MiB",
                            "--dram-page-bytes", str(args.page_mib * MiB)],
                "one-slot-size": ["--slot-bytes", str(big), "--max-block-bytes", str(big)],
            }
            for design, dargs in designs.items():
                r = run_design(Path(tmp) / f"m{mi}", design, dargs, mix, dram, args.requests,
                               args.seed)
                rows.append({"mix": mix_name, "design": design,
                             "block_bytes": {m.name: m.block_bytes for m in mix}, **r})
                print(f"{mix_name:44} {design:14} {r['kv_per_dram_byte']:8.3f} "
                      f"{r['lost_fraction']:7.1%} {r['free_fraction_mean']:8.1%}/"
                      f"{r['free_fraction_max']:6.1%} {r['hit_ratio_measured']:9.3f} "
                      f"{r['seconds']:6.1f}")
    by = {(r["mix"], r["design"]): r for r in rows}
    summary = []
    for mix_name in MIXES:
        c, o = by[(mix_name, "classes")], by[(mix_name, "one-slot-size")]
        summary.append({
            "mix": mix_name, "classes_lost": c["lost_fraction"],
            "classes_unused_mean": c["free_fraction_mean"],
            "classes_unused_max": c["free_fraction_max"],
            "one_slot_lost": o["lost_fraction"],
            "kv_held_ratio": c["kv_bytes_held"] / max(1, o["kv_bytes_held"]),
            "hit_ratio_classes": c["hit_ratio_measured"],
            "hit_ratio_one_slot": o["hit_ratio_measured"],
            "goal_lost_le_10pct": c["lost_fraction"] <= 0.10,
        })
    print()
    for s in summary:
        print(f"{s['mix']:44} classes hold {s['kv_held_ratio']:.2f}x the KV of one slot size; "
              f"lost {s['classes_lost']:.1%} vs {s['one_slot_lost']:.1%} (unused while "
              f"measured: mean {s['classes_unused_mean']:.1%}, max {s['classes_unused_max']:.1%})"
              f"; goal <= 10%: "
              f"{'reached' if s['goal_lost_le_10pct'] else 'NOT reached'}")
    out = RESULTS if args.dram_mib == 1024 else RESULTS.with_name(
        f"dram_rounding_{args.dram_mib}mib.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "dram_rounding", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "dram_bytes": dram, "requests": args.requests,
        "seed": args.seed, "rows": rows, "summary": summary,
    }, indent=2))
    print(f"wrote {out}")
    return 0 if all(s["goal_lost_le_10pct"] for s in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
