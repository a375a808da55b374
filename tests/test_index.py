"""Hand-worked cases for the prefix index (kvtier.index.prefix) and its policies."""

from __future__ import annotations

import pytest

from kvtier.core.types import Tier
from kvtier.index import placement
from kvtier.index.policies import make_policy
from kvtier.index.policies.base import KthAccess
from kvtier.index.prefix import (
    BadSlot,
    DuplicateBlock,
    IndexStateError,
    MissingParent,
    NotEvictable,
    PinnedBlock,
    PrefixIndex,
    Reason,
    TierFull,
    UnknownBlock,
)

D, S, H = Tier.DRAM, Tier.SSD, Tier.HBM


def chain(ix: PrefixIndex, keys: list[bytes], ns: int | str = 0, tier: Tier = D) -> None:
    parent = None
    for k in keys:
        ix.insert(ns, k, parent, tier)
        parent = k


def test_ssd_is_prefix_closed() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b", b"c"])
    with pytest.raises(MissingParent):
        ix.demote(0, b"c")
    ix.add_tier(0, b"a", S)
    ix.demote(0, b"b")
    assert ix.lookup(0, [b"a", b"b", b"c", b"x"]).tiers == [D, S, D]
    assert ix.lookup(0, [b"a", b"b", b"c"], replica="r0").tiers == [D, S, D]  # r0 holds none


def test_lookup_stops_at_gap_and_at_broken_chain() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b", b"c"])
    chain(ix, [b"z"])
    assert len(ix.lookup(0, [b"a", b"x", b"c"]).blocks) == 1
    # b"c" is cached but its parent is b"b", not b"z": not a continuation of that chain.
    assert len(ix.lookup(0, [b"z", b"c"]).blocks) == 1
    # A chain must start at a root.
    assert ix.lookup(0, [b"b", b"c"]).blocks == []
    assert ix.lookup(1, [b"a"]).blocks == []  # another namespace sees nothing


def test_namespaces_are_isolated() -> None:
    ix = PrefixIndex()
    ix.insert("t1", b"a", None)
    ix.insert("t2", b"a", None)  # same key bytes, another namespace: separate entry
    with pytest.raises(MissingParent):
        ix.insert("t3", b"b", b"a")
    assert len(ix) == 2
    ix.remove("t1", b"a")
    assert ix.get("t2", b"a") is not None and ix.get("t1", b"a") is None


def test_insert_errors_change_nothing() -> None:
    ix = PrefixIndex(dram_blocks=2)
    ix.insert(0, b"a", None, dram_slot=0)
    before = ix.stats()
    with pytest.raises(DuplicateBlock):
        ix.insert(0, b"a", None, dram_slot=1)
    with pytest.raises(MissingParent):
        ix.insert(0, b"b", b"nope", dram_slot=1)
    with pytest.raises(BadSlot):
        ix.insert(0, b"b", b"a", dram_slot=0)  # slot 0 holds b"a"
    with pytest.raises(BadSlot):
        ix.insert(0, b"b", b"a", dram_slot=2)  # pool has slots 0..1
    with pytest.raises(TypeError):
        ix.insert(0, "b", b"a")  # type: ignore[arg-type]
    assert ix.stats() == before
    ix.insert(0, b"b", b"a", dram_slot=1)
    with pytest.raises(TierFull):
        ix.insert(0, b"c", b"b")
    assert ix.stats().dram_blocks == 2


def test_lru_evicts_leaf_first_and_drains_cold_chain_tail_first() -> None:
    # Chain a<-b<-c inserted at clock 1..3, then x alone at clock 4.
    # Only leaves c and x are evictable; c is colder. Evicting c makes b a leaf whose
    # last use (2) is <= c's (3), so b goes to the cold end and is next, then a, then x.
    ix = PrefixIndex()
    chain(ix, [b"a", b"b", b"c"])
    ix.insert(0, b"x", None)
    assert [b.key for b in ix.victims(D, 10)] == [b"c", b"x"]
    got = [e.key for e in ix.evict(D, 4)]
    assert got == [b"c", b"b", b"a", b"x"]
    assert len(ix) == 0
    assert ix.stats().evictions["dram_dropped"] == 4


