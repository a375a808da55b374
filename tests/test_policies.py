"""What each policy promises, through the real index: victim order and DRAM admission."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import assume, given, settings

from kvtier.core.types import Tier
from kvtier.index.policies import DEFAULT_POLICY, PEERS, POLICIES, make_policy
from kvtier.index.policies.adaptive import minisim as policy_minisim
from kvtier.index.policies.adaptive import policy as policy_adaptive
from kvtier.index.policies.adaptive.minisim import (
    COLD,
    FILTER,
    LFU,
    LRU,
    SKIP,
    MiniCache,
    MiniSims,
    SeenTable,
    choose,
    resolution,
)
from kvtier.index.policies.adaptive.policy import AdaptivePolicy
from kvtier.index.policies.adaptive.predictor import FrequencySketch
from kvtier.index.policies.adaptive.queue import AdaptiveQueue
from kvtier.index.policies.base import PROTECTED, LruQueue
from kvtier.index.prefix import Block, Op, PrefixIndex
from kvtier.sim.ceilings import flatten
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import new_index, replay
from kvtier.sim.trace import Request
from kvtier.sim.workloads import generate

D = Tier.DRAM


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def roots(policy: str, n: int, cap: int = 8) -> PrefixIndex:
    ix = PrefixIndex(dram_blocks=cap, ssd_blocks=0, policy=policy)
    for i in range(n):
        ix.insert(0, k(i), None)
    return ix


def victims(ix: PrefixIndex) -> list[int]:
    return [int.from_bytes(b.key, "big") for b in ix.victims(D, 100)]


def test_registry_names_and_errors() -> None:
    assert DEFAULT_POLICY in POLICIES and set(PEERS) <= set(POLICIES)
    assert all(info.source for info in POLICIES.values())
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_policy("nope", 1, 0, 2)
    with pytest.raises(ValueError, match="admission k"):
        PrefixIndex(dram_blocks=1, policy="kvtier", admission_k=0)


@pytest.mark.parametrize("policy", ["sglang-lfu", "lmcache-lfu"])
def test_lfu_evicts_the_least_hit_then_least_recent(policy: str) -> None:
    ix = roots(policy, 4)
    ix.lookup(0, [k(0)])
    ix.lookup(0, [k(0)])
    ix.lookup(0, [k(2)])
    assert victims(ix)[:2] == [1, 3]
    assert ix.evict_count(D, 2) == 2
    assert victims(ix) == [2, 0]


def arc_after_two_t1_ghost_hits(last: int) -> PrefixIndex:
    """Three blocks, capacity 3: 0 is hit (T2), 1 and 2 enter T1. 1 is evicted (B1), inserted again
    (a B1 ghost hit: T1's target 0 -> 1) and hit (T2 = [0, 1]); 2 is evicted (T1 holds 1 block, the
    target is 1, so T1 still gives the victim), then `last` is inserted: 2 again is a second B1
    ghost hit (target 2), any other key is new (target stays 1)."""
    ix = roots("vllm-arc", 3, cap=3)
    ix.lookup(0, [k(0)])  # T1 -> T2
    assert victims(ix) == [1, 2, 0]  # target 0: T1's LRU first, then T2's
    ix.evict_count(D, 1)
    ix.insert(0, k(1), None)
    ix.lookup(0, [k(1)])
    assert victims(ix) == [2, 0, 1]  # len(T1) = 1 >= target 1
    ix.evict_count(D, 1)
    ix.insert(0, k(last), None)
    return ix


def test_arc_evicts_t1_before_t2_and_ghost_hits_move_the_target() -> None:
    # A new key: T1 = [5] and the target is still 1, so the new block leaves first.
    assert victims(arc_after_two_t1_ghost_hits(5)) == [5, 0, 1]
    # The same position after a second B1 ghost hit: target 2 > len(T1) = 1, so T2's LRU (0)
    # leaves before the block in T1.
    ix = arc_after_two_t1_ghost_hits(2)
    assert victims(ix) == [0, 1, 2]
    ix.evict_count(D, 1)
    assert ix.get(0, k(0)) is None and ix.get(0, k(2)) is not None
    # 0 left T2 (B2, hits 2); inserting it again is a B2 ghost hit that moves the target back to
    # 1; hit, it joins T2 = [1, 0] and T1 = [2] gives the victim again (len 1 >= target 1).
    ix.insert(0, k(0), None)
    ix.lookup(0, [k(0)])
    assert victims(ix) == [2, 1, 0]
    # Control: a new key instead of the ghost leaves the target at 2, so T2's LRU (1) goes first.
    ix = arc_after_two_t1_ghost_hits(2)
    ix.evict_count(D, 1)
    ix.insert(0, k(6), None)
    ix.lookup(0, [k(6)])
    assert victims(ix) == [1, 6, 2]


def test_s3fifo_keeps_a_block_hit_twice_in_small() -> None:
    ix = roots("lmcache-s3fifo", 4)
    for _ in range(2):
        ix.lookup(0, [k(0)])
    ix.evict_count(D, 1)
    assert ix.get(0, k(0)) is not None and ix.get(0, k(1)) is None


def test_sieve_skips_visited_blocks_once() -> None:
    ix = roots("sieve", 3)
    ix.lookup(0, [k(0)])
    ix.evict_count(D, 1)
    assert ix.get(0, k(0)) is not None and ix.get(0, k(1)) is None
    ix.evict_count(D, 1)  # the hand moved on: 2 goes, 0 lost its visited bit on the way
    assert ix.get(0, k(2)) is None
    ix.evict_count(D, 1)
    assert ix.get(0, k(0)) is None


def test_vllm_reuse_stores_after_two_lookups() -> None:
    ix = PrefixIndex(dram_blocks=8, ssd_blocks=0, policy="vllm-reuse")
    chain = [k(1), k(2)]
    ix.lookup(0, chain)
    assert ix.admit(0, chain, 0) == 0
    ix.lookup(0, chain[:1])
    assert ix.admit(0, chain, 0) == 1  # k(2) was looked up once only
    ix.lookup(0, chain)
    assert ix.admit(0, chain, 0) == 2


def test_hicache_stores_on_the_second_reference() -> None:
    ix = PrefixIndex(dram_blocks=8, ssd_blocks=0, policy="sglang-hicache")
    chain = [k(1), k(2)]
    assert ix.admit(0, chain, 0) == 0
    assert ix.admit(0, chain, 0) == 2


def test_admit_checks_its_arguments() -> None:
    ix = PrefixIndex(dram_blocks=8, ssd_blocks=0, policy="lru")
    assert ix.admit(0, [k(1), k(2)], 0) == 2
    with pytest.raises(ValueError, match="outside the chain"):
        ix.admit(0, [k(1)], 2)
    from kvtier.index.prefix import MissingParent

    with pytest.raises(MissingParent):
        ix.admit(0, [k(1), k(2)], 1)


def _hold(ix: PrefixIndex, mode: float) -> AdaptivePolicy:
    """The index's kvtier policy, its DRAM queue held in `mode` (the mini simulations still run,
    their choice is not applied)."""
    pol = ix._policy
    assert isinstance(pol, AdaptivePolicy)
    q = pol.dram
    assert isinstance(q, AdaptiveQueue)
    q.set_share(mode)
    pol.minisims.best = mode
    pol._feed = lambda *a: None  # type: ignore[method-assign]
    return pol


def _one_shot_tails(ix: PrefixIndex, rounds: int) -> int:
    """Prompts of a full block and a partial last one, never reused; how many of the last 100
    stored their tail."""
    stored_tails = 0
    for r in range(rounds):
        chain = [k(1_000_000 + r * 2), k(1_000_001 + r * 2)]
        ix.lookup(0, chain)
        n = ix.admit(0, chain, 0, partial_last=True)
        free = ix.free(D) or 0
        if n > free:
            ix.evict_count(D, n - free)
        parent = None
        for key in chain[:n]:
            ix.insert(0, key, parent)
            parent = key
        if r >= rounds - 100:
            stored_tails += n == 2
    return stored_tails


def test_kvtier_in_probation_mode_learns_to_bypass_partial_tails_that_never_hit() -> None:
    """Prompts whose partial last block is never reused: after a few hundred, the policy in its
    probation mode stops storing them (except its 1-in-4 control sample), and still stores the
    full blocks."""
    ix = PrefixIndex(dram_blocks=64, ssd_blocks=0, policy="kvtier")
    _hold(ix, 0.1)
    assert _one_shot_tails(ix, 400) <= 40  # ~25 of 100 are controls
    assert ix.admit(0, [k(7), k(8)], 0, partial_last=False) == 2


def test_kvtier_in_lru_mode_stores_every_block_and_its_predictor_learns_nothing() -> None:
    """In LRU mode the policy admits what `lru` admits, every missed block, and takes no control
    sample: the predictor's labels are reuse under the probation order only."""
    ix = PrefixIndex(dram_blocks=64, ssd_blocks=0, policy="kvtier")
    pol = _hold(ix, LRU)
    assert _one_shot_tails(ix, 400) == 100
    assert not pol._tracked and pol.predictor.table(0)[2] == [1, 2]


