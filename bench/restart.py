"""Restart benchmark: the DRAM tier across daemon restarts (`keep_dram`).

    python -m bench.restart [--kills 50] [--sizes 1GiB,4GiB] [--quick]

Two parts, real `kvtier serve` daemons on temporary sockets, no SSD tier (DRAM only):

- SIGKILLs during batched writes: a writer process stores chains of 8 blocks of 16 KiB without
  pause, each block copied in two halves with a short sleep between (so kills land in half-written
  blocks and between Allocate and Commit), logging each chain before its Allocate and after its
  Commit returned. The daemon is SIGKILLed at a random moment (0.3-1.5 s into each round), the
  writer stopped (SIGSTOP), the daemon started again on the same socket; then every chain the
  writer saw committed in that round must load from DRAM byte for byte ("lost" counts those that
  do not), and every block that loads — of every chain attempted in the round, committed or not,
  and of 200 older ones — must be the block its key names ("wrong"). Then the writer goes on.
  Goal: 0 wrong, 0 lost over 50 kills. The pool is full after a few rounds; its policy is LRU,
  so what a round commits is the newest in it and leaves only after more than a pool's worth of
  later blocks: none of it is evicted before its check.
- Time from a new daemon's start to serving a full pool's blocks: a pool of each size filled with
  2 MiB blocks (and a 1 GiB pool of 16 KiB blocks, 64 times the records), the daemon stopped
  (SIGTERM) and started again; measured from the new process's
  start until one client has acquired every block (each checked by a sample of bytes), against
  the same daemon started cold without `keep_dram` in the same run (start until its first Lookup
  answers). Per 10 GiB: the slope of the sizes measured, times 10 GiB.
- What the keep records cost a store+load of 64 x 2 MiB blocks, against a payload checksum at
  Commit (the alternative proof), in-process, same run.

Writes bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.units import format_bytes, parse_bytes
from kvtier.tiers import segment_owner

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SMALL = LayoutDecl(b"bench-restart-layout-16k", 16 * KiB, 16, model_id="bench-restart")
BIG = LayoutDecl(b"bench-restart-layout-2m", 2 * MiB, 16, model_id="bench-restart")
CHAIN = 8


def chain(seed: int, n: int = CHAIN) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """The block stored under `key` (any other block's bytes differ)."""
    return np.frombuffer((key * -(-nbytes // 32))[:nbytes], dtype=np.uint8)


def start(work: Path, dram: str, slot: str, *extra: str) -> subprocess.Popen[bytes]:
    """A daemon on `work`/kvtier.sock; returns once a client can register a layout."""
    work.mkdir(parents=True, exist_ok=True)
    sock = work / "kvtier.sock"
    with open(work / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--socket", str(sock), "--data-dir",
             str(work / "data"), "--dram-bytes", dram, "--slot-bytes", slot, "--ssd-bytes", "0",
             "--metrics", "", "--log-level", "info", "--max-blocks-per-request", "4096",
             "--grace-s", "1", *extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"daemon did not start:\n{(work / 'daemon.log').read_text()}")
        if sock.exists():
            try:
                with Client(sock, layout=SMALL, timeout=5):
                    return proc
            except Exception:  # not serving yet
                pass
        time.sleep(0.02)


def reclaim(work: Path) -> None:
    """Unlinks what a kept pool left in /dev/shm (the bench's daemons keep theirs)."""
    segment_owner.reclaim(segment_owner.record_path(work / "kvtier.sock"))


# -- SIGKILLs during batched writes ------------------------------------------------------------


def writer(sock: str, logs: str, first: int) -> None:
    """Stores chain after chain (module docstring); survives the daemon's deaths."""
    attempted = open(Path(logs) / "attempted", "a", buffering=1)  # noqa: SIM115
    committed = open(Path(logs) / "committed", "a", buffering=1)  # noqa: SIM115
    seed, kv = first, None
    while True:
        try:
            if kv is None:
                kv = Client(sock, layout=SMALL, timeout=2.0, lease_ttl_s=5.0)
            seed += 1
            keys = chain(seed)
            attempted.write(f"{seed}\n")
            with kv.store_into(keys) as tx:
                for i, view in tx.slots:
                    data = payload(keys[i], SMALL.block_bytes)
                    half = len(data) // 2
                    np.copyto(view[:half], data[:half])
                    time.sleep(0.0005)
                    np.copyto(view[half:], data[half:])
            committed.write(f"{seed}\n")
        except Exception:  # the daemon died: wait for the next one
            if kv is not None:
                kv.close()
            kv = None
            time.sleep(0.05)


def _seeds(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(x) for x in path.read_text().split("\n")[:-1] if x.isdigit()]


def check(kv: Client, seeds: list[int], must_hit: bool) -> tuple[int, int, int]:
    """(blocks served, wrong ones, chains not wholly served) of these chains."""
    served = wrong = short = 0
    for seed in seeds:
        keys = chain(seed)
        with kv.load(keys) as got:
            served += got.blocks
            for k, view in zip(keys, got.views, strict=False):
                wrong += not np.array_equal(view, payload(k, SMALL.block_bytes))
            short += must_hit and got.blocks < len(keys)
    return served, wrong, short


def kill_loop(kills: int, work: Path, dram: str = "256MiB", seed: int = 1) -> dict[str, Any]:
    """The SIGKILL part (module docstring): its counts."""
    rng = random.Random(seed)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lru = ("--keep-dram", "true", "--policy", "lru")  # (module docstring: what "lost" means)
    proc = start(work, dram, "16KiB", *lru)
    ctx = mp.get_context("spawn")
    w = ctx.Process(target=writer, args=(str(work / "kvtier.sock"), str(logs), 0), daemon=True)
    w.start()
    assert w.pid is not None
    out: dict[str, Any] = {"kills": 0, "committed_checked": 0, "lost": 0, "wrong": 0,
                           "served_checked": 0, "in_flight_chains": 0, "adopt_s": []}
    seen = 0
    try:
        with Client(work / "kvtier.sock", layout=SMALL, timeout=30) as kv:
            for _ in range(kills):
                time.sleep(rng.uniform(0.3, 1.5))
                proc.kill()
                proc.wait()
                os.kill(w.pid, signal.SIGSTOP)
                committed, attempted = _seeds(logs / "committed"), _seeds(logs / "attempted")
                began = time.monotonic()
                proc = start(work, dram, "16KiB", *lru)
                out["adopt_s"].append(time.monotonic() - began)
                fresh = committed[seen:]
                served, wrong, short = check(kv, fresh, True)
                out["lost"] += short
                out["wrong"] += wrong
                out["committed_checked"] += len(fresh)
                out["served_checked"] += served
                tried = [s for s in attempted if s not in set(committed)]
                old = rng.sample(committed[:seen], min(200, seen))
                served, wrong, _ = check(kv, tried[-50:] + old, False)
                out["in_flight_chains"] += len(tried[-50:])
                out["wrong"] += wrong
                out["served_checked"] += served
                seen = len(committed)
                out["kills"] += 1
                os.kill(w.pid, signal.SIGCONT)
    finally:
        os.kill(w.pid, signal.SIGCONT)
        w.terminate()
        w.join(10)
        proc.terminate()
        proc.wait(30)
        reclaim(work)
    log = (work / "daemon.log").read_text()
    out["adopt_log_s"] = [float(x) for x in re.findall(r"adopted from the previous daemon: "
                                                       r"\d+ blocks \([^)]*\) in ([\d.]+) s", log)]
    return out


# -- time to serve a full pool -----------------------------------------------------------------


def fill(kv: Client) -> int:
    """Stores chains of 64 blocks of its layout until they fill the pool; how many."""
    dram = next(t for t in kv.stats().tiers if t.tier == 2)
    n = kv.layout.block_bytes
    chains = dram.capacity_bytes // (64 * n)
    for c in range(chains):
        keys = chain(10_000 + c, 64)
        kv.store(keys, [payload(k, n) for k in keys])
    return int(chains)


def serve_time(work: Path, size: int, layout: LayoutDecl) -> dict[str, Any]:
    dram, slot = str(size), str(layout.block_bytes)
    proc = start(work, dram, slot, "--keep-dram", "true")
    try:
        with Client(work / "kvtier.sock", layout=layout, timeout=60) as kv:
            chains = fill(kv)
            held = [c for c in range(chains) if kv.lookup(chain(10_000 + c, 64)).hit_blocks == 64]
            proc.terminate()
            proc.wait(60)
            began = time.monotonic()
            proc = start(work, dram, slot, "--keep-dram", "true")
            blocks = 0
            for c in held:
                keys = chain(10_000 + c, 64)
                with kv.load(keys) as got:
                    assert got.blocks == 64, "a kept block was not served"
                    for k, v in zip(keys, got.views, strict=True):
                        assert bytes(v[:64]) == bytes(payload(k, 64))
                    blocks += got.blocks
            served_s = time.monotonic() - began
        proc.terminate()
        proc.wait(60)
        reclaim(work)
        began = time.monotonic()
        cold = start(work / "cold", dram, slot)
        cold_s = time.monotonic() - began
        cold.terminate()
        cold.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reclaim(work)
    log = (work / "daemon.log").read_text()
    found = re.findall(r"adopted from the previous daemon: \d+ blocks \([^)]*\) in ([\d.]+) s", log)
    return {"pool_bytes": size, "block_bytes": layout.block_bytes, "blocks": blocks,
            "start_to_serving_all_s": served_s,
            "adopt_log_s": float(found[-1]) if found else None, "cold_start_s": cold_s,
            "ratio_to_cold_start": served_s / cold_s}


# -- what keeping costs the store and load paths ----------------------------------------------


def records_cost(rounds: int = 200) -> dict[str, Any]:
    """Per store+load of 64 blocks of 2 MiB: the keep records' writes (Allocate's, Commit's per
    block, Acquire's and Release's deadlines) on an in-process pool, against the alternative of
    a payload checksum at Commit (xxh3-64 of the 128 MiB, the SSD tier's checksum), measured on
    the same slots in the same run."""
    import xxhash

    from kvtier.tiers.dram import DramPool, DramSpec

    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvtier-bench-") as tmp:
        pool = DramPool(DramSpec(name="p", slot_size=2 * MiB, slot_count=96, shm_dir=tmp,
                                 max_block=2 * MiB, keep=True))
        try:
            slots = pool.alloc_many(64, 2 * MiB)
            assert slots is not None
            for s in slots:
                pool.write(s, np.full(2 * MiB, s % 251, dtype=np.uint8))
            keys = chain(1, 64)
            records, sums = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                pool.writing(slots, "default", 1e9)
                for s, k in zip(slots, keys, strict=True):
                    pool.record(s, "default", b"L" * 32, k, k, 2 * MiB)
                pool.unhold(slots)
                pool.hold(slots, 1e9)
                pool.unhold(slots)
                t1 = time.perf_counter()
                records.append(t1 - t0)
            for _ in range(max(5, rounds // 20)):
                t0 = time.perf_counter()
                for s in slots:
                    xxhash.xxh3_64_intdigest(memoryview(pool.view(s)))  # type: ignore[arg-type]
                sums.append(time.perf_counter() - t0)
        finally:
            pool.close()
    return {"records_ms": 1e3 * statistics.median(records),
            "checksum_ms": 1e3 * statistics.median(sums), "bytes": 64 * 2 * MiB}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50, help="SIGKILLs during writes (default 50)")
    ap.add_argument("--sizes", default="1GiB,4GiB", help="pool sizes to time (default "
                    "1GiB,4GiB)")
    ap.add_argument("--quick", action="store_true", help="5 kills, a 1 GiB pool")
    args = ap.parse_args(argv)
    kills = 5 if args.quick else args.kills
    sizes = [GiB] if args.quick else [parse_bytes(s) for s in args.sizes.split(",")]
    cost = records_cost()
    print(f"keep records per store+load of 64 x 2 MiB: {cost['records_ms']:.3f} ms (median); a "
          f"payload checksum at Commit instead (xxh3-64 of the 128 MiB): "
          f"{cost['checksum_ms']:.1f} ms")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-restart-") as tmp:
        loop = kill_loop(kills, Path(tmp) / "kills")
        timing = [serve_time(Path(tmp) / f"serve-{s}", s, BIG) for s in sizes]
        timing.append(serve_time(Path(tmp) / "serve-small", GiB, SMALL))
    print(f"SIGKILLs during batched writes: {loop['kills']} kills, "
          f"{loop['committed_checked']} committed chains checked after their kill, "
          f"{loop['in_flight_chains']} chains in flight at a kill checked, "
          f"{loop['served_checked']} blocks served and compared")
    print(f"  lost (committed before a kill, not served after): {loop['lost']}   "
          f"wrong blocks served: {loop['wrong']}   (goal: 0 and 0: "
          f"{'reached' if loop['lost'] == loop['wrong'] == 0 else 'NOT reached'})")
    if loop["adopt_s"]:
        print(f"  restart to serving (median): {statistics.median(loop['adopt_s']):.2f} s")
    print("\ntime from the new daemon's start to serving a full pool (every block acquired "
          "once); adoption: the daemon's own figure; cold start: the same daemon without "
          "keep_dram, to its first answer")
    print(f"{'pool':>8}{'block':>8}{'blocks':>8}{'to serving all s':>18}{'adoption s':>12}"
          f"{'cold start s':>14}{'ratio':>8}")
    for t in timing:
        print(f"{format_bytes(t['pool_bytes']):>8}{format_bytes(t['block_bytes']):>8}"
              f"{t['blocks']:>8}{t['start_to_serving_all_s']:>18.2f}"
              f"{t['adopt_log_s'] or 0:>12.3f}{t['cold_start_s']:>14.2f}"
              f"{t['ratio_to_cold_start']:>8.2f}")
    per10 = None
    big = [t for t in timing if t["block_bytes"] == BIG.block_bytes]
    if len(big) >= 2:
        a, b = big[0], big[-1]
        slope = (b["start_to_serving_all_s"] - a["start_to_serving_all_s"]) / (
            b["pool_bytes"] - a["pool_bytes"])
        per10 = a["start_to_serving_all_s"] + slope * (10 * GiB - a["pool_bytes"])
        print(f"per 10 GiB (the slope of these sizes): {slope * 10 * GiB:.2f} s more; a 10 GiB "
              f"pool would serve all its blocks {per10:.2f} s after its start")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "restart.json").write_text(json.dumps(
        {"kills": loop, "serve": timing, "ten_gib_s": per10, "records": cost,
         "quick": args.quick}, indent=2))
    return 0 if loop["lost"] == loop["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
