"""`kvtier.index.placement`'s decisions the daemon and the simulator share, on a real
`PrefixIndex` (LRU): fair-share victims between tenants, one tenant's coldest blocks, the
hopeless-room rule, quota overshoot, victims one at a time across size classes, promotions and
remote offers and fetches. Expected values are worked out by hand in each test."""

from __future__ import annotations

from kvtier.core.types import Tier
from kvtier.index import placement
from kvtier.index.prefix import PrefixIndex


def k(tag: int, i: int) -> bytes:
    return bytes([tag, i])


def lru(dram: int = 16, ssd: int = 16) -> PrefixIndex:
    return PrefixIndex(dram_blocks=dram, ssd_blocks=ssd, policy="lru", admission_k=2)


def owner(ns: object) -> str:
    return str(ns).split("/")[0]


def test_tenant_victims_are_one_tenants_coldest_leaves_first() -> None:
    ix = lru()
    # a/x: a chain 0 -> 1 -> 2 (only its leaf is evictable), b/x: two roots, a/y: one root
    for i in range(3):
        ix.insert("a/x", k(1, i), k(1, i - 1) if i else None)
    ix.insert("b/x", k(2, 0), None)
    ix.insert("a/y", k(3, 0), None)
    ix.insert("b/x", k(2, 1), None)
    got = placement.tenant_victims(ix, owner, "a", 5)
    assert [(b.ns, b.key) for b in got] == [("a/x", k(1, 2)), ("a/y", k(3, 0))]
    assert [b.key for b in placement.tenant_victims(ix, owner, "b", 1)] == [k(2, 0)]
    assert placement.tenant_victims(ix, owner, "c", 3) == []
    assert len(ix) == 6  # intents only: nothing dropped


def test_room_hopeless_with_one_class_and_with_several() -> None:
    ix = lru(dram=4)
    for i in range(4):
        ix.insert("a/x", k(1, i), None)
    # 4 blocks, 1 pinned: 3 evictable; 5 wanted with 1 free is hopeless for one class only
    assert placement.room_hopeless(ix, 5, 1, 1, one_class=True)
    assert not placement.room_hopeless(ix, 5, 1, 1, one_class=False)
    assert not placement.room_hopeless(ix, 4, 1, 1, one_class=True)
    assert placement.room_hopeless(ix, 1, 0, 4, one_class=False)  # nothing evictable


def test_ssd_room_evicts_nothing_when_it_cannot_make_the_room() -> None:
    ix = lru(dram=16, ssd=3)
    ix.insert("a/x", k(1, 0), None, Tier.SSD)  # SSD only, a leaf: evictable
    for i in (1, 2):  # in DRAM too: SSD eviction never takes their copies
        ix.insert("a/x", k(2, i), None)
        ix.add_tier("a/x", k(2, i), Tier.SSD)
    before = ix.stats()
    assert not placement.ssd_room(ix, 2)  # 2 more need 2 victims; one can go
    assert ix.stats() == before  # so none went
    assert ix.get("a/x", k(1, 0)) is not None
    assert placement.ssd_room(ix, 1)
    assert ix.get("a/x", k(1, 0)) is None and ix.free(Tier.SSD) == 1


def test_ssd_room_counts_parents_a_leaf_first_drop_frees() -> None:
    ix = lru(dram=16, ssd=3)
    for i in range(3):  # a chain on SSD only: one leaf evictable now, its parents after it
        ix.insert("a/x", k(1, i), k(1, i - 1) if i else None, Tier.SSD)
    assert placement.ssd_room(ix, 3)
    assert len(ix) == 0
    for i in range(3):
        ix.insert("a/x", k(1, i), k(1, i - 1) if i else None, Tier.SSD)
    ix.pin("a/x", k(1, 1))  # the leaf can go; its pinned parent, and so the root, cannot
    before = ix.stats()
    assert not placement.ssd_room(ix, 2)
    assert ix.stats() == before
    assert placement.ssd_room(ix, 1) and len(ix) == 2


def test_class_victim_evicts_one_coldest_block() -> None:
    ix = lru(dram=4, ssd=0)
    for i in range(3):
        ix.insert("a/x", k(1, i), None)
    assert placement.class_victim(ix)
    assert ix.get("a/x", k(1, 0)) is None and len(ix) == 2
    ix.pin("a/x", k(1, 1))
    ix.pin("a/x", k(1, 2))
    assert not placement.class_victim(ix)


def test_promotions_are_the_ssd_only_blocks_in_order() -> None:
    ix = lru()
    ix.insert("a/x", k(1, 0), None, Tier.SSD)
    ix.insert("a/x", k(1, 1), k(1, 0), Tier.SSD)
    ix.add_tier("a/x", k(1, 0), Tier.DRAM)
    ix.insert("a/x", k(1, 2), k(1, 1), Tier.SSD)
    blocks = ix.lookup("a/x", [k(1, 0), k(1, 1), k(1, 2)], touch=False).blocks
    assert placement.promotions(blocks) == [1, 2]


def test_remote_offers_at_commit_for_k1_and_at_the_kth_lookup() -> None:
    ix = lru()
    for i in range(3):
        ix.insert("a/x", k(1, i), k(1, i - 1) if i else None)
    chain = [k(1, i) for i in range(3)]
    new = ix.lookup("a/x", chain, touch=False).blocks
    assert [b.key for b in placement.remote_offers(new, committed=True, k=1)] == chain
    assert placement.remote_offers(new, committed=True, k=2) == []
    # k = 2: the store was the first access, the next lookup makes the second and offers
    # them; the one after (a third access) offers nothing again
    assert [b.key for b in placement.remote_offers(
        ix.lookup("a/x", chain).blocks, False, 2)] == chain
    assert placement.remote_offers(ix.lookup("a/x", chain).blocks, False, 2) == []


def test_over_quota_counts_the_blocks_to_give_up() -> None:
    # 10 KiB quota, 8 KiB held, 4 KiB more: 2 KiB over = one 4 KiB block (rounded up)
    assert placement.over_quota(8192, 4096, 10240, 4096) == 1
    assert placement.over_quota(8192, 8192, 10240, 4096) == 2  # 6 KiB over: 2 blocks
    assert placement.over_quota(4096, 4096, 10240, 4096) == 0  # fits
    assert placement.over_quota(1 << 40, 4096, 0, 4096) == 0  # no quota


def test_remote_fetches_claim_only_for_what_the_store_holds() -> None:
    # a chain of 10: 3 blocks local, the store holds the next 2 (keys 3 and 4), not key 5 on
    assert placement.remote_fetches(3, 3, 2) == 2  # a slot for keys 3 and 4 only, not 5..9
    assert placement.remote_fetches(3, 3, 0) == 0  # the store holds none: no slot, no eviction
    # the prefix was cut at block 1 (no slot for an SSD block's promotion): the chain goes on
    # with a local block, not with what the store holds
    assert placement.remote_fetches(1, 3, 2) == 0
    # another request committed key 3 between the check and the Acquire: only key 4 is left
    assert placement.remote_fetches(4, 3, 2) == 1
    assert placement.remote_fetches(6, 3, 2) == 0  # everything the store held is local now
    assert placement.remote_fetches(0, 0, 7) == 7  # nothing local: the store's run from the root