def test_kvtier_policy_state_is_bounded() -> None:
    p = make_policy("kvtier", 100_000, 0, 2)
    assert isinstance(p, AdaptivePolicy)
    assert p.nbytes() <= 17 * 100_000 + 8 * 1024
    sketch = FrequencySketch(64)
    for _ in range(20):
        sketch.add(0, [b"x"])
    assert sketch.count(0, b"x") == 15
    for _ in range(10):
        sketch.add(0, [b"y" * i for i in range(64)])  # 640 adds: one halving
    assert sketch.count(0, b"x") < 15


def test_minisims_pick_the_better_share() -> None:
    """A hot set read twice in a row between scans longer than the cache: LRU loses the hot set
    to every scan, a small probation list keeps it in main."""
    ms = MiniSims(1024, (0.1, 1.0), 1.0, rate=4)
    hot = [k(i) for i in range(400)]
    n = 10_000
    for _ in range(30):
        ms.add(hot)
        ms.add(hot)
        ms.add([k(n + j) for j in range(1600)])
        n += 1600
    assert ms.best == 0.1
    lru, small = sorted(ms.caches, key=lambda c: c.share, reverse=True)
    assert small.hits > lru.hits


def test_kvtier_lookup_work_is_a_sample_whatever_the_keys() -> None:
    """Keys with a constant last byte (as bench.daemon's): a lookup still hands the mini
    simulations only about 1 in 16 of its hits, a lookup that misses counts nothing, and
    `admit` remembers the missed keys in the seen table once."""
    ix = PrefixIndex(dram_blocks=40_000, ssd_blocks=0, policy="kvtier")
    pol = ix._policy
    assert isinstance(pol, AdaptivePolicy)
    keys = [i.to_bytes(4, "little") + bytes(28) for i in range(4096)]
    def remembered() -> int:
        return sum(1 for w in pol.seen._words if w)

    assert ix.lookup(0, keys).blocks == []
    assert remembered() == 0 and pol.minisims._seen == 0
    assert ix.admit(0, keys, 0) == len(keys)
    assert 0.95 * len(keys) < remembered() <= len(keys)  # a word collision overwrites
    fed_at_admit = pol.minisims._seen
    assert 4096 // 32 < fed_at_admit < 4096 // 8
    parent = None
    for key in keys:
        ix.insert(0, key, parent)
        parent = key
    assert len(ix.lookup(0, keys).blocks) == len(keys)
    # the same sample (hits of the sampled keys), held off the Lookup path for the next admit
    assert pol.minisims._seen == fed_at_admit and len(pol._deferred) == fed_at_admit
    assert pol.minisims.real == {}  # LRU mode: nothing to calibrate
    assert ix.admit(0, [b"other"], 0) <= 1
    assert pol.minisims._seen >= 2 * fed_at_admit and not pol._deferred
    assert pol.minisims.best == LRU and pol.minisims.real == {}


