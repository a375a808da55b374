"""Ceilings: the infinite cache against an independent count, Belady MIN against brute force."""

import itertools
import random
from pathlib import Path

import pytest

from kvtier.sim import workloads
from kvtier.sim.ceilings import belady, flatten, infinite_hits, next_uses
from kvtier.sim.trace import Request, read_trace

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def independent_prefix_hits(reqs):
    """Leading blocks whose whole prefix appeared in an earlier request.

    Prefixes are keyed as cons cells (parent_prefix, id), so this does not rely on the ids being
    chained, unlike `infinite_hits`.
    """
    seen = set()
    hits = 0
    for r in reqs:
        prefix = None
        leading = True
        for h in r.hash_ids:
            prefix = (prefix, h)
            if leading and prefix in seen:
                hits += 1
            else:
                leading = False
        prefix = None
        for h in r.hash_ids:
            prefix = (prefix, h)
            seen.add(prefix)
    return hits


def test_infinite_hits_on_sample_equal_independent_count():
    if not SAMPLE.exists():
        pytest.skip("sample trace not present")
    reqs = read_trace(SAMPLE)
    # Chained ids: every reference but a block's first is a prefix hit: 121,877 - 43,924 = 77,953.
    assert infinite_hits(reqs) == independent_prefix_hits(reqs) == 77_953


def test_infinite_hits_worked_example():
    reqs = [
        Request(0, 0, 1, (1, 2, 3)),  # all new: 0
        Request(1, 0, 1, (1, 2, 4)),  # 1, 2 seen: 2
        Request(2, 0, 1, (1, 5, 6)),  # 1 seen: 1
        Request(3, 0, 1, (1, 2, 4, 7)),  # 1, 2, 4 seen: 3
    ]
    assert infinite_hits(reqs) == independent_prefix_hits(reqs) == 6


def singles(refs):
    """Each reference as its own one-block request: block hits = prefix hits, no chains."""
    return [Request(i, 512, 1, (b,)) for i, b in enumerate(refs)]


def belady_block_hits(refs, capacity):
    return belady(singles(refs), capacity).block_hits


def brute_force_optimum(refs, capacity):
    """Best block-hit count of ANY caching policy with bypass, by exhaustive search over states."""
    best = {frozenset(): 0}
    for b in refs:
        nxt = {}
        for state, score in best.items():
            hit = b in state
            options = [state]
            if not hit:
                grown = state | {b}
                if len(grown) <= capacity:
                    options.append(grown)
                else:
                    options.extend(grown - {v} for v in state)
            for s in options:
                # any subset may also be dropped at any time; states are small, so allow it.
                for k in range(len(s) + 1):
                    for sub in itertools.combinations(sorted(s), k):
                        fs = frozenset(sub)
                        if nxt.get(fs, -1) < score + hit:
                            nxt[fs] = score + hit
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("seed", range(25))
def test_belady_equals_exhaustive_optimum_on_small_sequences(seed):
    rng = random.Random(seed)
    refs = [rng.randrange(5) for _ in range(12)]
    for capacity in (1, 2, 3):
        assert belady_block_hits(refs, capacity) == brute_force_optimum(refs, capacity), (
            refs,
            capacity,
        )


def test_belady_worked_example():
    # capacity 2, refs a b c a b: at c (miss), next uses a@3, b@4, c@never -> bypass c;
    # then a and b hit: 2 hits. LRU would evict a for c and then miss a and b: 0 hits.
    assert belady_block_hits([1, 2, 3, 1, 2], 2) == 2
    assert belady_block_hits([1, 2, 3, 1, 2], 0) == 0
    assert next_uses([1, 2, 1]) == [2, next_uses([7])[0], next_uses([7])[0]]


@pytest.mark.parametrize("source", ["sample", "chat", "docqa"])
def test_belady_is_monotone_in_capacity_and_bounded_by_infinite(source):
    if source == "sample":
        if not SAMPLE.exists():
            pytest.skip("sample trace not present")
        reqs = read_trace(SAMPLE)
    else:
        reqs = workloads.generate(source, 1500, seed=0)
    refs = flatten(reqs)
    nxt = next_uses(refs)
    distinct = len(set(refs))
    results = [belady(reqs, c, nxt) for c in (0, 50, 500, 5000, distinct)]
    scores = [r.prefix_hits for r in results]
    assert scores == sorted(scores)
    assert scores[0] == 0
    # MIN's cache stays prefix-closed, so every block hit is a prefix hit (ceilings docstring).
    assert all(r.block_hits == r.prefix_hits for r in results)
    # With room for every block, MIN only misses first references; = the infinite prefix count
    # because ids are chained.
    assert scores[-1] == len(refs) - distinct == infinite_hits(reqs)


def test_belady_prefix_hits_equal_block_hits_on_branching_chains():
    # Random trees of chained ids (many shared prefixes, deep and shallow), small capacities:
    # the claim "MIN never strands, so block hits = prefix hits" checked where it is tightest.
    rng = random.Random(5)
    for _ in range(40):
        paths = [(0,)]
        reqs = []
        next_id = 1
        for t in range(60):
            base = rng.choice(paths)[: rng.randint(1, 4)]
            tail = tuple(range(next_id, next_id + rng.randint(0, 3)))
            next_id += len(tail)
            path = base + tail
            paths.append(path)
            reqs.append(Request(t, 512 * len(path), 1, path))
        for cap in (1, 2, 3, 5, 8):
            r = belady(reqs, cap)
            assert r.block_hits == r.prefix_hits, (cap, reqs)
