"""`kvtier simulate` runs the daemon's placement: one trace replayed through the daemon's `Cache`
(real shared-memory pool, real LMDB store, real write-back thread) and through
`kvtier.sim.replay` gives the same hits, tier by tier, the same SSD writes and the same
write-backs refused by the SSD write budget — exactly.

The daemon is driven as an engine drives it, request by request: Lookup the chain, Acquire its
cached prefix (SSD blocks are promoted), Allocate + Commit the missed blocks, Release; the
write-back queue is drained after the Lookup and after the Commit, which is what the simulator
assumes (a write-back is on SSD at once).

With a remote tier the daemon's `Cache` writes through to a real redis-server and fetches from it
(the write-through queue drained after the Commit too), and the simulator's node runs over its
remote model: the same hits per tier (the remote ones as the Acquire served them), DRAM and SSD
evictions and remote writes dropped by the budget. One order the daemon leaves to its threads: a
block committed with both an SSD write-back and a remote write is requeued for eviction by
whichever writer reports last; the simulator takes the SSD writer's report first. These cases give
the same figures with either writer slowed by 10 ms a batch (checked by hand; a case that
depended on the order could fail intermittently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.errors import ResourceExhausted
from kvtier.core.keys import layout_id
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Namespace, Tenant
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.index.policies import DEFAULT_POLICY
from kvtier.sim.config import TierConfig
from kvtier.sim.fleet import RemoteStore
from kvtier.sim.replay import Node, replay
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request
from kvtier.sim.workloads import generate
from kvtier.tiers.blockfmt import HEADER_SIZE
from tests.cache_calls import run
from tests.redis_fixture import RedisServer, needs_redis

BLOCK = 4096
MODEL, FP = "sim-equals-daemon", b"sim-equals-daemon-layout"
LID = layout_id(MODEL, FP)
T = Tenant("t")


def key(block_id: int) -> bytes:
    return block_id.to_bytes(32, "big")


def drive_daemon(tmp: Path, reqs: list[Request], dram: int, ssd: int, k: int, policy: str,
                 budget: tuple[int, int] | None, remote: str = "",
                 remote_burst_blocks: int = 0) -> dict[str, object]:
    """`remote`: a Redis URL for the remote tier (write-through at Commit, k = 1); with
    `remote_burst_blocks` its write budget grants that many block writes, then (1 byte/s)
    nothing within the run."""
    remote_cfg = {} if not remote else {
        "remote_url": remote, "remote_timeout_s": "10", "remote_queue_bytes": str(dram * BLOCK),
        **({} if not remote_burst_blocks else {
            "remote_write_bytes_per_s": "1B",
            "remote_write_burst_bytes": str(remote_burst_blocks * BLOCK)}),
    }
    cfg = config.load({
        "socket": str(tmp / "s.sock"), "data_dir": str(tmp / "data"), "slot_bytes": "4KiB",
        "dram_bytes": str(dram * BLOCK), "ssd_bytes": str(ssd * (BLOCK + HEADER_SIZE)),
        "metrics": "", "ssd_admit_after": str(k), "policy": policy,
        "writeback_queue_bytes": str(dram * BLOCK),
        **({} if budget is None else {"ssd_write_bytes_per_day": str(budget[0]),
                                      "ssd_write_burst_bytes": str(budget[1])}),
        **remote_cfg,
    }, {"HOME": str(tmp)})
    metrics = DaemonMetrics()
    c = Cache(config.cache_spec(cfg), metrics)
    try:
        c.register_layout(T, MODEL, FP, BLOCK, TRACE_BLOCK_TOKENS, 32, None)
        got = dict.fromkeys(("dram", "ssd", "refs"), 0)
        if remote:
            got["remote"] = 0
        for r in reqs:
            chain = b"".join(key(i) for i in r.hash_ids)
            tiers = run(c.lookup_async(T, LID, chain, 32)).tiers
            got["dram"] += tiers.count(Tier.DRAM)
            got["ssd"] += tiers.count(Tier.SSD)
            got["refs"] += len(r.hash_ids)
            assert c.flush(30)
            acquired = run(c.acquire_async(T, LID, chain, 32, 0))
            lease = acquired.lease_id
            if remote:  # served from the store: what the Acquire fetched into DRAM
                got["remote"] += acquired.source_tiers.count(Tier.REMOTE)
            try:
                a = run(c.allocate_async(T, LID, chain, 32, b"", 0))
            except ResourceExhausted:
                pass
            else:
                if a.lease_id:
                    c.commit(T, a.lease_id)
                    assert c.flush(30)
            if lease:
                c.release(T, lease)
        got["ssd_writes"] = c.index.stats().ssd_writes
        got["refused"] = c.residency.mover.stats().dropped_budget_total if c.residency.mover else 0
        got["budget"] = (cfg.ssd_write_bytes_per_day, cfg.ssd_write_burst_bytes)
        got["dram_blocks"] = c.index.capacity(Tier.DRAM)  # the pool's pages may hold fewer
        if remote:
            stats = c.index.stats().evictions
            got["dram_dropped"] = stats["dram_dropped"]
            got["evicted_ssd"] = stats["ssd_dropped"] + stats["ssd_copy_dropped"]
            got["remote_dropped"] = metrics.registry.get_sample_value(
                "kvtier_remote_writes_dropped_total", {"reason": "budget"})
            for reason in ("queue_full", "down", "error", "refused"):  # the budget's, only
                assert not metrics.registry.get_sample_value(
                    "kvtier_remote_writes_dropped_total", {"reason": reason}), reason
        assert c.leaked_slots() == 0
        return got
    finally:
        c.close()


def drive_sim(reqs: list[Request], dram: int | None, ssd: int, k: int, policy: str,
              budget: tuple[int, int]) -> dict[str, object]:
    assert dram is not None
    cfg = TierConfig(dram, ssd, policy, k, ssd_write_bytes_per_day=budget[0],
                     ssd_write_burst_bytes=budget[1], ssd_block_bytes=BLOCK + HEADER_SIZE)
    s = replay(reqs, cfg, ns=Namespace(T.name, LID), key_bytes=32)
    return {"dram": s.hits_dram, "ssd": s.hits_ssd, "refs": s.block_refs,
            "ssd_writes": s.ssd_blocks_written, "refused": s.ssd_writes_refused,
            "budget": budget, "dram_blocks": dram}


def full_blocks(reqs: list[Request]) -> list[Request]:
    """The engine stores full blocks only: every trace block is made a full one. All requests
    arrive at one instant: the simulator's budget refills on the trace's clock, the daemon's on
    the wall clock, and neither refills (measurably) within the run."""
    return [r._replace(timestamp=0.0, input_length=len(r.hash_ids) * TRACE_BLOCK_TOKENS)
            for r in reqs]


CASES = [
    # workload, requests, DRAM blocks, SSD blocks, k, policy, budget (bytes/day, burst; None:
    # serve's default, 1 drive write a day)
    ("chat", 300, 120, 400, 2, "lru", None),
    ("agentic", 200, 150, 300, 1, "lru", None),
    ("docqa", 150, 200, 1500, 2, "lru", None),
    ("rag", 300, 60, 200, 2, "slru", None),
    ("chat", 300, 100, 150, 2, DEFAULT_POLICY, None),  # SSD full: SSD evictions too
    ("docqa", 150, 250, 600, 1, "lmcache-s3fifo", None),
    # a budget that grants 60 block writes, then (1 block a day) nothing within the trace
    ("chat", 300, 120, 400, 1, "lru", (BLOCK + HEADER_SIZE, 60 * (BLOCK + HEADER_SIZE))),
]


def case_id(c: tuple) -> str:
    return f"{c[0]}-{c[5]}-k{c[4]}-{'budget' if c[6] else 'default-budget'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_simulator_hits_and_ssd_writes_equal_the_daemons(tmp_path: Path, case: tuple) -> None:
    name, n, dram, ssd, k, policy, budget = case
    reqs = full_blocks(generate(name, n, seed=7))
    daemon = drive_daemon(tmp_path, reqs, dram, ssd, k, policy, budget)
    sim = drive_sim(reqs, daemon["dram_blocks"], ssd, k, policy,  # type: ignore[arg-type]
                    daemon["budget"])  # type: ignore[arg-type]
    assert sim == daemon
    assert daemon["ssd"] and daemon["ssd_writes"]  # the case exercises the SSD tier
    if budget is not None:
        assert daemon["refused"]


def drive_sim_remote(reqs: list[Request], dram: int, ssd: int, k: int, policy: str,
                     budget: tuple[int, int], remote_burst_blocks: int) -> dict[str, object]:
    """The simulator's node over its remote model (`kvtier.sim.fleet.RemoteStore`, no capacity
    bound: the test's redis-server never evicts these few MiB), the daemon's write budget as a
    bucket on the trace's clock, which stands still (`full_blocks`): its burst, then nothing."""
    cfg = TierConfig(dram, ssd, policy, k, ssd_block_bytes=BLOCK + HEADER_SIZE,
                     **({} if not ssd else {"ssd_write_bytes_per_day": budget[0],
                                            "ssd_write_burst_bytes": budget[1]}))
    store = RemoteStore(1 << 30)
    node = Node(cfg, ns=Namespace(T.name, LID), key_bytes=32, remote=store,
                remote_budget=None if not remote_burst_blocks else (
                    remote_burst_blocks * BLOCK, BLOCK))
    for r in reqs:
        node.serve(r)
    s = node.stats()
    return {"dram": s.hits_dram, "ssd": s.hits_ssd, "refs": s.block_refs, "remote": s.hits_remote,
            "ssd_writes": s.ssd_blocks_written, "refused": s.ssd_writes_refused,
            "budget": budget, "dram_blocks": dram, "dram_dropped": s.dropped_dram,
            "evicted_ssd": s.evicted_ssd, "remote_dropped": float(node.remote_writes_dropped),
            "remote_keys": len(store)}