def test_kvtier_full_hits_with_no_admit_each_feed_only_their_own_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups that all hit (no `admit` between them) hold their sampled hits up to
    `DEFER_MAX`; past it each lookup feeds the mini simulations as many of the oldest as it
    kept: no lookup pays for the others' (one lookup in ~60 of a 1,024-block chain used to feed
    all 8,192 at once, milliseconds on the Lookup path), and none is lost or fed twice."""
    ix = PrefixIndex(dram_blocks=16_384, ssd_blocks=0, policy="kvtier")
    pol = ix._policy
    assert isinstance(pol, AdaptivePolicy)
    keys = [i.to_bytes(8, "little") * 4 for i in range(1024)]
    parent = None
    for key in keys:
        ix.insert(0, key, parent)
        parent = key
    feeds: list[int] = []
    feed = MiniSims.feed
    def spy(self: MiniSims, sampled: Any, placed: Any = None, real_hits: Any = None) -> None:
        feeds.append(len(sampled))
        feed(self, sampled, placed, real_hits)
    monkeypatch.setattr(MiniSims, "feed", spy)
    kept = []
    for _ in range(200):
        before = len(pol._deferred) + sum(feeds)
        assert len(ix.lookup(0, keys).blocks) == len(keys)
        kept.append(len(pol._deferred) + sum(feeds) - before)
    per_lookup = kept[0]
    assert 1024 // 32 < per_lookup < 1024 // 4 and set(kept) == {per_lookup}
    assert feeds and max(feeds) <= per_lookup  # past DEFER_MAX, one lookup's share at a time
    assert len(pol._deferred) <= policy_adaptive.DEFER_MAX
    assert sum(feeds) + len(pol._deferred) == 200 * per_lookup


def test_kvtier_inner_block_hits_count_once_it_is_evictable() -> None:
    """An inner block is in no queue, so its hits reach no queue counter; when it becomes a leaf
    with HOT_HITS accesses it enters at the top frequency (a one-shot leaf does not)."""
    from kvtier.index.policies.adaptive.queue import HOT_HITS
    from kvtier.index.policies.base import COUNT_BITS

    ix = PrefixIndex(dram_blocks=16, ssd_blocks=0, policy="kvtier")
    ix.insert(0, k(1), None)
    ix.insert(0, k(2), k(1))
    ix.insert(0, k(3), None)
    for _ in range(HOT_HITS):
        ix.lookup(0, [k(1), k(2)])
    ix.drop(0, k(2), D)
    hot, cold = ix.get(0, k(1)), ix.get(0, k(3))
    assert hot is not None and cold is not None
    assert hot.flags & COUNT_BITS == COUNT_BITS and not cold.flags & COUNT_BITS


def test_minisims_pick_the_reuse_filter_when_one_shot_keys_flush_the_cache() -> None:
    """Each round references a reused set once and a fresh scan twice as long as the cache: LRU
    and the small probation list store the scan (it pushes the reused set out of LRU, and into a
    probation list that turns over before the next round); the filter stores only the keys seen
    before, so the reused set stays."""
    ms = MiniSims(256, (0.1, 1.0, FILTER), 1.0, rate=1, min_cap=1, seen=1 << 14)
    hot = [k(i) for i in range(200)]
    n = 10_000
    for _ in range(40):
        ms.add(hot)
        ms.add([k(n + j) for j in range(600)])
        n += 600
    assert ms.best == FILTER
    by = {c.share: c.hits for c in ms.caches}
    assert by[FILTER] > 1.5 * max(by[0.1], by[1.0])


def test_seen_table_remembers_recent_keys_and_forgets_overwritten_ones() -> None:
    t = SeenTable(8)
    assert not t.check(5) and t.check(5)  # the second reference is seen
    assert not t.check(5 + (8 << 40))  # the same word, another tag: overwrites
    assert not t.check(5)
    assert t.nbytes() == 32


def test_kvtier_in_filter_mode_stores_only_keys_seen_before() -> None:
    """The reuse filter mode (the mini simulations chose it): a chain's first Allocate stores
    nothing, the second stores up to the first key never seen before."""
    ix = PrefixIndex(dram_blocks=1000, ssd_blocks=0, policy="kvtier")
    pol = ix._policy
    assert isinstance(pol, AdaptivePolicy)
    q = pol.dram
    assert isinstance(q, AdaptiveQueue)
    pol.minisims.best = q.share = FILTER
    pol._feed = lambda *a: None  # type: ignore[method-assign]  # hold the mode
    keys = [k(i) for i in range(6)]
    assert ix.admit(0, keys[:4], 0) == 0
    assert ix.admit(0, keys, 0) == 4  # keys 4 and 5 were not seen before
    assert ix.admit(0, keys, 0) == 6


def _window(feeds: list[tuple[float, ...]]) -> tuple[list[float], list[float]]:
    """The copies' hits and the sums of products of their hits per feed, from the hits each
    copy got in each feed (one row per feed)."""
    n = len(feeds[0])
    hits = [sum(f[i] for f in feeds) for i in range(n)]
    return hits, [sum(f[i] * f[j] for f in feeds) for i in range(n) for j in range(n)]


S3, MODES = 0.1, (0.1, LRU, FILTER)


def _choose(feeds: list[tuple[float, ...]], best: float = LRU, **kw: Any) -> float:
    return choose(MODES if len(feeds[0]) == 3 else (*MODES, LFU), *_window(feeds), best, **kw)


def test_choose_keeps_lru_on_a_tie_and_switches_on_a_gain_of_z_deviations() -> None:
    """The switching rule, worked by hand (Z = 3, LRU_MARGIN = 1.05): base feeds where the
    probation and LRU copies both hit 10, then k feeds where the probation copy alone hits 5.
    Its gain 5k has a paired deviation of sqrt(k x 25) = 5 sqrt(k): resolved when sqrt(k) > 3."""
    assert (policy_minisim.Z, policy_minisim.LRU_MARGIN, policy_minisim.MIN_HITS) == (3.0, 1.05,
                                                                                      50.0)
    base = [(10.0, 10.0, 0.0)] * 10
    assert _choose(base * 10) == LRU  # 1,000 hits each, a tie: no deviation to speak of
    assert _choose(base + [(5.0, 0.0, 0.0)] * 9) == LRU  # 45 = 3 deviations: not more
    assert _choose(base + [(5.0, 0.0, 0.0)] * 10) == S3  # 50 > 3 sqrt(250) = 47.4
    # what the window resolves: 3 deviations over LRU's hits, per candidate
    res = resolution(MODES, *_window(base + [(5.0, 0.0, 0.0)] * 10))
    assert res[S3] == pytest.approx(3 * 5 * 10 ** 0.5 / 100) and res[FILTER] == pytest.approx(
        3 * (100 * 10) ** 0.5 / 100)
    # chains: one request's 50 extra hits are one observation, not 50
    assert _choose([*base, (50.0, 0.0, 0.0)]) == LRU


def test_choose_needs_the_margin_and_min_hits() -> None:
    """A 4% lead of the probation copy, however sure, is under LRU_MARGIN; the filter's copy
    has no margin. Under MIN_HITS hits between the two copies no switch is made."""
    assert _choose([(26.0, 25.0, 0.0)] * 100) == LRU  # 10 deviations, 2,600 / 1.05 < 2,500
    assert _choose([(0.0, 25.0, 26.0)] * 100) == FILTER
    assert _choose([(4.0, 0.0, 0.0)] * 12) == LRU  # 48 hits, 3.5 deviations
    assert _choose([(4.0, 0.0, 0.0)] * 13) == S3  # 52 hits, 3.6 deviations


def test_choose_returns_to_lru_once_the_gain_is_not_resolved() -> None:
    """Running the probation mode, it stays while it leads LRU by more than Z_STAY = 2
    deviations and gives way to LRU at the epoch's end otherwise; a quarter-epoch check
    (`early`) never goes back, and switches only on Z_EARLY deviations."""
    assert (policy_minisim.Z_STAY, policy_minisim.Z_EARLY) == (2.0, 4.0)
    base = [(10.0, 10.0, 0.0)] * 10
    assert _choose(base + [(5.0, 0.0, 0.0)] * 5, best=S3) == S3  # sqrt(5) = 2.24 deviations
    assert _choose(base + [(5.0, 0.0, 0.0)] * 4, best=S3) == LRU  # 2: not more
    assert _choose(base + [(5.0, 0.0, 0.0)] * 4, best=S3, early=True) == S3
    assert _choose(base + [(5.0, 0.0, 0.0)] * 16, z=4.0, early=True) == LRU
    assert _choose(base + [(5.0, 0.0, 0.0)] * 17, z=4.0, early=True) == S3


def test_choose_replaces_a_mode_only_by_one_that_beats_it_and_lru() -> None:
    """Running probation (resolved above LRU): the filter takes over only when it beats both;
    the calibration factor scales a calibrated copy's hits; LFU needs LFU_MARGIN = 1.1."""
    assert _choose([(2.0, 1.0, 4.0)] * 20, best=S3) == FILTER  # 80 vs 40 by 4.5 deviations
    assert _choose([(4.0, 1.0, 4.0)] * 20, best=S3) == S3  # the filter ties with probation
    assert _choose([(2.0, 1.0, 0.0)] * 20) == S3  # 40 vs 20: 4.5 deviations, 38.1 > 20
    # the real cache got half its probation copy's hits: 20 vs 20
    assert _choose([(2.0, 1.0, 0.0)] * 20, factors={S3: 0.5}) == LRU
    assert policy_minisim.LFU_MARGIN == 1.1
    assert _choose([(0.0, 20.0, 0.0, 21.5)] * 100) == LRU  # +7.5%, 5 deviations
    assert _choose([(0.0, 20.0, 0.0, 23.0)] * 100) == LFU  # +15%, 10 deviations


