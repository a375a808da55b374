"""The online miss-ratio curve (`kvtier.index.mrc`): exact where LRU is exact, bounded, and within 3
points of `kvtier simulate` replays of the shared trace at the daemon's capacity grid."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.daemon.cache.stats import MRC_MIN_KEYS
from kvtier.index import mrc
from kvtier.index.mrc import (
    ReuseSampler,
    capacity_grid,
    keys_for_budget,
    labelled,
    measure_bytes,
    memory_bytes,
)
from kvtier.sim.mrc import compare
from kvtier.sim.trace import Request, read_trace

TRACE = Path(os.environ.get(
    "KVTIER_TRACE",
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"))


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    if not TRACE.exists():
        pytest.skip(f"shared trace not present at {TRACE} "
                    "(../shared/traces from the repo root, or $KVTIER_TRACE)")
    return read_trace(TRACE)


def chains(n: int, seed: int) -> list[list[bytes]]:
    """Prompts sharing prefixes: a few system prompts, each with a few follow-ups."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        root = rng.randrange(30)
        branch = rng.randrange(8)
        depth = rng.randrange(1, 12)
        out.append([f"{root}/{branch if j >= 3 else 0}/{j}".encode().ljust(32, b".")
                    for j in range(depth)])
    return out


def lru_hits(lookups: list[list[bytes]], capacity: int) -> tuple[int, int]:
    """Brute-force LRU over blocks, each lookup touching its chain root-last."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = refs = 0
    for keys in lookups:
        for k in reversed(keys):
            refs += 1
            if k in cache:
                hits += 1
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits, refs


@pytest.mark.parametrize("capacity", [5, 40, 150, 400])
def test_unsampled_dram_estimate_is_exact_lru(capacity: int) -> None:
    lookups = chains(3000, seed=capacity)
    s = ReuseSampler([(capacity, 0)], rate=1.0, max_keys=1 << 20)
    for keys in lookups:
        s.observe("t", keys)
    hits, refs = lru_hits(lookups, capacity)
    (p,) = s.points()
    assert s.refs == pytest.approx(refs)
    assert p.dram_hit_ratio == pytest.approx(hits / refs, abs=1e-9)


def test_a_long_chain_is_accessed_in_one_batch() -> None:
    """40 keys sampled at once take the vectorised path: looked up twice, root last, every key's
    reuse distance is 39 (the other 39 keys), so it hits at 40 blocks and never at 39."""
    assert mrc._BATCH_MIN <= 40
    keys = [bytes([i]) * 32 for i in range(40)]
    s = ReuseSampler([(40, 0), (39, 0)], rate=1.0)
    s.observe("t", keys)
    s.observe("t", keys)
    big, small = s.points()
    assert (s.refs, s.sampled_refs, s.tracked_keys) == (80.0, 80, 40)
    assert (big.dram_hit_ratio, small.dram_hit_ratio) == (0.5, 0.0)


@pytest.mark.parametrize("capacity", [5, 40, 150, 400])
def test_batched_long_chains_estimate_exact_lru(capacity: int) -> None:
    rng = random.Random(capacity)
    lookups = [[f"{rng.randrange(20)}/{j}/{rng.randrange(2) if j > 20 else 0}".encode()
                .ljust(32, b".") for j in range(rng.randrange(16, 90))] for _ in range(600)]
    s = ReuseSampler([(capacity, 0), (capacity * 2, 0)], rate=1.0, max_keys=1 << 20)
    for keys in lookups:
        s.observe("t", keys)
    assert s.refs == sum(map(len, lookups))
    for p, cap in zip(s.points(), (capacity, capacity * 2), strict=True):
        hits, refs = lru_hits(lookups, cap)
        assert p.dram_hit_ratio == pytest.approx(hits / refs, abs=1e-9)


@pytest.mark.parametrize("max_keys", [300, 4096])
def test_batched_accesses_leave_what_one_at_a_time_leaves(
        max_keys: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised path (`_access_batch`) against `_access` key by key: the same estimates to
    the last bit and the same table, through rate halvings, compactions (taken one at a time),
    repeated keys and two tenants."""
    def run(batch_min: int) -> ReuseSampler:
        monkeypatch.setattr(mrc, "_BATCH_MIN", batch_min)
        rng = random.Random(max_keys)
        s = ReuseSampler(capacity_grid(2000, 0), max_keys=max_keys)
        for _ in range(1500):
            keys = [f"{rng.randrange(40)}/{j}/{rng.randrange(3) if j > 50 else 0}".encode()
                    .ljust(32, b".") for j in range(rng.choice([1, 20, 300, 1024]))]
            if rng.random() < 0.1:
                keys += keys[:3]  # a key twice in one Lookup: one at a time
            s.observe(rng.randrange(2), keys)
        return s

    one, batched = run(1 << 30), run(1)
    assert batched.points() == one.points()
    assert (batched.refs, batched.sampled_refs, batched.rate) == (one.refs, one.sampled_refs,
                                                                  one.rate)
    assert batched._keys == one._keys
    assert 0 < one.points()[0].dram_hit_ratio < 1