REMOTE_CASES = [
    # workload, requests, DRAM blocks, SSD blocks, k, policy, remote write burst in blocks
    # (0: serve's default rate, never binding here)
    ("chat", 300, 80, 0, 2, "lru", 0),  # DRAM and the remote tier only
    ("rag", 300, 60, 200, 2, "slru", 0),  # DRAM, SSD and the remote tier
    ("chat", 300, 100, 150, 2, DEFAULT_POLICY, 0),  # DRAM admission: not every miss is stored
    ("docqa", 150, 150, 0, 1, "lmcache-s3fifo", 0),
    ("agentic", 200, 100, 300, 1, "lru", 0),  # k = 1: write-backs and remote writes at Commit
    ("docqa", 150, 200, 600, 1, "lmcache-s3fifo", 0),
    ("chat", 300, 80, 0, 2, "lru", 60),  # a remote write budget of 60 blocks, then nothing
]


def remote_case_id(c: tuple) -> str:
    return f"{c[0]}-{c[5]}-ssd{c[3]}-{'remote-budget' if c[6] else 'remote'}"


@needs_redis
@pytest.mark.parametrize("case", REMOTE_CASES, ids=remote_case_id)
def test_simulator_equals_the_daemon_over_a_remote_tier(tmp_path: Path, case: tuple) -> None:
    """The daemon's `Cache` with a real remote tier (a real redis-server: Lookup's EXISTS,
    Acquire's EXISTS + GET into claimed DRAM slots, Commit's write-through drained after each
    Commit) and the simulator's node over its remote model serve one trace: the same hits per
    tier (the remote ones counted as the Acquire served them), DRAM and SSD evictions, SSD
    writes and budget refusals, remote writes the budget dropped and blocks the store holds."""
    name, n, dram, ssd, k, policy, burst = case
    reqs = full_blocks(generate(name, n, seed=7))
    redis = RedisServer(tmp_path / "redis").start()
    try:
        daemon = drive_daemon(tmp_path, reqs, dram, ssd, k, policy, None, redis.url, burst)
        daemon["remote_keys"] = redis.client().dbsize()
    finally:
        redis.stop()
    sim = drive_sim_remote(reqs, daemon["dram_blocks"], ssd, k, policy,  # type: ignore[arg-type]
                           daemon["budget"], burst)  # type: ignore[arg-type]
    assert sim == daemon
    assert daemon["remote"] and daemon["dram_dropped"]  # blocks came back from the store
    if ssd:
        assert daemon["ssd"] and daemon["ssd_writes"]
    if burst:
        assert daemon["remote_dropped"]