def test_minisims_count_each_feed_as_one_observation_and_decay_the_window() -> None:
    """`feed` adds the products of the copies' hits in that feed; at an epoch's end (4 x the
    mini capacity in sampled refs) hits decay by DECAY and the products by DECAY^2."""
    ms = MiniSims(64, (S3, LRU), LRU, rate=1, min_cap=1)
    ms.feed([k(1), k(1), k(1)])  # both copies: a miss, then 2 hits
    assert [c.hits for c in ms.caches] == [2, 2] and ms._q == [4.0, 4.0, 4.0, 4.0]
    ms.feed([k(2)])  # no hit: nothing added
    assert ms._q == [4.0] * 4 and ms.window == 4
    ms.feed([k(3 + i) for i in range(252)])  # 256 refs: the epoch ends
    d = policy_minisim.DECAY
    assert [c.hits for c in ms.caches] == [2 * d, 2 * d]
    assert ms._q == pytest.approx([4 * d * d] * 4) and ms.window == pytest.approx(256 * d)
    assert ms.best == LRU and ms.switches == 0


def test_lfu_copy_evicts_the_least_counted_and_ghosts_keep_counts() -> None:
    c = MiniCache(2, LFU)
    c.access([k(1), k(1), k(2), k(3)])  # 1 counted twice; 3 pushes out 2 (count 1, oldest)
    assert c.hits == 1 and c.m == {k(1): 2, k(3): 1} and dict(c.ghosts) == {k(2): 1}
    c.access([k(2), k(1)])  # 2's ghost: it comes back at count 2 and pushes out 3; 1 hits
    assert c.hits == 2 and c.m == {k(1): 3, k(2): 2} and dict(c.ghosts) == {k(3): 1}


