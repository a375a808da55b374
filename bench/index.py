"""Prefix-index numbers at scale: memory per cached block, inserts/s, lookups/s, evictions/s.

    python -m bench.index [--blocks N] [--chain L] [--repeats R] [--policy P] [--compare Q]

Workload: N cached blocks (default 1,000,000) of one namespace with 32-byte keys (sha256_cbor
width), as chains of L blocks (default 64 = a 1,024-token prompt in 16-token blocks) plus 16
chains of 1,024 blocks.

- Memory: `tracemalloc` traced bytes after building the index (key bytes included — the index
  keeps them alive), divided by N; two residencies: all in DRAM with a slot id each (the daemon's
  worst case) and all on SSD. Goal <= 300 bytes/block. The index is built with DRAM and SSD
  capacities of N blocks each, so its default admission history (`kvtier.index.policies.
  AdmissionHistory`, one 4-byte word per block of capacity) has 2N words = 8 B per cached block;
  the DRAM build is also measured without history (``admission_history=0``), and the difference
  is reported as the history's share. Baseline: a plain ``dict`` key -> parent key holding the
  same keys.
- Throughput (no tracemalloc), index full at N blocks in DRAM: inserts (building it), lookups of
  random L-block chains (full hits) and of 1,024-block chains, a miss, pin+unpin, and the
  steady state at capacity (evict L, insert a new L-chain). Baseline: the same walks over the
  plain dict (get + parent check per key). Medians over R repeats.

- `--compare Q`: a second index of the same blocks with policy Q, and the lookups (1,024-block
  chains, the L-block batch, a missed chain) timed in alternating rounds against the first, best
  round each, with the ratio Q / P: what a policy's lookup hooks cost, measured so that load
  from other jobs hits both sides alike.

Writes bench/results/index.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.core.types import Tier
from kvtier.index.policies import DEFAULT_POLICY
from kvtier.index.prefix import PrefixIndex

RESULTS = Path(__file__).parent / "results" / "index.json"
LONG, N_LONG = 1024, 16


def make_chains(n: int, chain: int, seed: int = 0) -> list[list[bytes]]:
    rng = random.Random(seed)
    n_long = min(N_LONG, n // (2 * LONG))
    sizes = [LONG] * n_long
    rest = n - LONG * n_long
    sizes += [chain] * (rest // chain) + ([rest % chain] if rest % chain else [])
    blob = rng.randbytes(32 * n)
    out, pos = [], 0
    for size in sizes:
        out.append([blob[i * 32:(i + 1) * 32] for i in range(pos, pos + size)])
        pos += size
    return out


def build(chains: list[list[bytes]], n: int, tier: Tier, slots: bool,
          history: int | None = None, policy: str = DEFAULT_POLICY) -> PrefixIndex:
    ix = PrefixIndex(dram_blocks=n, ssd_blocks=n, admission_history=history, policy=policy)
    slot = 0
    for keys in chains:
        ix.admit(0, keys, 0)  # as Allocate does: the policy's per-block state is measured too
        parent = None
        for k in keys:
            ix.insert(0, k, parent, tier, dram_slot=slot if slots else None)
            slot += 1
            parent = k
    return ix


def build_dict(chains: list[list[bytes]]) -> dict[bytes, bytes | None]:
    d: dict[bytes, bytes | None] = {}
    for keys in chains:
        parent = None
        for k in keys:
            d[k] = parent
            parent = k
    return d


def traced_bytes_per_block(n: int, chain: int, make: Callable[[list[list[bytes]]], Any]) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    chains = make_chains(n, chain)
    obj = make(chains)
    del chains
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del obj
    return used / n


def dict_walk(d: dict[bytes, bytes | None], keys: list[bytes]) -> int:
    parent = None
    hits = 0
    for k in keys:
        if k not in d or d[k] != parent:
            break
        hits += 1
        parent = k
    return hits


def rate(fn: Callable[[], Any], ops: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return ops / statistics.median(samples)


def compare(chains: list[list[bytes]], n: int, built: dict[str, PrefixIndex], other: str,
            batch: list[list[bytes]], longs: list[list[bytes]], miss: list[bytes],
            rounds: int) -> dict[str, Any]:
    """Lookup times of two policies' indexes over the same blocks, measured in alternating
    rounds (best round each, so a neighbour's burst hits both or neither): 1,024-block chains,
    the L-block batch, a missed chain. Prints them with the ratio other / first."""
    ixs = {**built, other: build(chains, n, Tier.DRAM, True, policy=other)}
    tests: dict[str, list[list[bytes]]] = {
        "lookup_1024_us": longs, "lookup_chain_us": batch, "miss_us": [miss] * 2000}
    best: dict[str, dict[str, float]] = {p: {} for p in ixs}
    for _ in range(rounds):
        for p, ix in ixs.items():
            for name, cs in tests.items():
                t0 = time.perf_counter()
                for c in cs:
                    ix.lookup(0, c)
                us = (time.perf_counter() - t0) / len(cs) * 1e6
                best[p][name] = min(best[p].get(name, us), us)
    first = next(iter(built))
    print(f"interleaved ({rounds} rounds, best): {first} vs {other}")
    for name in tests:
        a, b = best[first][name], best[other][name]
        print(f"  {name:<16} {a:9.2f} us  {b:9.2f} us  {b / a:5.2f}x")
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.index", description=__doc__.split("\n")[0],
    )
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default=DEFAULT_POLICY, help=f"index policy ({DEFAULT_POLICY})")
    ap.add_argument("--compare", metavar="POLICY", default="",
                    help="also time lookups against an index with this policy, interleaved")
    a = ap.parse_args(argv)
    pol = a.policy
    n, chain, reps = a.blocks, a.chain, a.repeats

    mem = {
        "index_dram_slots": traced_bytes_per_block(
            n, chain, lambda c: build(c, n, Tier.DRAM, True, policy=pol)),
        "index_dram_slots_no_history": traced_bytes_per_block(
            n, chain, lambda c: build(c, n, Tier.DRAM, True, history=0, policy=pol)),
        "index_ssd": traced_bytes_per_block(
            n, chain, lambda c: build(c, n, Tier.SSD, False, policy=pol)),
        "dict_baseline": traced_bytes_per_block(n, chain, build_dict),
    }

    chains = make_chains(n, chain)
    t0 = time.perf_counter()
    ix = build(chains, n, Tier.DRAM, True, policy=pol)
    insert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    d = build_dict(chains)
    dict_insert_s = time.perf_counter() - t0
    assert len(ix) == n == len(d)

    rng = random.Random(1)
    short = [c for c in chains if len(c) == chain]
    longs = [c for c in chains if len(c) == LONG] or [chains[0]]
    batch = [rng.choice(short) for _ in range(2000)]
    miss = [b"\x00" * 32, *batch[0][1:]]
    assert all(len(ix.lookup(0, c).blocks) == len(c) for c in batch[:50])

    def lookups() -> None:
        for c in batch:
            ix.lookup(0, c)

    def dict_lookups() -> None:
        for c in batch:
            dict_walk(d, c)

    def long_lookups() -> None:
        for c in longs:
            ix.lookup(0, c)

    def dict_long() -> None:
        for c in longs:
            dict_walk(d, c)

    def misses() -> None:
        for _ in range(2000):
            ix.lookup(0, miss)

    pin_keys = [k for c in batch[:200] for k in c]

    def pins() -> None:
        for k in pin_keys:
            ix.pin(0, k)
        for k in pin_keys:
            ix.unpin(0, k)

    fresh = iter(make_chains(chain * 4000, chain, seed=2))

    def churn() -> None:
        for _ in range(200):
            keys = next(fresh)
            evicted = ix.evict(Tier.DRAM, len(keys))
            slots = [e.dram_slot for e in evicted]
            parent = None
            for k, s in zip(keys, slots, strict=True):
                ix.insert(0, k, parent, Tier.DRAM, dram_slot=s)
                parent = k

    blocks_per_batch = len(batch) * chain
    res = {
        "insert_blocks_per_s": n / insert_s,
        "dict_insert_blocks_per_s": n / dict_insert_s,
        "lookup_chains_per_s": rate(lookups, len(batch), reps),
        "lookup_blocks_per_s": rate(lookups, blocks_per_batch, reps),
        "dict_lookup_blocks_per_s": rate(dict_lookups, blocks_per_batch, reps),
        "lookup_1024_us": 1e6 / rate(long_lookups, len(longs), reps),
        "dict_1024_us": 1e6 / rate(dict_long, len(longs), reps),
        "miss_us": 1e6 / rate(misses, 2000, reps),
        "pin_unpin_per_s": rate(pins, len(pin_keys), reps),
        "churn_blocks_per_s": rate(churn, 200 * chain, min(reps, 3)),
    }
    assert len(ix) == n and ix.stats().dram_blocks == n

    history_words = ix.history.size
    mem["history_share"] = mem["index_dram_slots"] - mem["index_dram_slots_no_history"]
    rows = [
        ("memory, DRAM + slot id", f"{mem['index_dram_slots']:.0f} B/block",
         f"{mem['dict_baseline']:.0f} B/block (dict)",
         f"{mem['index_dram_slots'] / mem['dict_baseline']:.2f}x"),
        ("  of which history", f"{mem['history_share']:.1f} B/block "
         f"({history_words:,} words x 4 B)", "", ""),
        ("memory, no history", f"{mem['index_dram_slots_no_history']:.0f} B/block", "", ""),
        ("memory, SSD only", f"{mem['index_ssd']:.0f} B/block", "", ""),
        ("insert", f"{res['insert_blocks_per_s'] / 1e3:.0f} K blocks/s",
         f"{res['dict_insert_blocks_per_s'] / 1e3:.0f} K blocks/s",
         f"{res['dict_insert_blocks_per_s'] / res['insert_blocks_per_s']:.1f}x slower"),
        (f"lookup {chain}-block chain", f"{res['lookup_chains_per_s'] / 1e3:.1f} K chains/s "
         f"({res['lookup_blocks_per_s'] / 1e6:.2f} M blocks/s)",
         f"{res['dict_lookup_blocks_per_s'] / 1e6:.2f} M blocks/s",
         f"{res['dict_lookup_blocks_per_s'] / res['lookup_blocks_per_s']:.1f}x slower"),
        ("lookup 1024-block chain", f"{res['lookup_1024_us']:.0f} us",
         f"{res['dict_1024_us']:.0f} us", f"{res['lookup_1024_us'] / res['dict_1024_us']:.1f}x"),
        ("lookup miss", f"{res['miss_us']:.2f} us", "", ""),
        ("pin + unpin", f"{res['pin_unpin_per_s'] / 1e6:.2f} M blocks/s", "", ""),
        ("evict + insert at capacity", f"{res['churn_blocks_per_s'] / 1e3:.0f} K blocks/s", "", ""),
    ]
    print(f"PrefixIndex at {n:,} cached blocks (chains of {chain} + {len(longs)} of {LONG})")
    print(f"{'':<28} {'kvtier index':<36} {'baseline':<26} {'ratio'}")
    for r in rows:
        print(f"{r[0]:<28} {r[1]:<36} {r[2]:<26} {r[3]}")
    goal = mem["index_dram_slots"] <= 300
    print(f"goal <= 300 B/block (DRAM + slot id): {'met' if goal else 'NOT met'}")
    cmp: dict[str, Any] = {}
    if a.compare:
        del d
        cmp = compare(chains, n, {pol: ix}, a.compare, batch, longs, miss, 3 * reps)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "python": platform.python_version(),
        "command": "python -m bench.index " + " ".join(argv or []),
        "policy": pol,
        "blocks": n, "chain": chain, "repeats": reps, "history_words": history_words,
        "memory_bytes_per_block": mem, "memory_goal_met": goal, **res, "compare": cmp}, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
