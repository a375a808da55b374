"""KV-event publisher benchmark: what `kvtier serve --kv-events` costs the daemon, and how many
blocks/s the publisher sustains.

    python -m bench.kv_events [--quick]

- Lookup and Commit p50 through two real daemons, one with `--kv-events` (a subscriber process
  connected, receiving every message; decoding is the router's work, on its own machine) and
  one without, rounds interleaved off/on so the machine's load drifts over both alike. Each
  round stores fresh 16-block chains of 4 KiB blocks into a pool that is full after the first
  rounds (so every Commit also evicts: BlockStored and BlockRemoved both flow) and looks up a
  cached chain. Goal: on <= 1.05x off.
- Publisher throughput: `KvEventPublisher.offer` of N one-block events alternating stored and
  removed (the worst case: nothing merges), of N/16 sixteen-block ones, and of N one-block
  removals (evictions as the applier reports them), timed until a subscriber process has decoded
  every block. Goal: >= 100k blocks/s.
Writes bench/results/kv_events.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from bench.daemon import start_daemon
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core import kv_events as wire
from kvtier.core.types import Tier
from kvtier.daemon.cache.events import BlockEvent
from kvtier.daemon.kv_publisher import KvEventPublisher

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = LayoutDecl(b"bench-kvevents-layout", 4096, 16, model_id="bench-model")
CHAIN = 16


def _subscriber(endpoint: str, want: int, ready: Any, out: Any, stop: Any = None,
                bind: bool = False) -> None:
    """Counts decoded blocks until `want`; `want` 0: counts messages (not decoded, so this
    process takes little of the machine's CPU from the daemon) until `stop` is set."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    if bind:  # a collector's address the daemon connects to
        sub.bind(endpoint)
    else:
        sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    ready.set()
    blocks = messages = 0
    while want == 0 or blocks < want:
        if not sub.poll(100 if want == 0 else 30000):
            if want == 0 and not stop.is_set():
                continue
            break
        _, _, payload = sub.recv_multipart()
        messages += 1
        if want == 0:
            continue
        blocks += sum(len(e.block_hashes) for e in wire.decode(payload).events
                      if not isinstance(e, wire.AllBlocksCleared))
    out.put((blocks, messages, time.perf_counter()))
    sub.close(0)
    ctx.term()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _p50_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def daemon_cost(rounds: int, per_round: int) -> dict[str, Any]:
    payload = [np.full(4096, 7, np.uint8).tobytes()] * CHAIN
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-kvev-") as tmp:
        off, off_sock = start_daemon(Path(tmp) / "off", "4KiB", "8MiB")
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        on, on_sock = start_daemon(Path(tmp) / "on", "4KiB", "8MiB", "--kv-events", endpoint)
        try:
            ready, out, stop = mp.Event(), mp.Queue(), mp.Event()
            sub = mp.Process(target=_subscriber, args=(endpoint, 0, ready, out, stop, True))
            sub.start()
            ready.wait(30)
            time.sleep(0.5)
            times: dict[str, dict[str, list[float]]] = {
                "off": {"commit": [], "lookup": []}, "on": {"commit": [], "lookup": []}}
            clients = {"off": Client(off_sock, layout=LAYOUT), "on": Client(on_sock, layout=LAYOUT)}
            tag = 0
            for r in range(rounds):
                for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    kv, t = clients[name], times[name]
                    cached = [bytes([1, i]) + bytes(30) for i in range(CHAIN)]
                    kv.store(cached, payload)
                    for _ in range(per_round):
                        tag += 1
                        keys = [tag.to_bytes(4, "big") + bytes([i]) + bytes(27)
                                for i in range(CHAIN)]
                        t0 = time.perf_counter()
                        kv.store(keys, payload)
                        t1 = time.perf_counter()
                        kv.lookup(cached)
                        t2 = time.perf_counter()
                        t["commit"].append(t1 - t0)
                        t["lookup"].append(t2 - t1)
            for kv in clients.values():
                kv.close()
            stop.set()
            sub.join(60)
            blocks, messages, _ = out.get(timeout=5)
        finally:
            for p in (off, on):
                p.terminate()
                p.wait(30)
    res: dict[str, Any] = {"rounds": rounds, "per_round": per_round, "chain_blocks": CHAIN,
                           "subscriber_blocks": blocks, "subscriber_messages": messages}
    for op in ("commit", "lookup"):
        a, b = _p50_us(times["off"][op]), _p50_us(times["on"][op])
        res[op] = {"off_p50_us": round(a, 1), "on_p50_us": round(b, 1), "ratio": round(b / a, 3)}
    return res


def publisher_rate(n_blocks: int, per_event: int, kinds: str) -> dict[str, Any]:
    """`kinds`: "alternating" stored/removed events (nothing merges) or "evictions" (removals
    only, one block each, as the applier reports them: the publisher merges the runs)."""
    pub = KvEventPublisher("tcp://127.0.0.1:*", "", "bench", hwm=0)
    ready, out = mp.Event(), mp.Queue()
    sub = mp.Process(target=_subscriber, args=(pub.endpoint, n_blocks, ready, out))
    sub.start()
    ready.wait(30)
    time.sleep(0.5)
    events = [BlockEvent(i, i, 0.0, "t", b"", kinds == "alternating" and i % 2 == 0, Tier.DRAM,
                         tuple((i * per_event + j).to_bytes(32, "big") for j in range(per_event)),
                         b"", 16) for i in range(n_blocks // per_event)]
    t0 = time.perf_counter()
    offered = 0.0
    for i in range(0, len(events), 10_000):  # as fast as the publisher drains, never overfull
        while pub.pending() > 50_000:
            time.sleep(0.001)
        t1 = time.perf_counter()
        for e in events[i:i + 10_000]:
            pub.offer(e)
        offered += time.perf_counter() - t1
    sub.join(120)
    blocks, messages, t_end = out.get(timeout=5)
    pub.close()
    seconds = t_end - t0
    return {"blocks": n_blocks, "blocks_per_event": per_event, "kinds": kinds,
            "received_blocks": blocks,
            "messages": messages, "dropped": pub.dropped_blocks,
            "offer_ns_per_event": round(offered / len(events) * 1e9),
            "seconds": round(seconds, 3), "blocks_per_s": round(blocks / seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_events.json"))
    args = ap.parse_args(argv)
    rounds, per_round, n = (2, 50, 20_000) if args.quick else (6, 200, 300_000)
    cost = daemon_cost(rounds, per_round)
    rates = [publisher_rate(n, 1, "alternating"), publisher_rate(n, 16, "alternating"),
             publisher_rate(n, 1, "evictions")]
    print(f"{'op':8} {'off p50 us':>11} {'on p50 us':>10} {'on/off':>7}  (goal <= 1.05)")
    for op in ("lookup", "commit"):
        c = cost[op]
        print(f"{op:8} {c['off_p50_us']:>11} {c['on_p50_us']:>10} {c['ratio']:>7}")
    print(f"the daemon's subscriber received {cost['subscriber_messages']} messages")
    print(f"{'events':>12} {'blocks/event':>12} {'blocks/s':>10} {'offer ns/event':>15} "
          f"{'dropped':>8}  (goal >= 100000 blocks/s)")
    for r in rates:
        print(f"{r['kinds']:>12} {r['blocks_per_event']:>12} {r['blocks_per_s']:>10} "
              f"{r['offer_ns_per_event']:>15} {sum(r['dropped'].values()):>8}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": platform.node(), "quick": args.quick, "daemon": cost,
              "publisher": rates}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