def test_minisims_switch_at_a_quarter_epoch_on_a_clear_win() -> None:
    """60 hot keys (each its own request) and 264 one-shot keys a round, copies of 256 keys
    (epochs of 1,024 refs): LRU never keeps a hot key 324 refs; LFU loses them in round 1 (68
    evictions, the oldest of count 1 first) but keeps them from their second round (their
    ghosts' count: 2), so round 3 gives it 60 hits in 60 feeds, LRU none. At ref 768, a quarter
    check: 60 hits >= MIN_HITS, 60 / 1.1 > 0 and 60 > Z_EARLY sqrt(60) = 31: the switch comes
    before the epoch's end."""
    ms = MiniSims(256, (1.0, LFU), 1.0, rate=1, min_cap=1)
    n = 1000
    for _ in range(3):
        for i in range(60):
            ms.feed([k(i)])
        ms.feed([k(n + j) for j in range(264)])
        n += 264
    assert ms._seen == 3 * 324 < 4 * 256
    assert [c.hits for c in ms.caches] == [0, 60]
    assert ms.best == LFU and ms.switches == 1


def test_kvtier_lfu_mode_reranks_the_blocks_and_gives_them_back() -> None:
    """Into LFU mode every evictable block is ranked by its access count (least recently used
    first among equal ones); out of it they all go back to the lists; none is dropped."""
    ix = roots("kvtier", 4)
    q = ix._policy.dram
    assert isinstance(q, AdaptiveQueue)
    ix.lookup(0, [k(0)])
    ix.lookup(0, [k(0)])
    ix.lookup(0, [k(2)])  # counts: 0 three, 2 two, 1 and 3 one (1 older)
    q.set_share(LFU)
    assert victims(ix) == [1, 3, 2, 0]
    ix.lookup(0, [k(1)])  # 1: two accesses, more recent than 2
    assert victims(ix) == [3, 2, 1, 0]
    assert ix.evict_count(D, 1) == 1
    q.set_share(0.1)
    assert len(q) == 3 and sorted(victims(ix)) == [0, 1, 2]


