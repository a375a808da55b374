"""Stateful property test of the prefix index against an independent model.

Random interleavings of insert, lookup, pin, unpin, evict (with and without write-back), demote,
promote, drop, remove and HBM reports over two tenants and two capacity-limited tiers. The model
(plain dicts and sets) predicts every outcome, including which calls must raise, and every block's
access count, with the admission history (counts of dropped blocks kept in a direct-mapped table
and given back on reinsertion) modelled as a dict word -> (tenant, key, count); after every step
the index is compared with it and the invariants are re-derived by brute force. The index keeps
its journal: the copies it lists, replayed from the start, are exactly the model's copies (with
their DRAM slots) after every step, so no residency change escapes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core.types import Tier
from kvtier.index import placement
from kvtier.index.policies import POLICIES
from kvtier.index.policies.adaptive.policy import SHARES
from kvtier.index.policies.adaptive.queue import AdaptiveQueue
from kvtier.index.prefix import (
    EVICTION_COUNTERS,
    BadSlot,
    DuplicateBlock,
    IndexStateError,
    MissingParent,
    NotEvictable,
    Op,
    PinnedBlock,
    PrefixIndex,
    Reason,
    TierFull,
    UnknownBlock,
)

D, S, H = Tier.DRAM, Tier.SSD, Tier.HBM
KEYS = [bytes([i]) * 4 for i in range(14)]
TENANTS: list[int | str] = [0, "t"]
DRAM_CAP, SSD_CAP = 8, 6


@dataclass
class Entry:
    parent: bytes | None
    tiers: set[Tier]
    slot: int | None = None
    pins: int = 0
    replicas: set[str] = field(default_factory=set)
    hits: int = 1
    doomed: bool = False  # purged while pinned (or under such a block): waits for `reap`


class IndexMachine(RuleBasedStateMachine):
    policy = "lru"
    admission_k = 2
    history: int | None = None  # the default: DRAM_CAP + SSD_CAP words

    def __init__(self) -> None:
        super().__init__()
        self.ix = PrefixIndex(dram_blocks=DRAM_CAP, ssd_blocks=SSD_CAP, policy=self.policy,
                              admission_k=self.admission_k, admission_history=self.history,
                              journal=True)
        self.copies: dict[tuple[int | str, bytes, Tier], int | None] = {}  # journal replayed
        self.m: dict[tuple[int | str, bytes], Entry] = {}
        self.evictions = dict.fromkeys(EVICTION_COUNTERS, 0)
        self.ssd_writes = 0
        self.ghost: dict[int, tuple[tuple[int | str, bytes], int]] = {}
        self.recalled = 0
        h = self.ix.history
        where = {h.slot(t, k) for t in TENANTS for k in KEYS} if h.size else set()
        # distinct (word, tag) per key, so the dict model is exact (no tag collision)
        assert not h.size or len(where) == len(TENANTS) * len(KEYS)

    def forget(self, tk: tuple[int | str, bytes]) -> None:
        """The entry left the cache: its count goes to its history word (overwriting)."""
        e = self.m.pop(tk)
        if self.ix.history.size:
            self.ghost[self.ix.history.slot(*tk)[0]] = (tk, min(e.hits, 255))

    def new_entry(self, tk: tuple[int | str, bytes], parent: bytes | None, tier: Tier,
                  slot: int | None) -> None:
        hits = 1
        if self.ix.history.size:
            word = self.ix.history.slot(*tk)[0]
            old = self.ghost.get(word)
            if old is not None and old[0] == tk:
                del self.ghost[word]
                hits += old[1]
                self.recalled += 1
        doomed = parent is not None and self.m[(tk[0], parent)].doomed
        self.m[tk] = Entry(parent, {tier}, slot, hits=hits, doomed=doomed)

    # ------------------------------------------------------------ model helpers
    def count(self, tier: Tier) -> int:
        return sum(tier in e.tiers for e in self.m.values())

    def children(self, tk: tuple[int | str, bytes]) -> int:
        return sum(1 for (t, _), e in self.m.items() if t == tk[0] and e.parent == tk[1])

    def evictable(self, tk: tuple[int | str, bytes], tier: Tier) -> bool:
        e = self.m[tk]
        if e.pins or tier not in e.tiers:
            return False
        if tier is D:
            return S in e.tiers or self.children(tk) == 0
        return D not in e.tiers and self.children(tk) == 0

    def apply(self, ns: int | str, ev_key: bytes, tier: Tier, reason: Reason,
              slot: int | None) -> None:
        tk = (ns, ev_key)
        e = self.m[tk]
        assert not e.pins, "a pinned block was evicted"
        assert tier in e.tiers
        self.evictions[f"{tier.label}_{reason.value}"] += 1
        if tier is D:
            assert slot == e.slot
            e.slot = None
        if reason is Reason.WRITTEN_BACK:
            assert S not in e.tiers and (e.parent is None or S in self.m[(ns, e.parent)].tiers)
            e.tiers.add(S)
            self.ssd_writes += 1
        e.tiers.discard(tier)
        if reason is Reason.DROPPED:
            assert not e.tiers and self.children(tk) == 0, "dropped a block with children"
            self.forget(tk)
        else:
            assert e.tiers

    def free_slot(self) -> int | None:
        used = {e.slot for e in self.m.values()}
        return next((s for s in range(DRAM_CAP) if s not in used), None)

    # ------------------------------------------------------------ rules
    @rule(data=st.data(), t=st.sampled_from(TENANTS), k=st.sampled_from(KEYS),
          tier=st.sampled_from([D, D, S]), use_slot=st.booleans(), stray=st.integers(0, 9))
    def insert(self, data: st.DataObject, t: int | str, k: bytes, tier: Tier,
               use_slot: bool, stray: int) -> None:
        # Mostly a parent that is cached (a real commit), sometimes any key (maybe missing).
        mine = sorted(key for (tt, key) in self.m if tt == t)
        pool = KEYS if stray == 0 else mine
        p = data.draw(st.one_of(st.none(), st.sampled_from(pool)) if pool else st.none())
        slot = self.free_slot() if use_slot and tier is D else None
        want: type[Exception] | None = None
        if (t, k) in self.m:
            want = DuplicateBlock
        elif p is not None and (t, p) not in self.m:
            want = MissingParent
        elif self.count(tier) >= (DRAM_CAP if tier is D else SSD_CAP):
            want = TierFull
        elif tier is S and p is not None and S not in self.m[(t, p)].tiers:
            want = MissingParent
        if want is not None:
            with pytest.raises(want):
                self.ix.insert(t, k, p, tier, dram_slot=slot)
            return
        self.ix.insert(t, k, p, tier, dram_slot=slot)
        self.new_entry((t, k), p, tier, slot)
        if tier is S:
            self.ssd_writes += 1

    @rule(data=st.data(), t=st.sampled_from(TENANTS), n=st.integers(1, 4),
          use_slot=st.booleans())
    def commit_chain(self, data: st.DataObject, t: int | str, n: int, use_slot: bool) -> None:
        """Extend a cached chain (or start one) by up to n new DRAM blocks, like a Commit."""
        mine = sorted(key for (tt, key) in self.m if tt == t)
        p = data.draw(st.one_of(st.none(), st.sampled_from(mine)) if mine else st.none())
        fresh = [k for k in KEYS if (t, k) not in self.m]
        for k in data.draw(st.permutations(fresh))[:n]:
            if self.count(D) >= DRAM_CAP:
                with pytest.raises(TierFull):
                    self.ix.insert(t, k, p, D)
                return
            slot = self.free_slot() if use_slot else None
            self.ix.insert(t, k, p, D, dram_slot=slot)
            self.new_entry((t, k), p, D, slot)
            p = k

    @rule(data=st.data(), t=st.sampled_from(TENANTS), partial=st.booleans())
    def admit_and_commit(self, data: st.DataObject, t: int | str, partial: bool) -> None:
        """Look a chain up, ask DRAM admission about its missed suffix, store what it admits
        (the simulator's and Allocate's path): admission never strands or breaks anything."""
        mine = sorted(key for (tt, key) in self.m if tt == t)
        p = data.draw(st.one_of(st.none(), st.sampled_from(mine)) if mine else st.none())
        chain: list[bytes] = []
        cur = p
        while cur is not None:
            chain.append(cur)
            cur = self.m[(t, cur)].parent
        chain.reverse()
        fresh = [k for k in KEYS if (t, k) not in self.m]
        keys = chain + data.draw(st.permutations(fresh))[: data.draw(st.integers(0, 4))]
        self.lookup_rule(t, keys)
        start = len(chain)
        n = self.ix.admit(t, keys, start, partial_last=partial)
        assert 0 <= n <= len(keys) - start
        parent = keys[start - 1] if start else None
        for k in keys[start : start + n]:
            if self.count(D) >= DRAM_CAP:
                break
            self.ix.insert(t, k, parent, D)
            self.new_entry((t, k), parent, D, None)
            parent = k

    def lookup_rule(self, t: int | str, keys: list[bytes]) -> None:
        got = self.ix.lookup(t, keys)
        for key in keys[: len(got.blocks)]:
            self.m[(t, key)].hits += 1

    @rule(data=st.data())
    def insert_with_taken_slot(self, data: st.DataObject) -> None:
        taken = [e.slot for e in self.m.values() if e.slot is not None]
        if not taken or self.count(D) >= DRAM_CAP:
            return
        slot = data.draw(st.sampled_from(taken))
        free_key = next((k for k in KEYS if (0, k) not in self.m), None)
        if free_key is not None:
            with pytest.raises(BadSlot):
                self.ix.insert(0, free_key, None, D, dram_slot=slot)

    @rule(t=st.sampled_from(TENANTS), k=st.sampled_from(KEYS), extra=st.sampled_from(KEYS),
          replica=st.sampled_from([None, "r1", "r2"]))
    def lookup(self, t: int | str, k: bytes, extra: bytes, replica: str | None) -> None:
        chain: list[bytes] = []
        cur: bytes | None = k
        while cur is not None and (t, cur) in self.m:
            chain.append(cur)
            cur = self.m[(t, cur)].parent
        chain.reverse()
        if (t, k) not in self.m:
            chain = [k]  # not cached: no hit at all
        keys = [*chain, extra]
        got = self.ix.lookup(t, keys, replica=replica)
        want = []
        for i, key in enumerate(keys):
            e = self.m.get((t, key))
            if e is None or e.parent != (keys[i - 1] if i else None) or e.doomed:
                break
            held = e.replicas if replica is None else e.replicas & {replica}
            want.append(H if held else D if D in e.tiers else S)
        assert got.tiers == want
        assert [b.key for b in got.blocks] == keys[: len(want)]
        for key in keys[: len(want)]:
            self.m[(t, key)].hits += 1

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        if self.m:
            tk = data.draw(st.sampled_from(sorted(self.m, key=repr)))
            self.ix.pin(*tk)
            self.m[tk].pins += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if self.m:
            tk = data.draw(st.sampled_from(sorted(self.m, key=repr)))
            if self.m[tk].pins:
                self.ix.unpin(*tk)
                self.m[tk].pins -= 1
            else:
                with pytest.raises(IndexStateError):
                    self.ix.unpin(*tk)

    @rule(tier=st.sampled_from([D, S]), n=st.integers(0, 4))
    def evict(self, tier: Tier, n: int) -> None:
        out = self.ix.evict(tier, n)
        main = 0
        for ev in out:
            assert ev.tier is tier
            main += 1
            self.apply(ev.ns, ev.key, ev.tier, ev.reason, ev.dram_slot)
        assert main <= n
        if main < n:
            assert not any(self.evictable(tk, tier) for tk in self.m), "stopped early"

    @rule(data=st.data(), tier=st.sampled_from([D, S]))
    def drop(self, data: st.DataObject, tier: Tier) -> None:
        if not self.m:
            return
        tk = data.draw(st.sampled_from(sorted(self.m, key=repr)))
        e = self.m[tk]
        want: type[Exception] | None = None
        if tier not in e.tiers:
            want = UnknownBlock
        elif e.pins:
            want = PinnedBlock
        elif self.children(tk) and (tier is S or S not in e.tiers):
            want = NotEvictable
        if want is not None:
            with pytest.raises(want):
                self.ix.drop(*tk, tier)
            return
        ev = self.ix.drop(*tk, tier)
        self.apply(ev.ns, ev.key, ev.tier, ev.reason, ev.dram_slot)

    @rule(data=st.data(), any_block=st.booleans())
    def demote(self, data: st.DataObject, any_block: bool) -> None:
        pool = sorted((tk for tk, e in self.m.items() if any_block or D in e.tiers), key=repr)
        if not pool:
            return
        tk = data.draw(st.sampled_from(pool))
        e = self.m[tk]
        parent_on_ssd = e.parent is None or S in self.m[(tk[0], e.parent)].tiers
        want: type[Exception] | None = None
        if D not in e.tiers:
            want = UnknownBlock
        elif e.pins:
            want = PinnedBlock
        elif S not in e.tiers and self.count(S) >= SSD_CAP:
            want = TierFull
        elif S not in e.tiers and not parent_on_ssd:
            want = MissingParent
        if want is not None:
            with pytest.raises(want):
                self.ix.demote(*tk)
            return
        ev = self.ix.demote(*tk)
        self.apply(ev.ns, ev.key, ev.tier, ev.reason, ev.dram_slot)

    @rule(data=st.data(), tier=st.sampled_from([D, S]), use_slot=st.booleans())
    def promote(self, data: st.DataObject, tier: Tier, use_slot: bool) -> None:
        if not self.m:
            return
        tk = data.draw(st.sampled_from(sorted(self.m, key=repr)))
        e = self.m[tk]
        slot = self.free_slot() if use_slot and tier is D else None
        want: type[Exception] | None = None
        if tier in e.tiers:
            want = DuplicateBlock
        elif self.count(tier) >= (DRAM_CAP if tier is D else SSD_CAP):
            want = TierFull
        elif tier is S and e.parent is not None and S not in self.m[(tk[0], e.parent)].tiers:
            want = MissingParent
        if want is not None:
            with pytest.raises(want):
                self.ix.add_tier(*tk, tier, dram_slot=slot)
            return
        self.ix.add_tier(*tk, tier, dram_slot=slot)
        e.tiers.add(tier)
        if tier is D:
            e.slot = slot
        else:
            self.ssd_writes += 1

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if not self.m:
            return
        tk = data.draw(st.sampled_from(sorted(self.m, key=repr)))
        e = self.m[tk]
        if e.pins or self.children(tk):
            with pytest.raises((PinnedBlock, NotEvictable)):
                self.ix.remove(*tk)
            return
        self.ix.remove(*tk)
        self.forget(tk)
        self.evictions["removed"] += 1

    @rule(data=st.data())
    def remove_subtree(self, data: st.DataObject) -> None:
        if not self.m:
            return
        top = data.draw(st.sampled_from(sorted(self.m, key=repr)))
        sub = {top}
        grew = True
        while grew:
            more = {tk for tk, e in self.m.items()
                    if tk[0] == top[0] and (tk[0], e.parent) in sub} - sub
            sub |= more
            grew = bool(more)
        if any(self.m[tk].pins for tk in sub):
            with pytest.raises(PinnedBlock):
                self.ix.remove_subtree(*top)
            return
        out = self.ix.remove_subtree(*top)
        assert {(e.ns, e.key) for e in out} == sub
        for ev in out:
            if ev.reason is Reason.DROPPED:
                self.forget((ev.ns, ev.key))
        assert not sub & set(self.m)
        self.evictions["removed"] += len(sub)

    def subtree(self, top: tuple[int | str, bytes]) -> set[tuple[int | str, bytes]]:
        sub = {top}
        grew = True
        while grew:
            more = {tk for tk, e in self.m.items()
                    if tk[0] == top[0] and (tk[0], e.parent) in sub} - sub
            sub |= more
            grew = bool(more)
        return sub

    @rule(data=st.data(), t=st.sampled_from(TENANTS), whole=st.booleans())
    def purge(self, data: st.DataObject, t: int | str, whole: bool) -> None:
        """An operator's evict: a tenant's blocks, or the subtrees of some keys; pinned ones and
        their ancestors stay, doomed."""
        keys = None if whole else data.draw(st.lists(st.sampled_from(KEYS), max_size=3))
        if keys is None:
            chosen = {tk for tk in self.m if tk[0] == t}
        else:
            chosen = set().union(*(self.subtree((t, k)) for k in keys if (t, k) in self.m))
        keep: set[tuple[int | str, bytes]] = set()
        for tk in chosen:
            if self.m[tk].pins:
                cur: tuple[int | str, bytes] | None = tk
                while cur is not None and cur in chosen:
                    keep.add(cur)
                    p = self.m[cur].parent
                    cur = None if p is None else (t, p)
        selection = self.ix.select(t, keys)
        assert {(b.ns, b.key) for b in selection} == chosen
        gone = chosen - keep
        want = (len(gone), sum(D in self.m[tk].tiers for tk in gone),
                sum(S in self.m[tk].tiers for tk in gone))
        got = self.ix.purge(t, selection)
        assert (got.removed, got.dram, got.ssd) == want and got.doomed == len(keep)
        assert {(t, k) for k in got.keys} == gone
        for tk in gone:
            del self.m[tk]  # an operator's removal: no admission history
        for tk in keep:
            self.m[tk].doomed = True
        self.evictions["removed"] += len(gone)

    @rule()
    def reap(self) -> None:
        gone: set[tuple[int | str, bytes]] = set()
        while True:
            ready = {tk for tk, e in self.m.items()
                     if e.doomed and not e.pins and not self.children(tk)}
            if not ready:
                break
            for tk in ready:
                self.forget(tk)
            gone |= ready
        assert set(self.ix.reap()) == gone
        self.evictions["removed"] += len(gone)

    @rule(data=st.data(), replica=st.sampled_from(["r1", "r2"]), add=st.booleans())
    def hbm(self, data: st.DataObject, replica: str, add: bool) -> None:
        t, k = data.draw(st.sampled_from(TENANTS)), data.draw(st.sampled_from(KEYS))
        e = self.m.get((t, k))
        if add:
            assert self.ix.hbm_add(replica, t, k) == (e is not None)
            if e is not None:
                e.replicas.add(replica)
        else:
            assert self.ix.hbm_drop(replica, t, k) == (e is not None and replica in e.replicas)
            if e is not None:
                e.replicas.discard(replica)

    @precondition(lambda self: len(self.m) > 0)
    @rule(replica=st.sampled_from(["r1", "r2"]))
    def replica_leaves(self, replica: str) -> None:
        n = sum(replica in e.replicas for e in self.m.values())
        assert self.ix.drop_replica(replica) == n
        for e in self.m.values():
            e.replicas.discard(replica)

    # ------------------------------------------------------------ invariants
    @invariant()
    def matches_model_and_invariants_hold(self) -> None:
        blocks = {(b.ns, b.key): b for b in self.ix.iter_blocks()}
        assert set(blocks) == set(self.m)
        for tk, b in blocks.items():
            e = self.m[tk]
            assert b.parent_key == e.parent
            assert {t for t in (D, S) if b.flags & (1 << t)} == e.tiers and e.tiers
            assert (b.dram_slot, b.pins, b.children) == (e.slot, e.pins, self.children(tk))
            assert b.hits == e.hits, "access count (kept across a drop by the history)"
            # no stranded block: the parent is cached (same tenant) or this is a root
            assert e.parent is None or (tk[0], e.parent) in blocks
            # SSD is prefix-closed
            if S in e.tiers and e.parent is not None:
                assert S in self.m[(tk[0], e.parent)].tiers
        slots = [e.slot for e in self.m.values() if e.slot is not None]
        assert len(slots) == len(set(slots))
        st_ = self.ix.stats()
        assert st_.dram_blocks == self.count(D) <= DRAM_CAP
        assert st_.ssd_blocks == self.count(S) <= SSD_CAP
        assert st_.entries == len(self.m) == len(self.ix)
        assert st_.pinned_blocks == sum(e.pins > 0 for e in self.m.values())
        assert st_.pins == sum(e.pins for e in self.m.values())
        assert st_.hbm_blocks == sum(bool(e.replicas) for e in self.m.values())
        assert st_.evictions == self.evictions
        assert st_.ssd_writes == self.ssd_writes
        # history: bounded, only dropped keys, counters equal a recount
        assert st_.history_size == self.ix.history.size == (
            DRAM_CAP + SSD_CAP if self.history is None else self.history)
        assert st_.history_entries == len(self.ghost) == self.ix.history.occupied()
        assert st_.history_entries <= st_.history_size
        assert st_.history_recalled == self.recalled
        assert not {tk for tk, _ in self.ghost.values()} & set(self.m)
        for tier, n in ((D, st_.evictable_dram), (S, st_.evictable_ssd)):
            want = {tk for tk in self.m if self.evictable(tk, tier)}
            got = {(b.ns, b.key) for b in self.ix.victims(tier, 100)}
            assert got == want and n == len(want)
        for c in self.ix.take_changes():
            where = (c.ns, c.key, c.tier)
            if c.op is Op.ADD:
                assert where not in self.copies, "added twice"
                self.copies[where] = c.slot
                b = blocks.get((c.ns, c.key))
                assert b is None or c.parent == b.parent_key
            elif c.op is Op.DROP:
                assert self.copies.pop(where) == c.slot, "dropped what was not there"
            else:
                assert c.tier is D and self.copies[where] == c.old_slot
                self.copies[where] = c.slot
        for d in self.ix.take_drops():
            freed = [self.copies.pop((d.ns, k, d.tier)) for k in d.keys]
            assert sorted(s for s in freed if s is not None) == sorted(d.slots)
        assert self.copies == {(t, k, tier): e.slot if tier is D else None
                               for (t, k), e in self.m.items() for tier in e.tiers}
        assert self.ix.take_changes() == [] and self.ix.take_drops() == []
        assert self.ix.doomed_blocks == sum(e.doomed for e in self.m.values())
        assert all(self.ix.doomed(t, k) == e.doomed for (t, k), e in self.m.items())


class SlruMachine(IndexMachine):
    """The same rules and invariants under the frequency-aware policy and write-everything,
    without admission history (a dropped block comes back with a count of 1)."""

    policy = "slru"
    admission_k = 1
    history = 0


class SmallHistoryMachine(IndexMachine):
    """A 3-word history: most drops overwrite another block's count."""

    history = 3