def test_memory_stays_under_max_keys_by_lowering_the_rate() -> None:
    s = ReuseSampler(capacity_grid(1000, 4000), max_keys=256)
    for i in range(2000):
        s.observe(0, [i.to_bytes(8, "big"), (i + 1).to_bytes(8, "big")])
        assert s.tracked_keys <= 256
    assert s.rate < 0.25
    # the rate only halves: refs keep their weight
    assert s.refs == pytest.approx(4000, rel=0.2)


def test_tenants_are_sampled_apart() -> None:
    s = ReuseSampler([(100, 0)], rate=1.0)
    keys = [bytes([i]) * 16 for i in range(10)]
    s.observe("a", keys)
    s.observe("b", keys)  # same key bytes, another tenant: not a reuse
    assert s.points()[0].dram_hit_ratio == 0.0
    s.observe("a", keys)
    assert s.points()[0].dram_hit_ratio == pytest.approx(10 / 30)


def test_odd_key_lengths_take_the_scalar_path() -> None:
    a = ReuseSampler([(50, 0)], rate=1.0)
    for keys in chains(500, 3):
        a.observe(0, [k[:13] for k in keys])
    assert 0 < a.points()[0].dram_hit_ratio < 1


@pytest.mark.parametrize("bad", [
    {"capacities": []}, {"capacities": [(-1, 0)]}, {"rate": 0.0}, {"rate": 1.5},
    {"admit_k": 0}, {"max_keys": 3},
])
def test_bad_arguments_are_refused(bad: dict[str, object]) -> None:
    args: dict[str, object] = {"capacities": [(10, 10)], **bad}
    caps = args.pop("capacities")
    with pytest.raises(ValueError):
        ReuseSampler(caps, **args)  # type: ignore[arg-type]


def test_grid_labels() -> None:
    grid = capacity_grid(100, 1000)
    assert grid[0] == (100, 1000) and (800, 1000) in grid and (100, 250) in grid
    s = ReuseSampler(grid)
    names = [(scaled, f) for scaled, f, _p in labelled(s.points())]
    assert names[0] == ("none", 1.0) and ("dram", 0.25) in names and ("ssd", 8.0) in names
    assert [p.hit_ratio for p in s.points()] == [0.0] * len(grid)


def check_against_replays(trace: list[Request], dram: int, ssd: int) -> None:
    rows, sampler = compare(trace, dram, ssd, max_keys=MRC_MIN_KEYS)
    assert sampler.tracked_keys <= MRC_MIN_KEYS
    bad = [r for r in rows if abs(r.error) > 0.03]
    table = "\n".join(f"{r.scaled} x{r.factor:g} ({r.dram_blocks}, {r.ssd_blocks}): "
                      f"est {r.estimated:.3f} replay {r.replayed:.3f}" for r in rows)
    assert not bad, table
    # the curve is not flat: it says something about buying capacity
    assert max(r.replayed for r in rows) - min(r.replayed for r in rows) > 0.1


def test_dram_estimate_within_3_points_of_replays(trace: list[Request]) -> None:
    check_against_replays(trace, 2000, 0)


def test_estimate_within_3_points_of_replays(trace: list[Request]) -> None:
    check_against_replays(trace, 2000, 8000)


@pytest.mark.parametrize(("dram", "ssd"), [(1000, 4000), (3000, 3000), (4000, 16000)])
def test_estimate_within_3_points_of_replays_other_splits(
    trace: list[Request], dram: int, ssd: int
) -> None:
    check_against_replays(trace, dram, ssd)


@pytest.mark.parametrize("budget", [1 << 20, 3 << 20])
def test_a_full_table_stays_within_its_byte_budget(budget: int) -> None:
    s = ReuseSampler([(10**7, 0)], max_keys=keys_for_budget(budget))
    rng = random.Random(budget)
    while s.tracked_keys < 0.99 * s.max_keys:
        s.observe_packed(0, rng.randbytes(32 * 64), 32)
    assert measure_bytes(s) <= memory_bytes(s) <= budget  # the gauge is an upper bound