def test_minisims_calibrate_the_probation_mode_by_the_real_cache_hits() -> None:
    """factor = (real + 50) / (copy + 50), counted only while the real cache runs probation."""
    assert policy_minisim.CALIBRATION_PRIOR == 50.0
    ms = MiniSims(64, (0.1, 1.0), 0.1, rate=1, min_cap=1)  # epochs of 256 refs: none here
    assert ms.factor(0.1) == 1.0
    ms.feed([k(1), k(1)], real_hits=2)  # the copy: a miss then a hit; the real cache: 2 hits
    assert (ms.real, ms.copy) == ({0.1: 2}, {0.1: 1})
    assert ms.factor(0.1) == pytest.approx(52 / 51)
    ms.best = 1.0  # another mode runs: its hits say nothing of the probation mode's
    ms.feed([k(1)], real_hits=1)
    assert (ms.real, ms.copy) == ({0.1: 2}, {0.1: 1})
    assert ms.factor(1.0) == 1.0  # LRU is not calibrated


def test_probation_copy_follows_the_predictor_placements() -> None:
    """A key placed SKIP is not stored, one placed COLD enters probation's cold end (the next
    victim); the LRU copy stores both as usual."""
    c = MiniCache(2, 0.1)
    c.access([k(1)], {k(1): SKIP})
    c.access([k(1)])
    assert c.hits == 0 and list(c.s) == [k(1)]  # stored at its second (unplaced) miss
    c = MiniCache(2, 0.1)
    c.access([k(2)])
    c.access([k(3)], {k(3): COLD})
    assert list(c.s) == [k(3), k(2)]
    c.access([k(4)])  # over capacity: the cold key leaves, not the older k(2)
    assert list(c.s) == [k(2), k(4)] and list(c.ghosts) == [k(3)]
    c.access([k(2), k(3)])  # k(2) hits; k(3) comes back as a ghost: into main
    assert c.hits == 1 and k(3) in c.m
    lru = MiniCache(2, 1.0)
    lru.access([k(1)], {k(1): SKIP})
    assert list(lru.s) == [k(1)]