def test_lookup_refreshes_recency() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b"])
    chain(ix, [b"x", b"y"])
    ix.lookup(0, [b"a", b"b"])  # a, b now hotter than x, y
    assert [e.key for e in ix.evict(D, 2)] == [b"y", b"x"]


def test_a_long_chain_is_walked_and_touched_like_a_short_one() -> None:
    """100 blocks: past the length at which the walk and the touch run vectorised."""
    keys = [b"k%03d" % i for i in range(100)]
    other = [b"o%03d" % i for i in range(100)]
    ix = PrefixIndex()
    chain(ix, keys)
    chain(ix, [b"x", b"y"])
    chain(ix, other)
    assert ix.lookup(0, [*keys, b"nope"], replica="r0").tiers == [D] * 100  # r0 holds none
    assert len(ix.lookup(0, [*keys[:70], b"nope", *keys[71:]]).blocks) == 70  # a gap
    # o080 is cached, but under o079, not k079: the chain ends at k079
    assert ix.lookup(0, keys[:80] + other[80:]).blocks == [ix.get(0, k) for k in keys[:80]]
    assert ix.lookup(0, keys[1:]).blocks == []  # not from a root
    hits = [ix.get(0, k).hits for k in (keys[0], keys[75], keys[99], other[99])]  # type: ignore[union-attr]
    assert hits == [1 + 3, 1 + 2, 1 + 1, 1]  # the commit, then one per touching lookup
    # recency: y (inserted first), then x (a leaf once y left), then o099; k099 was looked up
    assert [e.key for e in ix.evict(D, 3)] == [b"y", b"x", b"o099"]


def test_pinned_blocks_are_never_chosen_or_dropped() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b"])
    ix.pin(0, b"b")
    assert ix.victims(D, 5) == []
    assert ix.evict(D, 5) == []
    with pytest.raises(PinnedBlock):
        ix.drop(0, b"b", D)
    with pytest.raises(PinnedBlock):
        ix.remove(0, b"b")
    ix.pin(0, b"b")
    ix.unpin(0, b"b")
    assert ix.stats().pins == 1 and ix.stats().pinned_blocks == 1
    ix.unpin(0, b"b")
    with pytest.raises(IndexStateError):
        ix.unpin(0, b"b")
    assert [e.key for e in ix.evict(D, 5)] == [b"b", b"a"]


def test_demotion_keeps_children_reachable() -> None:
    ix = PrefixIndex(dram_blocks=3, ssd_blocks=10)
    chain(ix, [b"a", b"b", b"c"])
    ix.add_tier(0, b"a", S)  # a: DRAM+SSD, so its DRAM copy is evictable as a demotion
    assert [b.key for b in ix.victims(D, 5)] == [b"a", b"c"]
    ev = ix.evict(D, 1)
    assert [(e.key, e.reason) for e in ev] == [(b"a", Reason.DEMOTED)]
    assert ix.lookup(0, [b"a", b"b", b"c"]).tiers == [S, D, D]
    with pytest.raises(NotEvictable):
        ix.drop(0, b"a", S)  # its last tier, and it has a child
    with pytest.raises(NotEvictable):
        ix.drop(0, b"b", D)


def test_byte_accounting() -> None:
    ix = PrefixIndex(dram_blocks=4, block_bytes=2 << 20)  # 2 MiB blocks (Llama-3-8B, 16 tokens)
    chain(ix, [b"a", b"b", b"c"])
    ix.add_tier(0, b"a", S)
    assert ix.bytes_in(D) == 3 * (2 << 20) and ix.bytes_in(S) == 2 << 20
    assert ix.free(D) == 1 and ix.free(S) is None
    assert PrefixIndex().bytes_in(D) is None


def test_ssd_eviction_is_leaf_first() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b", b"c"], tier=S)
    assert [e.key for e in ix.evict(S, 3)] == [b"c", b"b", b"a"]


