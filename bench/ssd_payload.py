"""SSD payload modes through a real daemon: LMDB values vs the slot file, in the same run.

    python -m bench.ssd_payload [--rounds 2] [--chains 96]

The daemon keeps SSD blocks in a slot file only when every block has one size (`--slot-bytes` =
`--max-block-bytes`), else as LMDB values (issue 13: a slot file has one slot size). Two real
daemons (`kvtier serve`, real shm, real LMDB on this disk) differ only in that: 2 MiB slots and a
largest block of 2 MiB ("slots") or 4 MiB ("lmdb"); the blocks are 2 MiB in both, so DRAM holds
them alike (one size class, the page a multiple of the block). 64 MiB DRAM, 384 MiB SSD, every
block written back (`--ssd-admit-after 1`, no wear limit), so both tiers churn:

  put   `--chains` chains of 4 x 2 MiB blocks stored one after another, each followed by the
        wait until the write-back queue is empty (`kvtier_writeback_queue_depth` 0 on /metrics:
        its blocks are on SSD); DRAM is full (each store evicts) and the SSD fills and evicts
        too: MB/s and p50 latency of store + write-back (4 blocks);
  get   the chains whose blocks are all on SSD only, loaded in random order (Acquire promotes
        them: LMDB read + verify into DRAM slots, evicting others), each checked: MB/s and p50
        latency of a load (4 blocks).

Rounds alternate the modes (slots, lmdb, slots, lmdb, ...); reported: medians per mode and the
ratios lmdb / slots (throughput: < 1 means LMDB values are slower; latency: > 1 slower). Writes
bench/results/ssd_payload.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import statistics
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.types import Tier
from kvtier.engine.local_daemon import LocalDaemon

MiB = 1 << 20
BLOCK = 2 * MiB
CHAIN = 4
LAYOUT = LayoutDecl(b"ssd-payload-2MiB", BLOCK, 16, model_id="bench/2MiB")
RESULTS = Path(__file__).parent / "results" / "ssd_payload.json"
MODES = {"slots": "2MiB", "lmdb": "4MiB"}  # --max-block-bytes; --slot-bytes 2MiB in both
TIER_SSD = 3  # kvtier.v1.Tier in Stats


def keys(c: int) -> list[bytes]:
    return [c.to_bytes(4, "big") + i.to_bytes(2, "big") + bytes(26) for i in range(CHAIN)]


def payload(c: int, i: int) -> bytes:
    return (c * CHAIN + i).to_bytes(4, "big") * (BLOCK // 4)


def tier(kv: Client, t: int) -> Any:
    return next(x for x in kv.stats().tiers if x.tier == t)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    if not found:
        raise SystemExit(f"{name} not on /metrics")
    return float(found.group(1))


def drained(port: int) -> None:
    deadline = time.monotonic() + 60
    while metric(port, "kvtier_writeback_queue_depth") > 0:
        if time.monotonic() > deadline:
            raise SystemExit("write-backs did not finish")
        time.sleep(0.0005)


def run(root: Path, max_block: str, chains: int, seed: int) -> dict[str, Any]:
    daemon = LocalDaemon(root, [
        "--dram-bytes", "64MiB", "--slot-bytes", "2MiB", "--max-block-bytes", max_block,
        "--ssd-bytes", "384MiB", "--ssd-admit-after", "1", "--ssd-write-bytes-per-day", "1TiB",
        "--metrics", "127.0.0.1:0", "--log-level", "info"]).start()
    try:
        port = int(re.findall(r"metrics http://[\d.]+:(\d+)/metrics", daemon.log())[-1])
        with Client(daemon.socket, layout=LAYOUT) as kv:
            put_lat: list[float] = []
            t0 = time.perf_counter()
            for c in range(chains):
                data = [payload(c, i) for i in range(CHAIN)]
                s = time.perf_counter()
                assert kv.store(keys(c), data).stored == CHAIN
                drained(port)  # a store is done when its blocks are on SSD too
                put_lat.append(time.perf_counter() - s)
            put_s = time.perf_counter() - t0
            dropped = kv.stats().writeback_dropped
            written = metric(port, "kvtier_ssd_written_bytes_total")
            ssd_only = [c for c in range(chains)
                        if (lk := kv.lookup(keys(c))).hit_blocks == CHAIN
                        and all(t is Tier.SSD for t in lk.tiers)]
            random.Random(seed).shuffle(ssd_only)
            get_lat: list[float] = []
            loaded = 0
            t1 = time.perf_counter()
            for c in ssd_only:
                s = time.perf_counter()
                with kv.load(keys(c)) as got:
                    n = len(got.views)
                    ok = all(bytes(v[:8]) == payload(c, i)[:8] for i, v in enumerate(got.views))
                get_lat.append(time.perf_counter() - s)
                if n != CHAIN or not ok:
                    raise SystemExit(f"chain {c}: {n} blocks loaded, bytes ok: {ok}")
                loaded += n
            get_s = time.perf_counter() - t1
            ssd = tier(kv, TIER_SSD)
    finally:
        daemon.stop()
        daemon.kill()
    return {
        "put_mb_s": chains * CHAIN * BLOCK / put_s / 1e6, "ssd_written_bytes": written,
        "put_p50_ms": 1e3 * statistics.median(put_lat),
        "get_mb_s": loaded * BLOCK / get_s / 1e6 if get_s else 0.0,
        "get_p50_ms": 1e3 * statistics.median(get_lat) if get_lat else 0.0,
        "chains_loaded_from_ssd": len(ssd_only), "writeback_dropped": dropped,
        "ssd_blocks_end": ssd.blocks,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chains", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print(f"{'round':>5} {'payload':8} {'put MB/s':>9} {'put p50 ms':>10} {'get MB/s':>9} "
          f"{'get p50 ms':>10} {'chains got':>10}")
    with tempfile.TemporaryDirectory(prefix="kvt-bench-ssdpayload-") as tmp:
        for r in range(args.rounds):
            for mode, max_block in MODES.items():
                got = run(Path(tmp) / f"{mode}{r}", max_block, args.chains, args.seed + r)
                rows.append({"round": r, "payload": mode, **got})
                print(f"{r:>5} {mode:8} {got['put_mb_s']:9.0f} {got['put_p50_ms']:10.2f} "
                      f"{got['get_mb_s']:9.0f} {got['get_p50_ms']:10.2f} "
                      f"{got['chains_loaded_from_ssd']:10}")
    med = {m: {k: statistics.median(r[k] for r in rows if r["payload"] == m)
               for k in ("put_mb_s", "put_p50_ms", "get_mb_s", "get_p50_ms")} for m in MODES}
    ratio = {k: med["lmdb"][k] / med["slots"][k] if med["slots"][k] else 0.0
             for k in med["lmdb"]}
    print(f"lmdb / slots (medians): put MB/s {ratio['put_mb_s']:.2f}x, put p50 "
          f"{ratio['put_p50_ms']:.2f}x, get MB/s {ratio['get_mb_s']:.2f}x, get p50 "
          f"{ratio['get_p50_ms']:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "bench": "ssd_payload", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "block_bytes": BLOCK, "chain_blocks": CHAIN,
        "chains": args.chains, "rounds": args.rounds, "rows": rows, "medians": med,
        "lmdb_over_slots": ratio,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