_OPS = st.lists(st.tuples(st.sampled_from(["push", "push", "touch", "discard"]),
                          st.integers(0, 11), st.booleans()), max_size=80)


@settings(max_examples=200, deadline=None)
@given(_OPS, st.sampled_from([S3, LFU]))
def test_kvtier_queue_in_lru_mode_is_the_lru_queue(ops: list[tuple[str, int, bool]],
                                                    before: float) -> None:
    """The adaptive queue in LRU mode (after any other mode) orders its blocks as `lru`'s queue
    does, whatever is pushed (hot or cold end), touched or discarded: the same victim first and
    the same order behind it."""
    q, ref = AdaptiveQueue(before, lru_main=True), LruQueue()
    q.set_share(LRU)
    ours = [Block(k(i), 0, None) for i in range(12)]
    theirs = [Block(k(i), 0, None) for i in range(12)]
    queued: set[int] = set()
    for op, i, cold in ops:
        if op == "push" and i not in queued:
            ours[i].flags |= PROTECTED if cold else 0  # a ghost hit changes nothing in LRU mode
            q.push(ours[i], cold)
            ref.push(theirs[i], cold)
            queued.add(i)
        elif op == "touch" and i in queued:
            q.touch(ours[i])
            ref.touch(theirs[i])
        elif op == "discard" and i in queued:
            q.discard(ours[i])
            ref.discard(theirs[i])
            queued.discard(i)
        assert [b.key for b in q] == [b.key for b in ref]
        first, want = q.first(), ref.first()
        assert (first and first.key) == (want and want.key)
    assert len(q) == len(ref) == len(queued)