def test_promote_and_slots() -> None:
    ix = PrefixIndex(dram_blocks=2, ssd_blocks=2)
    ix.insert(0, b"a", None, S)
    ix.promote(0, b"a", D, dram_slot=1)
    b = ix.get(0, b"a")
    assert b is not None and b.in_dram and b.on_ssd and b.dram_slot == 1
    with pytest.raises(DuplicateBlock):
        ix.promote(0, b"a", D, dram_slot=0)
    ev = ix.drop(0, b"a", D)
    assert (ev.reason, ev.dram_slot) == (Reason.DEMOTED, 1)
    ix.insert(0, b"b", None, D, dram_slot=1)  # slot 1 is free again


def test_hbm_reports() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b"])
    assert ix.hbm_add("r1", 0, b"a")
    assert not ix.hbm_add("r1", 0, b"zz")  # unknown block: ignored
    assert ix.lookup(0, [b"a", b"b"]).tiers == [H, D]
    assert ix.lookup(0, [b"a", b"b"], replica="r2").tiers == [D, D]
    assert ix.lookup(0, [b"a", b"b"], replica="r1").tiers == [H, D]
    assert ix.blocks(H) == 1
    assert ix.drop_replica("r1") == 1
    assert ix.blocks(H) == 0
    ix.hbm_add("r2", 0, b"b")
    assert ix.hbm_drop("r2", 0, b"b") and not ix.hbm_drop("r2", 0, b"b")


def test_remove_requires_leaf() -> None:
    ix = PrefixIndex()
    chain(ix, [b"a", b"b"])
    with pytest.raises(NotEvictable):
        ix.remove(0, b"a")
    with pytest.raises(UnknownBlock):
        ix.remove(0, b"zz")
    ix.remove(0, b"b")
    ix.remove(0, b"a")
    assert len(ix) == 0 and ix.stats().evictions["removed"] == 2


def test_slru_protects_reused_blocks_from_one_shot_scan() -> None:
    # One reused block r (2 accesses) and a scan of 5 one-shot blocks: LRU evicts r first
    # (it is the oldest); SLRU keeps it because it sits in the protected segment.
    def run(policy: str) -> list[bytes]:
        ix = PrefixIndex(policy=policy)
        ix.insert(0, b"r", None)
        ix.lookup(0, [b"r"])
        for i in range(5):
            ix.insert(0, bytes([i]), None)
        return [e.key for e in ix.evict(D, 3)]

    assert run("lru") == [b"r", b"\x00", b"\x01"]
    assert run("slru") == [b"\x00", b"\x01", b"\x02"]


def test_hbm_is_not_evicted_by_the_index() -> None:
    ix = PrefixIndex()
    with pytest.raises(ValueError, match="hbm"):
        ix.evict(H, 1)
    with pytest.raises(ValueError, match="hbm"):
        ix.victims(H, 1)
    with pytest.raises(ValueError):
        ix.insert(0, b"a", None, H)


def test_policy_and_admission_validation() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo-ish", None, None, 2)
    with pytest.raises(ValueError):
        KthAccess(0)
    with pytest.raises(ValueError):
        PrefixIndex(dram_blocks=-1)


def test_remove_subtree_cascades_and_respects_pins() -> None:
    # a <- b <- c, b <- d, a <- e; x is another root. Removing b takes b, c, d (not a, e, x).
    ix = PrefixIndex(dram_blocks=8)
    chain(ix, [b"a", b"b", b"c"])
    ix.insert(0, b"d", b"b", dram_slot=5)
    ix.insert(0, b"e", b"a")
    ix.insert(0, b"x", None)
    ix.pin(0, b"d")
    with pytest.raises(PinnedBlock):
        ix.remove_subtree(0, b"b")
    assert len(ix) == 6
    ix.unpin(0, b"d")
    out = ix.remove_subtree(0, b"b")
    assert [e.key for e in out][-1] == b"b" and {e.key for e in out} == {b"b", b"c", b"d"}
    assert [e.dram_slot for e in out if e.key == b"d"] == [5]
    assert sorted(b.key for b in ix.iter_blocks()) == [b"a", b"e", b"x"]
    assert ix.get(0, b"a") is not None and ix.get(0, b"a").children == 1  # type: ignore[union-attr]
    assert ix.stats().evictions["removed"] == 3


# ---------------------------------------------------------------- admission history


def hits(ix: PrefixIndex, ns: int, key: bytes) -> int:
    b = ix.get(ns, key)
    assert b is not None
    return b.hits


