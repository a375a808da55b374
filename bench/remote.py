"""Remote tier benchmark: 2 MiB blocks through the tier vs raw pipelined GET/SET, and Lookup cost.

    python -m bench.remote [--blocks 64] [--rounds 7] [--lookups 300]

Starts a redis-server on 127.0.0.1 (free port, temp dir, no persistence, allkeys-lru). Same
client (one redis-py connection pool), same bytes, same run, per round back to back:
  store   `RemoteTier.offer` of `--blocks` filled DRAM slots + `flush` (the writer thread's
          batches of 16: header + checksum + pipelined SET) vs raw pipelined SET of the same
          payloads in batches of 16 with the same client, straight from the slots (memoryview,
          no copy); which goes first alternates per round
  fetch   `RemoteTier.fetch_into` of the chain into DRAM slots (pipelined GETs of 8 blocks,
          fetched on a helper thread while the previous 8 are verified and copied into their
          slots) vs raw pipelined GETs of the same keys in the same chunks of 8, one after the
          other (bytes objects, no copy, no check); one 64-GET pipeline measured slower here
  lookup  Lookup RPC p50 of a 64-block chain that misses locally, on a daemon whose remote tier
          holds the chain (the remote check: one pipelined EXISTS round trip on a worker
          thread) vs a daemon without a remote tier, lookups interleaved
Goals: fetch and store >= 0.8x raw (median of per-round paired ratios), Lookup p50 added by
the remote check <= 1 ms. Writes bench/results/remote.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.daemon.cache.remote_tier import RemoteTier, RemoteWrite
from kvtier.daemon.cache.spec import RemoteTierSpec
from kvtier.daemon.rates.book import RateBook
from kvtier.engine.local_daemon import LocalDaemon
from kvtier.tiers.dram import DramPool, DramSpec
from kvtier.tiers.remote import FETCH_CHUNK, RemoteSpec, RemoteStore
from tests.redis_fixture import RedisServer

BLOCK = 2 << 20
BATCH = 16
RESULTS = Path(__file__).parent / "results" / "remote.json"
NS = "bench/ns2:" + "ab" * 32


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def transfer_rounds(url: str, blocks: int, rounds: int) -> dict[str, Any]:
    store = RemoteStore(RemoteSpec(url, timeout_s=10.0))
    pool = DramPool.create(DramSpec(name=f"kvtier-bench-remote-{time.time_ns()}",
                                    slot_size=BLOCK, slot_count=2 * blocks, replace_stale=True))
    tier = RemoteTier(store, pool, RateBook(), CollectorRegistry(), RemoteTierSpec(
        queue_bytes=2 * blocks * BLOCK, write_bytes_per_s=1e13, burst_bytes=1 << 50,
    ), on_written=lambda batch, stored: None)
    raw = store.client()
    rng = np.random.default_rng(7)
    slots = pool.alloc_many(2 * blocks)
    assert slots is not None
    src, dst = slots[:blocks], slots[blocks:]
    for s in src:
        pool.view(s)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    rows: dict[str, list[float]] = {k: [] for k in (
        "tier_store", "raw_store", "tier_fetch", "raw_fetch", "store_ratio", "fetch_ratio")}
    total = blocks * BLOCK
    def raw_set(keys: list[bytes]) -> float:
        t = time.perf_counter()
        for i in range(0, blocks, BATCH):
            pipe = raw.pipeline(transaction=False)
            for k, s in zip(keys[i:i + BATCH], src[i:i + BATCH], strict=True):
                pipe.set(k, memoryview(pool.view(s, BLOCK)))  # type: ignore[arg-type]
            pipe.execute()
        return time.perf_counter() - t

    def tier_set(keys: list[bytes]) -> float:
        t = time.perf_counter()
        for k, s in zip(keys, src, strict=True):
            assert tier.offer(RemoteWrite(NS, k, s, BLOCK)) == ""
        assert tier.flush(60)
        return time.perf_counter() - t

    def raw_get(keys: list[bytes]) -> float:
        t = time.perf_counter()
        got: list[Any] = []
        for i in range(0, blocks, FETCH_CHUNK):
            pipe = raw.pipeline(transaction=False)
            for k in keys[i:i + FETCH_CHUNK]:
                pipe.get(k)
            got += pipe.execute()
        seconds = time.perf_counter() - t
        assert all(len(v) == BLOCK for v in got)
        return seconds

    def tier_get(keys: list[bytes]) -> float:
        t = time.perf_counter()
        got = tier.fetch_into(NS, keys, dst, BLOCK)
        seconds = time.perf_counter() - t
        assert got == [BLOCK] * blocks
        assert bytes(pool.view(dst[-1])) == bytes(pool.view(src[-1]))
        return seconds

    try:
        for r in range(rounds):
            keys = [r.to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(blocks)]
            raw_keys = [b"raw:" + k for k in keys]
            if r % 2:  # alternate which goes first (the store's allocator warms up)
                tier_store, raw_store = tier_set(keys), raw_set(raw_keys)
                tier_fetch, raw_fetch = tier_get(keys), raw_get(raw_keys)
            else:
                raw_store, tier_store = raw_set(raw_keys), tier_set(keys)
                raw_fetch, tier_fetch = raw_get(raw_keys), tier_get(keys)
            raw.delete(*raw_keys)
            raw.delete(*[store.key(NS, k) for k in keys])
            for name, sec in (("tier_store", tier_store), ("raw_store", raw_store),
                              ("tier_fetch", tier_fetch), ("raw_fetch", raw_fetch)):
                rows[name].append(gbps(total, sec))
            rows["store_ratio"].append(raw_store / tier_store)
            rows["fetch_ratio"].append(raw_fetch / tier_fetch)
    finally:
        tier.close(5)
        pool.close()
    return {k: {"median": statistics.median(v), "all": v} for k, v in rows.items()}


def lookup_latency(url: str, workdir: Path, n: int) -> dict[str, Any]:
    layout = LayoutDecl(fingerprint=b"bench-remote-layout", block_bytes=65536, block_tokens=16,
                        model_id="bench-remote-model")
    base = ["--dram-bytes", "16MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "0"]
    keys = [b"L" + i.to_bytes(31, "big") for i in range(64)]
    data = [bytes([i]) * 65536 for i in range(64)]
    with LocalDaemon(workdir / "writer", [*base, "--remote-url", url, "--remote-queue-bytes",
                                          "8MiB"]) as w, \
            LocalDaemon(workdir / "with", [*base, "--remote-url", url]) as d1, \
            LocalDaemon(workdir / "without", base) as d0:
        with Client(w.socket, layout=layout) as kv:
            assert kv.store(keys, data).stored == 64
        store = RemoteStore(RemoteSpec(url))
        deadline = time.monotonic() + 30
        while store.client().dbsize() < 64:
            if time.monotonic() > deadline:
                raise RuntimeError("writer daemon did not publish the chain")
            time.sleep(0.05)
        store.close()
        with Client(d1.socket, layout=layout) as c1, Client(d0.socket, layout=layout) as c0:
            assert c1.lookup(keys).hit_blocks == 64 and c0.lookup(keys).hit_blocks == 0
            times: dict[str, list[float]] = {"with_remote": [], "without": []}
            for _ in range(n):
                for name, c in (("with_remote", c1), ("without", c0)):
                    t = time.perf_counter()
                    c.lookup(keys)
                    times[name].append(time.perf_counter() - t)
    p50 = {k: statistics.median(v) for k, v in times.items()}
    return {"p50_s": p50, "added_p50_s": p50["with_remote"] - p50["without"], "lookups": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lookups", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-") as tmp:
        server = RedisServer(Path(tmp) / "redis", ["--maxmemory", "2gb"]).start()
        try:
            version = server.client().info("server")["redis_version"]
            xfer = transfer_rounds(server.url, args.blocks, args.rounds)
            lookup = lookup_latency(server.url, Path(tmp), args.lookups)
        finally:
            server.stop()
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "redis_version": version, "block_bytes": BLOCK,
        "blocks": args.blocks, "rounds": args.rounds, "transfer": xfer, "lookup": lookup,
        "goals": {"fetch_ratio_ge_0.8": xfer["fetch_ratio"]["median"] >= 0.8,
                  "store_ratio_ge_0.8": xfer["store_ratio"]["median"] >= 0.8,
                  "lookup_added_p50_le_1ms": lookup["added_p50_s"] <= 1e-3},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"redis {version}, {args.blocks} blocks of 2 MiB, {args.rounds} rounds "
          "(GB/s medians; ratio = median of per-round raw/tier time)")
    print(f"{'':8} {'tier GB/s':>10} {'raw GB/s':>10} {'ratio':>7}  goal")
    for op in ("store", "fetch"):
        ratio = xfer[f"{op}_ratio"]["median"]
        print(f"{op:8} {xfer[f'tier_{op}']['median']:10.2f} {xfer[f'raw_{op}']['median']:10.2f} "
              f"{ratio:7.2f}x  >= 0.8x {'reached' if ratio >= 0.8 else 'NOT reached'}")
    p50 = lookup["p50_s"]
    added = lookup["added_p50_s"]
    print(f"Lookup p50, 64-block chain: {p50['with_remote'] * 1e3:.3f} ms with the remote check, "
          f"{p50['without'] * 1e3:.3f} ms without; added {added * 1e3:.3f} ms "
          f"(goal <= 1 ms {'reached' if added <= 1e-3 else 'NOT reached'})")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