class KvtierModesMachine(IndexMachine):
    """kvtier with its DRAM queue switched between its modes at any step (into LFU every block
    is re-ranked, out of it every block goes back to the lists): the same invariants."""

    policy = "kvtier"

    @rule(mode=st.sampled_from(SHARES))
    def switch_mode(self, mode: float) -> None:
        q = self.ix._policy.dram
        assert isinstance(q, AdaptiveQueue)
        n = len(q)
        q.set_share(mode)
        assert len(q) == n


def _policy_machine(name: str) -> type[IndexMachine]:
    return type(f"Machine_{name}", (IndexMachine,), {"policy": name, "__doc__":
                f"The same rules and invariants under the {name!r} policy."})


POLICY_MACHINES = {name: _policy_machine(name) for name in sorted(POLICIES)
                   if name not in ("lru", "slru")}


_FAST = settings(max_examples=80, stateful_step_count=50, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
IndexMachine.TestCase.settings = _FAST
SlruMachine.TestCase.settings = _FAST
SmallHistoryMachine.TestCase.settings = _FAST
KvtierModesMachine.TestCase.settings = _FAST
for _m in POLICY_MACHINES.values():
    _m.TestCase.settings = settings(max_examples=30, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestIndexMachine = IndexMachine.TestCase
TestSlruMachine = SlruMachine.TestCase
TestSmallHistoryMachine = SmallHistoryMachine.TestCase
TestKvtierModesMachine = KvtierModesMachine.TestCase
for _name, _m in POLICY_MACHINES.items():
    globals()[f"TestPolicy_{_name.replace('-', '_')}"] = _m.TestCase


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("machine", [IndexMachine, SlruMachine, SmallHistoryMachine,
                                     *POLICY_MACHINES.values()],
                         ids=["lru", "slru", "history3", *POLICY_MACHINES])
def test_index_machine_long(machine: type[IndexMachine]) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=settings(
        max_examples=2000, stateful_step_count=80, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def audit(ix: PrefixIndex) -> None:
    """Brute-force invariants of a whole index from its public view."""
    blocks = {(b.ns, b.key): b for b in ix.iter_blocks()}
    kids: dict[tuple[int | str, bytes], int] = dict.fromkeys(blocks, 0)
    for (t, _), b in blocks.items():
        assert b.in_dram or b.on_ssd
        if b.parent is not None:
            assert blocks.get((t, b.parent.key)) is b.parent, "stranded block"
            kids[(t, b.parent.key)] += 1
            if b.on_ssd:
                assert b.parent.on_ssd, "SSD not prefix-closed"
    assert all(blocks[tk].children == n for tk, n in kids.items())
    st_ = ix.stats()
    assert st_.dram_blocks == sum(b.in_dram for b in blocks.values()) <= (st_.dram_capacity or 1e18)
    assert st_.ssd_blocks == sum(b.on_ssd for b in blocks.values()) <= (st_.ssd_capacity or 1e18)
    assert st_.entries == len(blocks)


@pytest.mark.parametrize(("policy", "k"), [("lru", 1), ("lru", 2), ("slru", 2),
                                           *((p, 2) for p in sorted(POLICIES)
                                             if p not in ("lru", "slru"))])
def test_write_back_drain_keeps_invariants(policy: str, k: int) -> None:
    """A random forest in DRAM, random lookups whose chains the placement planner writes back
    (`placement.write_backs`, after `placement.ssd_room`: the daemon's and the simulator's
    path), then evictions until DRAM is empty: exercises chain write-back under admission,
    SSD room-making, free demotion and leaf-first drops."""
    import random

    rng = random.Random(f"{policy}{k}")
    seen: dict[Reason, int] = {}
    ssd_room_made = written = 0
    for _ in range(30):
        ix = PrefixIndex(dram_blocks=60, ssd_blocks=rng.choice([5, 15, 40]), policy=policy,
                         admission_k=k)
        keys: list[bytes] = []
        for i in range(60):
            key = i.to_bytes(2, "big")
            parent = rng.choice([None, *keys[-8:]]) if keys else None
            ix.insert(0, key, parent, D, dram_slot=i)
            keys.append(key)
        lookups = 40
        while ix.blocks(D):
            for _ in range(lookups):
                b = ix.get(0, rng.choice(keys))
                chain = []
                while b is not None:
                    chain.append(b.key)
                    b = b.parent
                queued: list[bytes] = []  # as the daemon queues them: pinned, room made first
                for w in placement.write_backs(ix, 0, ix.lookup(0, chain[::-1]).blocks):
                    before = dict(ix.stats().evictions)
                    if not placement.ssd_room(ix, 1 + len(queued)):
                        break
                    ssd_room_made += ix.stats().evictions != before
                    ix.pin(0, w.key)
                    queued.append(w.key)
                for key in queued:  # written: recorded in order
                    ix.unpin(0, key)
                    ix.add_tier(0, key, S)
                    written += 1
                audit(ix)
            lookups = 3  # then lookups between evictions: room is made from SSD-only blocks
            for ev in ix.evict(D, rng.randint(1, 5)):
                seen[ev.reason] = seen.get(ev.reason, 0) + 1
            audit(ix)
        assert ix.stats().evictable_dram == 0
    # every path was taken: chain write-back, SSD room made, free demotion, drops
    assert written and ssd_room_made
    assert {Reason.DEMOTED, Reason.DROPPED} <= set(seen)