def test_dropped_block_comes_back_with_its_count() -> None:
    ix = PrefixIndex(dram_blocks=4, ssd_blocks=4)
    ix.insert(0, b"a", None)
    ix.lookup(0, [b"a"])
    ix.lookup(0, [b"a"])
    assert hits(ix, 0, b"a") == 3  # commit + 2 lookup hits
    ix.drop(0, b"a", D)
    assert ix.stats().history_entries == 1
    ix.insert(0, b"a", None)
    # 3 remembered + this commit
    assert hits(ix, 0, b"a") == 4
    st = ix.stats()
    assert (st.history_entries, st.history_recalled) == (0, 1)
    ix.insert(1, b"b", None)
    ix.drop(1, b"b", D)
    ix.insert(0, b"b", None)  # same key, another namespace: not its history
    assert hits(ix, 0, b"b") == 1


def test_history_lets_a_block_reused_beyond_dram_reach_k2() -> None:
    """DRAM of 1 block, k=2: `a` is evicted after its commit (1 access: not admitted, dropped);
    committed again it counts 2 and the placement planner writes it back. Without history it
    would restart at 1 and stay out of SSD again."""
    for history, admitted in ((None, True), (0, False)):
        ix = PrefixIndex(dram_blocks=1, ssd_blocks=1, admission_k=2, admission_history=history)
        a = ix.insert(0, b"a", None)
        assert placement.write_backs(ix, 0, [a]) == []
        assert [e.reason for e in ix.evict(D, 1)] == [Reason.DROPPED]
        a = ix.insert(0, b"a", None)
        assert bool(placement.write_backs(ix, 0, [a])) is admitted


def test_history_is_bounded_and_sized_from_capacity() -> None:
    assert PrefixIndex(dram_blocks=10, ssd_blocks=30).history.size == 40  # 1 word per block
    assert PrefixIndex(dram_blocks=10).history.size == 0  # no SSD: nothing to admit
    assert PrefixIndex().history.size == 0  # unbounded tiers: no default size
    ix = PrefixIndex(dram_blocks=200, ssd_blocks=0, admission_history=8)
    assert ix.history.nbytes() == 32  # 4 bytes a word, allocated once
    keys = [i.to_bytes(4, "big") for i in range(200)]
    for k in keys:
        ix.insert(0, k, None)
    ix.evict_count(D, 200)
    st = ix.stats()
    assert st.history_size == 8 and 0 < st.history_entries <= 8
    assert st.history_entries == ix.history.occupied()
    with pytest.raises(ValueError, match="admission history"):
        PrefixIndex(admission_history=-1)


def test_evict_count_matches_evict() -> None:
    def build() -> PrefixIndex:
        ix = PrefixIndex(dram_blocks=6, ssd_blocks=3, admission_k=1)
        chain(ix, [b"a", b"b", b"c"])
        chain(ix, [b"x", b"y", b"z"])
        return ix

    one, two = build(), build()
    for ix in (one, two):  # the chain a-b-c goes to SSD: its DRAM copies demote
        for w in placement.write_backs(ix, 0, ix.lookup(0, [b"a", b"b", b"c"]).blocks):
            ix.add_tier(0, w.key, S)
    out = one.evict(D, 4)
    n = two.evict_count(D, 4)
    assert n == sum(e.tier is D for e in out) == 4
    assert one.stats() == two.stats()


@pytest.mark.parametrize("policy", ["kvtier", "lru", "sglang-hicache"])
def test_memory_is_bounded_whatever_the_tier_capacity(policy: str) -> None:
    """An SSD tier of billions of small blocks must not size the index's side tables by its
    block count (the admission history, the sketch in front of a larger SSD)."""
    from kvtier.index.history import HISTORY_MAX_WORDS
    from kvtier.index.policies.adaptive.predictor import SKETCH_MAX

    ix = PrefixIndex(dram_blocks=1024, ssd_blocks=6_000_000_000, policy=policy)
    assert ix.history.size <= HISTORY_MAX_WORDS
    pol = ix._policy
    for table in ("sketch", "seen"):
        got = getattr(pol, table, None)
        if got is not None:
            assert got.size <= max(SKETCH_MAX, HISTORY_MAX_WORDS), table
