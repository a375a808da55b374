"""`kvtier simulate --nodes`: a trace routed over a fleet of simulated nodes (`kvtier.sim.fleet`).

The small traces here are worked by hand: which node each request goes to and how many blocks it
hits are written in the tests. Each node is DRAM-only LRU unless a test says otherwise, and
requests arrive a second apart, so every node's prefill queue (10,000 tokens/s) is empty again
when the next request comes: ties between nodes go to the fewest requests, then node 0.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates
from kvtier.core.types import Tier
from kvtier.sim.config import TierConfig
from kvtier.sim.fleet import FleetConfig, RemoteStore, ceilings, planner_saving, replay_fleet
from kvtier.sim.replay import replay
from kvtier.sim.trace import Request, read_trace, write_trace
from kvtier.sim.workloads import generate

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
LRU10 = TierConfig(10, policy="lru")


def req(t_s: float, *ids: int) -> Request:
    return Request(t_s * 1000.0, 512 * len(ids), 1, ids)


# Four requests sharing the prefix [0, 1], each with a block of its own.
SHARED = [req(0, 0, 1, 2), req(1, 0, 1, 3), req(2, 0, 1, 4), req(3, 0, 1, 5)]


def hits(result) -> int:
    return sum(n.stats.hits for n in result.nodes)


def fleet(routing: str, nodes: int = 2, tiers: TierConfig = LRU10, **kw) -> FleetConfig:
    return FleetConfig(tiers, nodes, routing, **kw)


def test_round_robin_splits_a_shared_prefix_and_misses_it():
    # r0 -> node 0 (miss 3), r1 -> node 1 (empty: miss 3), r2 -> node 0 (hits 0, 1),
    # r3 -> node 1 (hits 0, 1): 4 hits of 12 refs.
    r = replay_fleet(SHARED, fleet("round-robin"))
    assert r.assignment == [0, 1, 0, 1]
    assert hits(r) == 4
    assert [n.stats.hits for n in r.nodes] == [2, 2]
    assert r.imbalance == 1.0


def test_prefix_aware_keeps_a_shared_prefix_on_one_node_and_hits_it():
    # Without the load guard every request after the first finds [0, 1] in node 0's view:
    # 0 + 2 + 2 + 2 hits, all on node 0, imbalance 4 / 2.
    r = replay_fleet(SHARED, fleet("prefix-aware", balance=math.inf))
    assert r.assignment == [0, 0, 0, 0]
    assert hits(r) == 6
    assert r.imbalance == 2.0
    # Each node's prefill work: node 0 computed 3 + 1 + 1 + 1 blocks' tokens.
    assert [n.missed_tokens for n in r.nodes] == [6 * 512, 0]


def test_the_load_guard_bounds_requests_per_node():
    # balance 1: a node takes request i (0-based) only while its count + 1 <= max((i + 1) / 2,
    # smallest count + 1). r0 -> 0 (tie); r1: node 0 would have 2 > max(1, 1) -> node 1;
    # r2: both may (cap 2), both views hold [0, 1] -> tie -> node 0 (hits 2);
    # r3: node 0 would have 3 > 2 -> node 1 (hits 2).
    r = replay_fleet(SHARED, fleet("prefix-aware", balance=1.0))
    assert r.assignment == [0, 1, 0, 1]
    assert hits(r) == 4
    # 40 requests sharing a prefix over 4 nodes: without the guard all go to node 0; with
    # the default 1.25 no node gets more than 1.25 x 10.
    many = [req(i, 0, 1, 100 + i) for i in range(40)]
    free = replay_fleet(many, fleet("prefix-aware", nodes=4, balance=math.inf))
    assert free.requests_per_node == [40, 0, 0, 0]
    guarded = replay_fleet(many, fleet("prefix-aware", nodes=4))
    assert max(guarded.requests_per_node) <= 12
    assert guarded.imbalance <= 1.25
    assert hits(guarded) < hits(free) == 39 * 2


def test_event_lag_hides_a_store_from_the_next_request():
    # Lag 1.5 s: r1 (t = 1 s) cannot see r0's blocks (visible at 1.5 s), so both views are
    # empty, node 1 has fewer requests and gets it: a miss. r2 (t = 3 s) sees both nodes
    # holding [0, 1] and goes to node 0 (tie on everything): 2 hits.
    three = SHARED[:3]
    late = replay_fleet(three, fleet("prefix-aware", balance=math.inf, event_lag_s=1.5))
    assert late.assignment == [0, 1, 0]
    assert hits(late) == 2
    now = replay_fleet(three, fleet("prefix-aware", balance=math.inf, event_lag_s=0.0))
    assert now.assignment == [0, 0, 0]
    assert hits(now) == 4


def test_a_router_that_never_sees_events_routes_as_least_loaded():
    # Events later than the whole trace: every view stays empty, every prefix ties at 0, and
    # the tie-break is least-loaded's order, so the two routings pick the same nodes.
    reqs = generate("chat", 300, 2)
    tiers = TierConfig(40, 80)
    blind = replay_fleet(reqs, fleet("prefix-aware", nodes=3, tiers=tiers, balance=math.inf,
                                     event_lag_s=1e9, prefill_tokens_per_s=2000.0))
    loaded = replay_fleet(reqs, fleet("least-loaded", nodes=3, tiers=tiers,
                                      prefill_tokens_per_s=2000.0))
    assert blind.assignment == loaded.assignment
    seeing = replay_fleet(reqs, fleet("prefix-aware", nodes=3, tiers=tiers, balance=math.inf,
                                      prefill_tokens_per_s=2000.0))
    assert seeing.assignment != loaded.assignment and hits(seeing) > hits(loaded)


def test_evictions_reach_the_router():
    # DRAM of 2 blocks. r0 [0,1] -> node 0; r1 [5,6] -> node 1 (fewer requests); r2 [8,9] ->
    # node 0 (tie), which evicts [0,1]. r3 [0,1]: node 0's view lost [0,1] with the removal
    # events, so no node holds it and node 1 (fewer requests) gets it. A router that saw
    # only stores would send it to node 0 for a miss.
    trace = [req(0, 0, 1), req(1, 5, 6), req(2, 8, 9), req(3, 0, 1)]
    r = replay_fleet(trace, fleet("prefix-aware", tiers=TierConfig(2, policy="lru"),
                                  balance=math.inf))
    assert r.assignment == [0, 1, 0, 1]
    assert hits(r) == 0


def test_a_shared_remote_tier_lets_another_node_hit_what_one_stored():
    # Round-robin with a remote tier: r0 on node 0 writes 0, 1, 2; r1 on node 1 misses locally
    # and fetches 0, 1 from the store (2 remote hits), writes 3; r2 and r3 hit 0, 1 locally.
    r = replay_fleet(SHARED, fleet("round-robin", remote_blocks=100))
    assert r.assignment == [0, 1, 0, 1]
    assert hits(r) == 6
    assert [n.stats.hits_remote for n in r.nodes] == [0, 2]
    assert (r.remote_reads, r.remote_writes, r.remote_evicted, r.remote_dropped) == (2, 6, 0, 0)
    assert [n.stats.stranded_blocks for n in r.nodes] == [0, 0]
    none = replay_fleet(SHARED, fleet("round-robin"))
    assert (none.remote_reads, none.remote_writes) == (None, None)


def test_each_nodes_remote_write_rate_drops_what_it_cannot_write():
    # 100 bytes a block, 100 bytes/s per node (a burst of one block). r0 (t = 0, node 0)
    # writes block 0 and drops 1 and 2 (1 is refused, 2 would sit behind the hole). r1 (t = 1 s,
    # node 1) finds 0 in the store (1 remote hit), commits 1 and 3: writes 1, drops 3.
    r = replay_fleet(SHARED[:2], fleet("round-robin", remote_blocks=100,
                                       remote_write_bytes_per_s=100.0, block_bytes=100))
    assert (r.remote_writes, r.remote_dropped, r.remote_reads) == (2, 3, 1)
    assert hits(r) == 1


def test_remote_store_is_lru_and_an_existence_check_is_no_access():
    s = RemoteStore(2)
    a, b, c = b"a", b"b", b"c"
    s.store(a)
    s.store(b)
    assert s.present([a, b, c], 0) == 2  # no access: a stays the least recent
    s.store(c)
    assert a not in s and len(s) == 2 and s.evicted == 1
    s.fetch(b)  # b is now the most recent; the next write evicts c
    s.store(a)
    assert b in s and c not in s and a in s
    assert (s.reads, s.writes) == (1, 4)
    assert s.present([c, a], 0) == 0 and s.present([c, a], 1) == 1


def test_least_loaded_sends_a_request_to_the_emptier_queue():
    # Prefill 1,000 tokens/s. r0 (4 blocks = 2,048 tokens) -> node 0; r1 at 1 s: node 0 has
    # 1,048 tokens queued, node 1 none -> node 1 (2,048 queued); r2 at 1.5 s (1 block): node 0
    # 548, node 1 1,548 -> node 0 (1,060); r3 at 1.6 s: node 0 960, node 1 1,448 -> node 0,
    # where round-robin sends it to node 1.
    trace = [req(0, 0, 1, 2, 3), req(1, 10, 11, 12, 13), req(1.5, 20), req(1.6, 30)]
    r = replay_fleet(trace, fleet("least-loaded", prefill_tokens_per_s=1000.0))
    assert r.assignment == [0, 1, 0, 0]
    assert r.nodes[0].peak_backlog_s == pytest.approx(2.048)
    assert r.nodes[1].peak_backlog_s == pytest.approx(2.048)
    rr = replay_fleet(trace, fleet("round-robin", prefill_tokens_per_s=1000.0))
    assert rr.assignment == [0, 1, 0, 1]


def test_planner_prices_the_seconds_a_hit_saves():
    # A model with only linear work: 2 x 1,000 FLOPs per token; 1.024e6 FLOP/s and free,
    # instant transfers. A hit block of 512 tokens saves 512 x 2,000 / 1.024e6 = 1.0 s.
    cost = CostModel.dense("tiny", active_params=1000, layers=1, attn_dim=0)
    rates = PlanRates(math.inf, 0.0, math.inf, 0.0, 1.024e6)
    save = planner_saving(cost, rates, block_bytes=1000)
    assert save([Tier.DRAM], 1024) == pytest.approx(1.0)
    trace = [req(0, 0, 1), req(1, 0, 2)]  # r1 hits block 0 on node 0
    r = replay_fleet(trace, fleet("prefix-aware", balance=math.inf), saving=save)
    assert r.assignment == [0, 0]
    assert r.nodes[0].saved_s == pytest.approx(1.0) and r.nodes[1].saved_s == 0.0


def test_ceilings_per_node_and_pooled():
    # Round-robin: node 0 gets r0, r2 ([0,1,2], [0,1,4]): infinite and Belady (10 blocks)
    # hit 2 of 6; node 1 the same with 3, 5. One pooled cache of 2 x 10 blocks sees all four
    # requests: 0 + 2 + 2 + 2 hits.
    r = replay_fleet(SHARED, fleet("round-robin"))
    per_node, pooled = ceilings(SHARED, r)
    assert [(c.infinite_hits, c.belady_hits) for c in per_node] == [(2, 2), (2, 2)]
    assert pooled == 6


@pytest.fixture(scope="module")
def sample() -> list[Request]:
    if not SAMPLE.exists():
        pytest.skip(f"shared trace not found at {SAMPLE}")
    return read_trace(SAMPLE)


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded", "prefix-aware"])
def test_one_node_is_the_single_node_replay_exactly(sample, routing):
    cfg = TierConfig(1000, 4000, ssd_write_bytes_per_day=20_000.0, ssd_write_burst_bytes=500,
                     ssd_block_bytes=1)
    one = replay(sample[:1500], cfg)
    r = replay_fleet(sample[:1500], fleet(routing, nodes=1, tiers=cfg))
    assert r.nodes[0].stats._replace(seconds=0.0, cpu_seconds=0.0) == one._replace(
        seconds=0.0, cpu_seconds=0.0)
    assert one.hits_ssd > 0 and one.ssd_writes_refused > 0  # the comparison covers both


def test_fleet_invariants_on_a_generated_workload():
    reqs = generate("chat", 600, 1)
    tiers = TierConfig(60, 120)
    for routing in ("round-robin", "least-loaded", "prefix-aware"):
        for remote in (0, 300):
            r = replay_fleet(reqs, fleet(routing, nodes=4, tiers=tiers, remote_blocks=remote,
                                         event_lag_s=0.2))
            assert sum(r.requests_per_node) == 600
            assert sorted(set(r.assignment)) == [0, 1, 2, 3]
            assert all(n.stats.stranded_blocks == 0 for n in r.nodes)
            per_node, pooled = ceilings(reqs, r)
            assert hits(r) <= pooled
            if not remote:  # a node alone never beats Belady MIN on its own requests
                assert all(n.stats.hits <= c.belady_hits
                           for n, c in zip(r.nodes, per_node, strict=True))
            if routing == "prefix-aware":
                assert r.imbalance <= 1.25


# ------------------------------------------------------------------------------------------ CLI


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", "simulate", *args],
                          capture_output=True, text=True, timeout=240)


@pytest.fixture
def shared_trace(tmp_path: Path) -> Path:
    path = tmp_path / "shared.jsonl"
    write_trace(SHARED, path)
    return path


def test_cli_json_has_the_hand_worked_counts(shared_trace):
    base = ["--trace", str(shared_trace), "--dram-blocks", "10", "--policy", "lru", "--nodes",
            "2", "--json"]
    rr = json.loads(simulate(*base, "--routing", "round-robin").stdout)
    assert (rr["hits"], rr["requests_per_node"], rr["imbalance"]) == (4, [2, 2], 1.0)
    pa = simulate(*base, "--routing", "prefix-aware", "--balance", "inf")
    assert pa.returncode == 0, pa.stderr
    doc = json.loads(pa.stdout)
    assert (doc["hits"], doc["requests_per_node"], doc["imbalance"]) == (6, [4, 0], 2.0)
    assert doc["hit_ratio"] == 0.5 and doc["balance"] is None
    assert {"routing", "nodes", "hit_ratio_by_tier", "work_imbalance", "prefill_seconds_saved",
            "network", "belady_per_node_hit_ratio", "pooled_belady_hit_ratio",
            "infinite_hit_ratio", "per_node", "event_lag_s"} <= doc.keys()
    assert doc["per_node"][0]["hit_ratio"] == 0.5 and doc["per_node"][1]["requests"] == 0
    assert doc["prefill_seconds_saved"] is None and doc["network"] is None
    remote = json.loads(simulate(*base, "--routing", "round-robin", "--remote-blocks", "100",
                                 "--block-bytes", "1MiB").stdout)
    assert remote["hits"] == 6
    assert remote["network"] == {
        "remote_blocks_read": 2, "remote_blocks_written": 6, "remote_bytes_read": 2 << 20,
        "remote_bytes_written": 6 << 20, "remote_blocks_evicted": 0,
        "remote_writes_dropped": 0, "remote_write_bytes_per_s": 200_000_000.0}
    # 1 MiB/s per node, one block a second: r0 writes 0 and drops 1, 2; r1 fetches 0 (1 remote
    # hit), writes 1, drops 3; r2 (node 0, 2 s later) hits 0, 1 and writes 4; r3 hits 0, 1 on
    # node 1 and writes 5: 5 hits, 4 writes, 3 dropped.
    slow = json.loads(simulate(*base, "--routing", "round-robin", "--remote-blocks", "100",
                               "--block-bytes", "1MiB", "--remote-write-rate", "1MiB").stdout)
    assert slow["hits"] == 5
    assert (slow["network"]["remote_blocks_written"], slow["network"]["remote_writes_dropped"],
            slow["network"]["remote_blocks_read"]) == (4, 3, 1)


def test_cli_plot_compares_every_routing(shared_trace, tmp_path):
    # The plot replays all three routings: round-robin and least-loaded (empty queues at
    # every arrival: fewest requests, then node 0) split the shared prefix (4 of 12), unguarded
    # prefix-aware keeps it on node 0 (6 of 12).
    out = tmp_path / "cmp.png"
    p = simulate("--trace", str(shared_trace), "--dram-blocks", "10", "--policy", "lru",
                 "--nodes", "2", "--balance", "inf", "--json", "--plot", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [(r["routing"], r["hit_ratio"], r["imbalance"]) for r in doc["routings"]] == [
        ("round-robin", 4 / 12, 1.0), ("least-loaded", 4 / 12, 1.0), ("prefix-aware", 0.5, 2.0)]
    assert doc["plot"] == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_one_node_equals_single_node_simulate():
    args = ["--workload", "chat", "--requests", "400", "--dram-blocks", "100",
            "--ssd-blocks", "300", "--json"]
    single = json.loads(simulate(*args).stdout)
    one = json.loads(simulate(*args, "--nodes", "1").stdout)
    assert one["hits"] == single["hits"] and one["hit_ratio"] == single["hit_ratio"]
    assert one["hit_ratio_by_tier"]["ssd"] == single["hit_ratio_by_tier"]["ssd"]
    assert one["per_node"][0]["ssd_blocks_written"] == single["ssd_blocks_written"]
    assert one["per_node"][0]["belady_hit_ratio"] == single["belady_hit_ratio"]


def test_cli_table_with_a_model_and_plot(tmp_path):
    out = tmp_path / "fleet.png"
    p = simulate("--workload", "chat", "--requests", "300", "--preset", "Llama-3-8B",
                 "--dram-bytes", "8GiB", "--ssd-bytes", "16GiB", "--nodes", "3",
                 "--remote-bytes", "32GiB", "--event-lag", "250ms", "--plot", str(out))
    assert p.returncode == 0, p.stderr
    for needle in ("fleet: 3 nodes", "router sees node contents 250 ms late", "fleet prefix hits",
                   "load imbalance (max / mean requests per node)", "Belady MIN per node",
                   "one pooled cache", "prefill seconds saved (planner)", "Llama-3-8B",
                   "network: blocks read from the remote tier", "plot: ", "round-robin"):
        assert needle in p.stdout, needle
    assert "n/a" not in p.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--nodes", "two"], "--nodes must be a whole number"),
        (["--nodes", "2", "--routing", "nearest"], "invalid choice: 'nearest'"),
        (["--nodes", "2", "--event-lag", "-1"], "--event-lag must be seconds"),
        (["--nodes", "2", "--event-lag", "soon"], "--event-lag must be seconds"),
        (["--nodes", "2", "--event-lag", "1e999"], "--event-lag must be finite"),
        (["--nodes", "2", "--routing", "round-robin", "--event-lag", "1"], "sees no node"),
        (["--nodes", "2", "--remote-bytes", "lots"], "--remote-bytes"),
        (["--nodes", "2", "--remote-bytes", "1TiB"], "give --preset NAME"),
        (["--nodes", "2", "--remote-blocks", "-5"], ">= 0"),
        (["--nodes", "2", "--remote-blocks", "0"], "holds no 512-token block"),
        (["--nodes", "2", "--balance", "0.9"], "--balance must be >= 1"),
        (["--nodes", "2", "--balance", "fair"], "--balance must be"),
        (["--nodes", "2", "--prefill-rate", "0"], "--prefill-rate must be"),
        (["--nodes", "2", "--remote-bandwidth", "10GB"], "give --preset NAME"),
        (["--nodes", "2", "--remote-write-rate", "1GB"], "give --remote-bytes SIZE"),
        (["--nodes", "2", "--remote-blocks", "9", "--remote-write-rate", "1GB"],
         "give --preset NAME"),
        (["--nodes", "2", "--remote-blocks", "9", "--block-bytes", "1MiB",
          "--remote-write-rate", "fast"], "--remote-write-rate"),
        (["--routing", "prefix-aware"], "give --nodes N"),
        (["--remote-blocks", "10"], "give --nodes N"),
    ],
)
def test_cli_bad_fleet_flags_exit_2_with_one_line(args, needle):
    p = simulate("--workload", "chat", "--requests", "50", "--dram-blocks", "10", *args)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("kvtier simulate: error: ")
    assert p.stdout == ""