def _journal(reqs: list[Request], fraction: float, policy: str) -> tuple[float, list[Any], int]:
    """Hit ratio, every residency change in order, and mode switches of a DRAM-only replay."""
    cfg = TierConfig(max(1, round(len(set(flatten(reqs))) * fraction)), 0, policy)
    ix = new_index(cfg, journal=True)
    hit = replay(reqs, cfg, index=ix).hit_ratio
    pol = ix._policy
    return hit, ix.take_changes(), pol.minisims.switches if isinstance(pol, AdaptivePolicy) else 0


def test_kvtier_replays_exactly_as_lru_where_no_switch_fires() -> None:
    """Chat at 20% of its distinct blocks: the mini simulations resolve no gain over LRU, so
    kvtier stores, evicts and re-queues exactly as `lru` (every add and drop of the index's
    journal, in order) and hits the same."""
    reqs = generate("chat", 1000, 0)
    hit, changes, switches = _journal(reqs, 0.2, "kvtier")
    assert switches == 0
    lru_hit, lru_changes, _ = _journal(reqs, 0.2, "lru")
    assert len(changes) > 10_000 and sum(c.op is Op.DROP for c in changes) > 3_000
    assert changes == lru_changes and hit == lru_hit


_CHAINS = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.booleans()), min_size=1,
                   max_size=40)


@settings(max_examples=60, deadline=None)
@given(_CHAINS, st.integers(2, 24))
def test_kvtier_is_lru_on_random_traces_where_no_switch_fires(
        chains: list[tuple[int, int, bool]], cap: int) -> None:
    """Random prompts over 5 shared prefixes (a unique last block or not), any small capacity:
    where no switch fires, kvtier's journal is lru's."""
    reqs, fresh = [], 10_000
    for t, (p, n, tail) in enumerate(chains):
        ids = [p * 100 + i for i in range(n)]
        if tail:
            ids.append(fresh)
            fresh += 1
        reqs.append(Request(float(t), len(ids) * 512 - (100 if tail else 0), 1, tuple(ids)))
    fraction = cap / len(set(flatten(reqs)))
    hit, changes, switches = _journal(reqs, fraction, "kvtier")
    assume(switches == 0)
    assert (hit, changes) == _journal(reqs, fraction, "lru")[:2]
