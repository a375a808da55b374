"""`kvtier simulate` runs the daemon's placement: one trace replayed through the daemon's `Cache`
(real shared-memory pool, real LMDB store, real write-back thread) and through
`kvtier.sim.replay` gives the same hits, tier by tier, the same SSD writes and the same
write-backs refused by the SSD write budget — exactly.

The daemon is driven as an engine drives it, request by request: Lookup the chain, Acquire its
cached prefix (SSD blocks are promoted), Allocate + Commit the missed blocks, Release; the
write-back queue is drained after the Lookup and after the Commit, which is what the simulator
assumes (a write-back is on SSD at once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.errors import ResourceExhausted
from kvtier.core.keys import layout_id
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.auth import Tenant
from kvtier.daemon.cache import Cache
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.namespaces import Namespace
from kvtier.index.policy_registry import DEFAULT_POLICY
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import replay
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request
from kvtier.sim.workloads import generate
from kvtier.tiers.blockfmt import HEADER_SIZE

BLOCK = 4096
MODEL, FP = "sim-equals-daemon", b"sim-equals-daemon-layout"
LID = layout_id(MODEL, FP)
T = Tenant("t")


def key(block_id: int) -> bytes:
    return block_id.to_bytes(32, "big")


def drive_daemon(tmp: Path, reqs: list[Request], dram: int, ssd: int, k: int, policy: str,
                 budget: tuple[int, int] | None) -> dict[str, object]:
    cfg = config.load({
        "socket": str(tmp / "s.sock"), "data_dir": str(tmp / "data"), "slot_bytes": "4KiB",
        "dram_bytes": str(dram * BLOCK), "ssd_bytes": str(ssd * (BLOCK + HEADER_SIZE)),
        "metrics": "", "ssd_admit_after": str(k), "policy": policy,
        "writeback_queue_bytes": str(dram * BLOCK),
        **({} if budget is None else {"ssd_write_bytes_per_day": str(budget[0]),
                                      "ssd_write_burst_bytes": str(budget[1])}),
    }, {"HOME": str(tmp)})
    c = Cache(cfg, DaemonMetrics())
    try:
        c.register_layout(T, MODEL, FP, BLOCK, TRACE_BLOCK_TOKENS, 32, None)
        got = dict.fromkeys(("dram", "ssd", "refs"), 0)
        for r in reqs:
            chain = b"".join(key(i) for i in r.hash_ids)
            tiers = c.lookup(T, LID, chain, 32).tiers
            got["dram"] += tiers.count(Tier.DRAM)
            got["ssd"] += tiers.count(Tier.SSD)
            got["refs"] += len(r.hash_ids)
            assert c.flush(30)
            lease = c.acquire(T, LID, chain, 32, 0).lease_id
            try:
                a = c.allocate(T, LID, chain, 32, b"", 0)
            except ResourceExhausted:
                pass
            else:
                if a.lease_id:
                    c.commit(T, a.lease_id)
                    assert c.flush(30)
            if lease:
                c.release(T, lease)
        got["ssd_writes"] = c.index.stats().ssd_writes
        got["refused"] = c.tiers.mover.stats().dropped_budget_total if c.tiers.mover else 0
        got["budget"] = (cfg.ssd_write_bytes_per_day, cfg.ssd_write_burst_bytes)
        got["dram_blocks"] = c.index.capacity(Tier.DRAM)  # the pool's pages may hold fewer
        assert c.leaked_slots() == 0
        return got
    finally:
        c.close()


def drive_sim(reqs: list[Request], dram: int | None, ssd: int, k: int, policy: str,
              budget: tuple[int, int]) -> dict[str, object]:
    assert dram is not None
    cfg = TierConfig(dram, ssd, policy, k, ssd_write_bytes_per_day=budget[0],
                     ssd_write_burst_bytes=budget[1], ssd_block_bytes=BLOCK + HEADER_SIZE)
    s = replay(reqs, cfg, tenant=Namespace(T.name, LID), key_bytes=32)
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
