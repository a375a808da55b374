"""The prefix index's state: its entry table, per-tier residency, and eviction-queue membership.

`IndexState` owns every field of `kvtier.index.prefix.PrefixIndex` and the primitives that change
them together — a copy added to or dropped from a tier (`_add`/`_drop`), an entry leaving its last
tier (`_unlink`), and queue membership (`_requeue`) — so counts, DRAM slots, queues and the
admission history never disagree. The public operations built on them live in `kvtier.index.prefix`
(lookup, commit, leases, residency changes), `kvtier.index.evict` (victims, eviction, write-back)
and `kvtier.index.hbm` (replica reports); the contract is in `kvtier.index.prefix`.

Eviction structure. Each managed tier has one eviction queue (a `kvtier.index.policies` strategy
over intrusive links in the blocks) holding exactly the blocks that may leave that tier now:

    DRAM queue: unpinned, in DRAM, and (on SSD too  -> eviction = demotion, children stay
                                         or a leaf   -> eviction drops its last tier)
    SSD queue:  unpinned, on SSD only, and a leaf    -> eviction drops its last tier

A block is in at most one queue (an SSD copy of a DRAM-resident block is not reclaimed by SSD
eviction; the block's DRAM eviction turns it into an SSD-only block first). Membership is
re-derived in O(1) whenever pins, residency or the child count change, so choosing a victim is
popping the queue's cold end — never a scan. A block entering a queue (unpinned, its last child
gone, an SSD copy added, demoted) goes to the cold end if it was last used no later than the
queue's coldest block, else to the hot end; so a chain used together drains tail-first, and the
order is exact LRU whenever entering blocks are older than all or newer than all.

Journal. With `journal=True` every residency change — a copy added to or dropped from a tier
(`_add`/`_drop`), a DRAM copy moved to another slot — is appended to a list of `Change` entries in
the order it happened, whatever public call made it; `take_changes` hands them out and starts a new
list (as SGLang's radix cache hands out its KV events with `take_events`). The daemon's applier
(`kvtier.daemon.cache.applier`) acts on them — frees slots, charges tenants, deletes SSD keys,
publishes events — so no caller of the index repeats that bookkeeping. Off by default (the simulator
and the benchmarks do not read it), so the request path pays one `is None` test per change.

Threading: none; the owner serialises calls (see `kvtier.index.prefix`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic

from kvtier.core.types import BlockKey, Tier
from kvtier.index.history import HISTORY_MAX_WORDS, AdmissionHistory
from kvtier.index.policies import DEFAULT_POLICY, make_policy
from kvtier.index.policies.base import EvictionQueue
from kvtier.index.types import (
    EVICTION_COUNTERS,
    FLAG_BITS,
    HITS_BITS,
    HITS_MAX,
    IN_DRAM,
    ON_SSD,
    Q_DRAM,
    Q_SSD,
    QUEUED,
    SLOT_SHIFT,
    STORED,
    BadSlot,
    Block,
    Change,
    Drops,
    Evicted,
    IndexStats,
    MissingParent,
    NsT,
    Op,
    PinnedBlock,
    Reason,
    TierFull,
    UnknownBlock,
)

# Module constants: an enum member lookup (`Tier.SSD`) costs ~0.1 us on Python 3.11.
_HBM, _DRAM, _SSD = Tier.HBM, Tier.DRAM, Tier.SSD
_DEMOTED, _WRITTEN_BACK, _COPY_DROPPED, _DROPPED = (
    Reason.DEMOTED, Reason.WRITTEN_BACK, Reason.COPY_DROPPED, Reason.DROPPED)
_ADD, _DROP = Op.ADD, Op.DROP


def short(key: BlockKey) -> str:
    """A key as shown in error messages: its first 8 bytes in hex."""
    return key.hex()[:16]


class IndexState(Generic[NsT]):
    """The fields of a prefix index and the primitives that keep them consistent.

    Constructor arguments are documented on `kvtier.index.prefix.PrefixIndex`. Subclasses add
    operations; they change residency, pins and children only through `_add`, `_drop`,
    `_unlink` and `_requeue` (plus the pin/child counters followed by `_requeue`).
    """

    def __init__(
        self,
        *,
        dram_blocks: int | None = None,
        ssd_blocks: int | None = None,
        block_bytes: int | None = None,
        policy: str = DEFAULT_POLICY,
        admission_k: int = 2,
        admission_history: int | None = None,
        journal: bool = False,
    ) -> None:
        for name, cap in (("dram_blocks", dram_blocks), ("ssd_blocks", ssd_blocks)):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0, got {cap}")
        self._cap = {_DRAM: dram_blocks, _SSD: ssd_blocks}
        self._count = {_DRAM: 0, _SSD: 0}
        if admission_k < 1:
            raise ValueError(f"admission k must be >= 1, got {admission_k}")
        pol = self._policy = make_policy(policy, dram_blocks, ssd_blocks, admission_k)
        self._qd = pol.dram
        self._qs = pol.ssd
        self._hooks = pol.hooks
        self._marks = pol.marks
        self.policy = policy
        self.admission = pol.ssd_admission
        if admission_history is None:
            admission_history = min(HISTORY_MAX_WORDS, (
                pol.ghost_words * (dram_blocks + ssd_blocks)
                if dram_blocks is not None and ssd_blocks is not None
                and (ssd_blocks or pol.ghosts) else 0))
        self.history = AdmissionHistory(admission_history)
        self.block_bytes = block_bytes
        self._slot_used = bytearray(dram_blocks or 0)  # 0 free, 1 a block's, 2 a pinned block's
        self._maps: dict[NsT, dict[BlockKey, Block[NsT]]] = {}
        self._replicas: dict[str | int, int] = {}
        self._clock = 0
        self._entries = 0
        self._hbm_blocks = 0
        self._pinned = 0
        self._pins = 0
        self._ssd_writes = 0
        self._evictions = dict.fromkeys(EVICTION_COUNTERS, 0)
        self._journal: list[Change[NsT]] | None = [] if journal else None
        self._doomed: set[Block[NsT]] = set()  # `kvtier.index.purge`: blocks waiting for pins
        self._drops: list[Drops[NsT]] = []  # `kvtier.index.purge`'s journal entries
        self._reap_due = False

    # ---------------------------------------------------------------- journal
    def take_changes(self) -> list[Change[NsT]]:
        """The residency changes since the last call, oldest first, and a fresh journal ([]
        when the index keeps none: `journal=False`)."""
        j = self._journal
        if not j:
            return []
        self._journal = []
        return j

    # ---------------------------------------------------------------- queries
    def get(self, ns: NsT, key: BlockKey) -> Block[NsT] | None:
        m = self._maps.get(ns)
        return None if m is None else m.get(key)

    def __len__(self) -> int:
        return self._entries

    def iter_blocks(self) -> Iterator[Block[NsT]]:
        """Every entry, namespace by namespace, parents before children. O(entries): for audits,
        statistics and snapshots, not for the request path; don't mutate while iterating."""
        for m in self._maps.values():
            yield from m.values()

    def blocks_of(self, match: Callable[[NsT], bool], tier: Tier) -> int:
        """Blocks in `tier` of the namespaces `match` accepts. O(their entries): for
        statistics, not for the request path."""
        bit = 1 << tier
        return sum(1 for t, m in self._maps.items() if match(t)
                   for b in m.values() if b.flags & bit)

    def capacity(self, tier: Tier) -> int | None:
        return self._cap[tier]

    def resize_policy(self, dram_blocks: int) -> None:
        """Tells the policy how many blocks DRAM now holds (`Policy.resize`); the index's own
        bounds (`capacity`) stay."""
        self._policy.resize(dram_blocks)

    def blocks(self, tier: Tier) -> int:
        return self._hbm_blocks if tier is _HBM else self._count[tier]

    def bytes_in(self, tier: Tier) -> int | None:
        """Bytes held in a managed tier: blocks x `block_bytes` (None without a block size)."""
        return None if self.block_bytes is None else self._count[tier] * self.block_bytes

    def free(self, tier: Tier) -> int | None:
        """Blocks that fit into `tier` without evicting (None = unbounded)."""
        cap = self._cap[tier]
        return None if cap is None else cap - self._count[tier]

    def stats(self) -> IndexStats:
        return IndexStats(
            entries=self._entries,
            dram_blocks=self._count[_DRAM],
            ssd_blocks=self._count[_SSD],
            hbm_blocks=self._hbm_blocks,
            pinned_blocks=self._pinned,
            pins=self._pins,
            evictable_dram=len(self._qd),
            evictable_ssd=len(self._qs),
            dram_capacity=self._cap[_DRAM],
            ssd_capacity=self._cap[_SSD],
            block_bytes=self.block_bytes,
            ssd_writes=self._ssd_writes,
            evictions=dict(self._evictions),
            history_size=self.history.size,
            history_entries=self.history.entries,
            history_recalled=self.history.recalled,
        )

    # ---------------------------------------------------------------- checks
    def _need(self, ns: NsT, key: BlockKey) -> Block[NsT]:
        b = self.get(ns, key)
        if b is None:
            shown = short(key) if isinstance(key, bytes) else repr(key)
            raise UnknownBlock(f"block {shown} in namespace {ns!r} is not cached")
        return b

    def _queue_of(self, tier: Tier) -> EvictionQueue:
        if tier is _DRAM:
            return self._qd
        if tier is _SSD:
            return self._qs
        raise ValueError(f"{tier.label} is not managed by the index (HBM belongs to engines)")

    def _check_room(self, tier: Tier, slot: int | None) -> None:
        cap = self._cap[tier]
        if cap is not None and self._count[tier] >= cap:
            raise TierFull(f"{tier.label} is full ({cap} blocks); evict first")
        if slot is None:
            return
        if tier is not _DRAM:
            raise BadSlot("only DRAM copies have a slot")
        n = len(self._slot_used)
        if n == 0:
            raise BadSlot("DRAM slot ids need a bounded DRAM tier (dram_blocks)")
        if not isinstance(slot, int) or not 0 <= slot < n:
            raise BadSlot(f"DRAM slot {slot!r} is outside the pool (0..{n - 1})")
        if self._slot_used[slot]:
            raise BadSlot(f"DRAM slot {slot} already holds another block")

    @staticmethod
    def _check_unpinned(b: Block[NsT]) -> None:
        if b.pins:
            raise PinnedBlock(f"block {short(b.key)} is pinned")

    @staticmethod
    def _check_closure(parent: Block[NsT] | None) -> None:
        if parent is not None and not parent.flags & ON_SSD:
            raise MissingParent(
                f"parent {short(parent.key)} is not on SSD; SSD holds whole prefixes")

    # ---------------------------------------------------------------- mutations
    def _add(self, b: Block[NsT], tier: Tier, slot: int | None) -> None:
        b.flags |= 1 << tier
        self._count[tier] += 1
        if tier is _SSD:
            self._ssd_writes += 1
        if slot is not None:
            b.flags |= (slot + 1) << SLOT_SHIFT
            self._slot_used[slot] = 2 if b.pins else 1
        self._requeue(b)
        if self._journal is not None:
            p = b.parent
            self._journal.append(Change(_ADD, b.ns, b.key, tier, slot,
                                        None if p is None else p.key))

    def _drop(self, b: Block[NsT], tier: Tier, out: list[Evicted[NsT]] | None, *,
              written_back: bool = False, count: bool = True) -> None:
        """Drop `b`'s copy in `tier`; appends what happened to `out` unless it is None."""
        f = b.flags
        slot = None
        if tier is _DRAM:
            s = f >> SLOT_SHIFT
            if s:
                slot = s - 1
                self._slot_used[slot] = 0
                f &= FLAG_BITS
            f &= ~IN_DRAM
        else:
            f &= ~ON_SSD
        b.flags = f
        self._count[tier] -= 1
        if f & STORED:
            if tier is _SSD:
                reason, name = _COPY_DROPPED, "ssd_copy_dropped"
            elif written_back:
                reason, name = _WRITTEN_BACK, "dram_written_back"
            else:
                reason, name = _DEMOTED, "dram_demoted"
            self._requeue(b)
        else:
            reason = _DROPPED
            name = "dram_dropped" if tier is _DRAM else "ssd_dropped"
            self._unlink(b)
        if count:
            self._evictions[name] += 1
        if self._journal is not None:
            self._journal.append(Change(_DROP, b.ns, b.key, tier, slot))
        if out is not None:
            out.append(Evicted(b.ns, b.key, tier, reason, slot))

    def _unlink(self, b: Block[NsT]) -> None:
        """Remove an entry that left its last tier (a leaf); its access count goes to history."""
        self._requeue(b)
        if b.hbm:
            self._hbm_blocks -= 1
        m = self._maps[b.ns]
        del m[b.key]
        if not m:
            del self._maps[b.ns]
        self._entries -= 1
        self.history.remember(b.ns, b.key, b.stamp & HITS_MAX)
        if self._hooks:
            self._policy.unlinked(b)
        p = b.parent
        if p is not None:
            p.children -= 1
            if not p.children:
                self._requeue(p)
        if self._doomed:
            self._doomed.discard(b)
            if p is not None and not p.children and p in self._doomed:
                self._reap_due = True

    def _requeue(self, b: Block[NsT]) -> None:
        """Put `b` in the queue its state calls for (none, DRAM's or SSD's); O(1)."""
        f = b.flags
        want = 0
        if not b.pins:
            if f & IN_DRAM:
                if f & ON_SSD or not b.children:
                    want = Q_DRAM
            elif f & ON_SSD and not b.children:
                want = Q_SSD
        have = f & QUEUED
        if have == want:
            return
        if have == Q_DRAM:
            self._qd.discard(b)
        elif have:
            self._qs.discard(b)
        b.flags = b.flags & ~QUEUED | want
        if want:
            q = self._qd if want == Q_DRAM else self._qs
            head = q.first()
            q.push(b, head is not None and b.stamp >> HITS_BITS <= head.stamp >> HITS_BITS)
