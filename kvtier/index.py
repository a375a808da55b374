"""The prefix index: which blocks are cached, in which tiers, who pins them, what to evict next.

Pure bookkeeping — no I/O, no tensors, no protobuf, no threads. Entries are keyed by
``(tenant, key)``: the tenant is a small int or str chosen by the server after authentication, the
key the block key of `kvtier.hashing` (opaque bytes here). One `Block` per entry.

Residency. An entry exists exactly while the daemon *stores* the block: in a DRAM slot, on SSD,
or both (promotion keeps the SSD copy, so a later DRAM eviction of that block is a free demotion).
HBM is the engines' memory: replicas report what they hold (`hbm_add`/`hbm_drop`) and the index
keeps that as a per-replica bit mask on stored entries, for lookups and statistics; it never
evicts HBM, and HBM never keeps an entry alive.

Invariants (checked by tests/test_index_props.py after every step):

1. No stranded block: every entry's parent is an entry of the same tenant (or it is a root).
   A chain can only hit from its first block, so a block under a missing parent is dead weight.
   Hence a block leaves its *last* tier only as a leaf (``children == 0``), and the block that
   leaves DRAM while it has an SSD copy (demotion) keeps its children reachable.
2. SSD is prefix-closed: a block gets an SSD copy only if it is a root or its parent is on SSD.
   So the SSD tier alone always serves whole prefixes and, after a daemon crash (DRAM lost), holds
   no stranded block; and a DRAM-only block only has DRAM-only descendants, so DRAM always has a
   leaf or a demotable block to evict unless everything is pinned.
3. A pinned block (``pins > 0``) is never evicted, dropped, demoted or removed.
4. ``blocks(tier) <= capacity(tier)``; an insert/promotion into a full tier raises `TierFull`
   and changes nothing — the caller evicts first.
5. Counters (`stats`) equal a recount at every step.

Eviction structure. Each managed tier has one eviction queue (a `kvtier.policies` strategy over
intrusive links in the blocks) holding exactly the blocks that may leave that tier now:

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

Access statistics: `hits` counts accesses (the commit is the first, each lookup hit adds one);
`last` is the index's logical clock at the last access (one tick per public call). Admission
history: when an entry leaves its last tier (eviction, drop, remove), its `hits` go to a
fixed-size `kvtier.policies.AdmissionHistory`; an insert of the same (tenant, key) while the
history still remembers it starts at that count + 1, so a block reused at a distance larger than
DRAM can still reach the k-th access that admits it to SSD. The history holds no key and never
grows (4 bytes a word, one word per block of DRAM + SSD capacity by default).

Exceptions are `IndexStateError` subclasses; a call that raises has changed nothing.
Threading: not thread-safe; the owner serialises calls (the daemon holds one lock around it).
Block objects returned are live views: read them, never write them, and don't keep them across
calls that may remove the entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtier.index_types import (
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
    DuplicateBlock,
    Evicted,
    IndexStateError,
    IndexStats,
    MissingParent,
    NotEvictable,
    PinnedBlock,
    Prefix,
    Reason,
    Tenant,
    TierFull,
    UnknownBlock,
)
from kvtier.policies import AdmissionHistory, EvictionQueue, KthAccess, make_queue
from kvtier.types import BlockKey, Tier

__all__ = [
    "ADMISSION_HISTORY_PER_BLOCK", "EVICTION_COUNTERS", "BadSlot", "Block", "DuplicateBlock",
    "Evicted", "IndexStateError", "IndexStats", "MissingParent", "NotEvictable", "PinnedBlock",
    "Prefix", "PrefixIndex", "Reason", "Tenant", "TierFull", "UnknownBlock",
]


ADMISSION_HISTORY_PER_BLOCK = 1
"""Default admission-history words per block of total capacity (DRAM + SSD); see `PrefixIndex`."""

# Module constants: an enum member lookup (`Tier.SSD`) costs ~0.1 us on Python 3.11.
_HBM, _DRAM, _SSD = Tier.HBM, Tier.DRAM, Tier.SSD
_DEMOTED, _WRITTEN_BACK, _WRITTEN, _COPY_DROPPED, _DROPPED = (
    Reason.DEMOTED, Reason.WRITTEN_BACK, Reason.WRITTEN, Reason.COPY_DROPPED, Reason.DROPPED)


class PrefixIndex:
    """Prefix index over DRAM and SSD with HBM annotations (contract in the module docstring).

    `dram_blocks`/`ssd_blocks`: tier capacities in blocks (None = unbounded). DRAM slot ids, when
    used, are validated against ``range(dram_blocks)`` and must be unique. `block_bytes`: the
    fixed size of one block, for byte accounting. `policy`: a `kvtier.policies.POLICIES` name.
    `admission_k`: SSD admission on the k-th access. `admission_history`: words of the
    `kvtier.policies.AdmissionHistory` that keeps the access counts of dropped blocks (4 bytes
    each; 0 = off, a reinserted block starts again at 1); None = `ADMISSION_HISTORY_PER_BLOCK` x
    (dram_blocks + ssd_blocks) when both are bounded and ssd_blocks > 0, else 0.
    """

    def __init__(
        self,
        *,
        dram_blocks: int | None = None,
        ssd_blocks: int | None = None,
        block_bytes: int | None = None,
        policy: str = "lru",
        admission_k: int = 2,
        admission_history: int | None = None,
    ) -> None:
        for name, cap in (("dram_blocks", dram_blocks), ("ssd_blocks", ssd_blocks)):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0, got {cap}")
        self._cap = {_DRAM: dram_blocks, _SSD: ssd_blocks}
        self._count = {_DRAM: 0, _SSD: 0}
        self._qd = make_queue(policy)
        self._qs = make_queue(policy)
        self._queue: dict[Tier, EvictionQueue] = {_DRAM: self._qd, _SSD: self._qs}
        self.policy = policy
        self.admission = KthAccess(admission_k)
        if admission_history is None:
            admission_history = (
                ADMISSION_HISTORY_PER_BLOCK * (dram_blocks + ssd_blocks)
                if dram_blocks is not None and ssd_blocks else 0)
        self.history = AdmissionHistory(admission_history)
        self.block_bytes = block_bytes
        self._slot_used = bytearray(dram_blocks or 0)
        self._maps: dict[Tenant, dict[BlockKey, Block]] = {}
        self._replicas: dict[str | int, int] = {}
        self._clock = 0
        self._entries = 0
        self._hbm_blocks = 0
        self._pinned = 0
        self._pins = 0
        self._ssd_writes = 0
        self._evictions = dict.fromkeys(EVICTION_COUNTERS, 0)

    # ---------------------------------------------------------------- queries
    def get(self, tenant: Tenant, key: BlockKey) -> Block | None:
        m = self._maps.get(tenant)
        return None if m is None else m.get(key)

    def __len__(self) -> int:
        return self._entries

    def iter_blocks(self) -> Iterator[Block]:
        """Every entry, tenant by tenant, parents before children. O(entries): for audits,
        statistics and snapshots, not for the request path; don't mutate while iterating."""
        for m in self._maps.values():
            yield from m.values()

    def capacity(self, tier: Tier) -> int | None:
        return self._cap[tier]

    def blocks(self, tier: Tier) -> int:
        return self._hbm_blocks if tier is _HBM else self._count[tier]

    def bytes_in(self, tier: Tier) -> int | None:
        """Bytes held in a managed tier: blocks x `block_bytes` (None without a block size)."""
        return None if self.block_bytes is None else self._count[tier] * self.block_bytes

    def free(self, tier: Tier) -> int | None:
        """Blocks that fit into `tier` without evicting (None = unbounded)."""
        cap = self._cap[tier]
        return None if cap is None else cap - self._count[tier]

    def lookup(
        self,
        tenant: Tenant,
        keys: Sequence[BlockKey],
        *,
        replica: str | int | None = None,
        touch: bool = True,
    ) -> Prefix:
        """Longest cached prefix of the chain `keys` (keys[0] a root, each next key's parent the
        previous one; the walk stops at the first key not cached *as that chain's next block*).

        Best tier per block: HBM if `replica` holds it (any replica when `replica` is None),
        else DRAM, else SSD. With `touch`, each hit block counts an access (hits, last, and its
        eviction-queue position). O(len(prefix)).
        """
        blocks: list[Block] = []
        m = self._maps.get(tenant)
        if m is None:
            return Prefix(blocks, [])
        get, add = m.get, blocks.append
        parent = None
        for key in keys:
            b = get(key)
            if b is None or b.parent is not parent:
                break
            add(b)
            parent = b
        if replica is None:
            mask = -1
        else:
            bit = self._replicas.get(replica)
            mask = 0 if bit is None else 1 << bit
        hbm, dram, ssd = _HBM, _DRAM, _SSD
        tiers = [hbm if b.hbm & mask else dram if b.flags & IN_DRAM else ssd for b in blocks]
        if touch and blocks:
            self._clock += 1
            now = self._clock << HITS_BITS
            qd, qs = self._qd, self._qs
            for b in blocks:
                hits = (b.stamp & HITS_MAX) + 1
                b.stamp = now | (hits if hits < HITS_MAX else HITS_MAX)
                f = b.flags
                if f & Q_DRAM:
                    qd.touch(b)
                elif f & Q_SSD:
                    qs.touch(b)
        return Prefix(blocks, tiers)

    # ---------------------------------------------------------------- commit
    def insert(
        self,
        tenant: Tenant,
        key: BlockKey,
        parent: BlockKey | None,
        tier: Tier = _DRAM,
        *,
        dram_slot: int | None = None,
    ) -> Block:
        """Record a committed block stored in `tier` (DRAM or SSD) under `parent` (None = root).

        Raises DuplicateBlock if (tenant, key) is cached (one payload per key: the caller frees
        its copy), MissingParent if `parent` is not cached, TierFull, BadSlot.
        """
        if not isinstance(key, bytes) or not key:
            raise TypeError("a block key is non-empty bytes")
        if tier is _HBM:
            raise ValueError("HBM residency is reported with hbm_add, not inserted")
        m = self._maps.get(tenant)
        if m is not None and key in m:
            raise DuplicateBlock(f"block {key.hex()[:16]} of tenant {tenant!r} is already cached")
        p = None
        if parent is not None:
            p = None if m is None else m.get(parent)
            if p is None:
                raise MissingParent(f"parent {parent.hex()[:16]} is not cached; insert it first")
        self._check_room(tier, dram_slot)
        if tier is _SSD:
            self._check_closure(p)
        if m is None:
            m = self._maps[tenant] = {}
        self._clock += 1
        hits = 1 + self.history.recall(tenant, key) if self.history.entries else 1
        b = Block(key, tenant, p, stamp=self._clock << HITS_BITS | hits)
        m[key] = b
        self._entries += 1
        if p is not None:
            p.children += 1
            self._requeue(p)
        self._add(b, tier, dram_slot)
        return b

    def add_tier(self, tenant: Tenant, key: BlockKey, tier: Tier, *,
                 dram_slot: int | None = None) -> Block:
        """A copy of a cached block now also lives in `tier`: promotion SSD -> DRAM (with its
        slot), or a completed write-back DRAM -> SSD. Raises if already there, TierFull, BadSlot.
        """
        b = self._need(tenant, key)
        if tier is _HBM:
            raise ValueError("HBM residency is reported with hbm_add")
        if b.flags & (1 << tier):
            raise DuplicateBlock(f"block {key.hex()[:16]} is already in {tier.label}")
        self._check_room(tier, dram_slot)
        if tier is _SSD:
            self._check_closure(b.parent)
        self._add(b, tier, dram_slot)
        return b

    promote = add_tier

    def demote(self, tenant: Tenant, key: BlockKey) -> Evicted:
        """DRAM -> SSD bookkeeping once the bytes are on SSD: adds the SSD copy if missing and
        drops the DRAM copy; children stay reachable. Raises PinnedBlock, TierFull."""
        b = self._need(tenant, key)
        if not b.flags & IN_DRAM:
            raise UnknownBlock(f"block {key.hex()[:16]} is not in dram")
        if b.pins:
            raise PinnedBlock(f"block {key.hex()[:16]} is pinned")
        written = not b.flags & ON_SSD
        if written:
            self._check_room(_SSD, None)
            self._check_closure(b.parent)
            self._add(b, _SSD, None)
        out: list[Evicted] = []
        self._drop(b, _DRAM, out, written_back=written)
        return out[0]

    def drop(self, tenant: Tenant, key: BlockKey, tier: Tier) -> Evicted:
        """Drop the copy in `tier`. Raises PinnedBlock; NotEvictable when the block has children
        and the copy is its last, or is an SSD copy (a child may need it: SSD prefix closure)."""
        b = self._need(tenant, key)
        if tier is _HBM or not b.flags & (1 << tier):
            raise UnknownBlock(f"block {key.hex()[:16]} is not in {tier.label}")
        if b.pins:
            raise PinnedBlock(f"block {key.hex()[:16]} is pinned")
        if b.children and (tier is _SSD or not b.flags & ON_SSD):
            raise NotEvictable(f"block {key.hex()[:16]} has {b.children} cached children")
        out: list[Evicted] = []
        self._drop(b, tier, out)
        return out[0]

    def remove(self, tenant: Tenant, key: BlockKey) -> list[Evicted]:
        """Remove a leaf block from every tier (e.g. its SSD copy failed verification)."""
        b = self._need(tenant, key)
        if b.pins:
            raise PinnedBlock(f"block {key.hex()[:16]} is pinned")
        if b.children:
            raise NotEvictable(f"block {key.hex()[:16]} has {b.children} cached children")
        out: list[Evicted] = []
        if b.flags & ON_SSD and b.flags & IN_DRAM:
            self._drop(b, _SSD, out, count=False)
        self._drop(b, _DRAM if b.flags & IN_DRAM else _SSD, out, count=False)
        self._evictions["removed"] += 1
        return out

    def remove_subtree(self, tenant: Tenant, key: BlockKey) -> list[Evicted]:
        """Remove a block and every cached descendant (e.g. its only copy failed verification,
        so the whole subtree can never hit again). Children before parents in the result.

        O(entries of the tenant) — one pass, since entries iterate parents before children;
        for rare events, never the request path. Raises PinnedBlock (nothing removed) if any
        block of the subtree is pinned."""
        top = self._need(tenant, key)
        doomed = [top]
        inside = {id(top)}
        for b in self._maps[tenant].values():
            if b.parent is not None and id(b.parent) in inside and id(b) not in inside:
                inside.add(id(b))
                doomed.append(b)
        pinned = next((b for b in doomed if b.pins), None)
        if pinned is not None:
            raise PinnedBlock(f"block {pinned.key.hex()[:16]} of the subtree is pinned")
        out: list[Evicted] = []
        for b in reversed(doomed):
            out.extend(self.remove(tenant, b.key))
        return out

    # ---------------------------------------------------------------- leases
    def pin(self, tenant: Tenant, key: BlockKey) -> Block:
        """Take one lease: the block cannot leave any tier until the matching `unpin`."""
        b = self._need(tenant, key)
        b.pins += 1
        self._pins += 1
        if b.pins == 1:
            self._pinned += 1
            self._requeue(b)
        return b

    def unpin(self, tenant: Tenant, key: BlockKey) -> Block:
        b = self._need(tenant, key)
        if not b.pins:
            raise IndexStateError(f"block {key.hex()[:16]} is not pinned")
        b.pins -= 1
        self._pins -= 1
        if not b.pins:
            self._pinned -= 1
            self._requeue(b)
        return b

    # ---------------------------------------------------------------- HBM reports
    def hbm_add(self, replica: str | int, tenant: Tenant, key: BlockKey) -> bool:
        """Replica reports holding the block in HBM. False (ignored) if the block is not cached."""
        b = self.get(tenant, key)
        if b is None:
            return False
        bit = self._replicas.get(replica)
        if bit is None:
            used = set(self._replicas.values())
            bit = self._replicas[replica] = next(i for i in range(len(used) + 1) if i not in used)
        if not b.hbm:
            self._hbm_blocks += 1
        b.hbm |= 1 << bit
        return True

    def hbm_drop(self, replica: str | int, tenant: Tenant, key: BlockKey) -> bool:
        b = self.get(tenant, key)
        bit = self._replicas.get(replica)
        if b is None or bit is None or not b.hbm >> bit & 1:
            return False
        b.hbm &= ~(1 << bit)
        if not b.hbm:
            self._hbm_blocks -= 1
        return True

    def drop_replica(self, replica: str | int) -> int:
        """Forget a replica (it restarted or left): O(entries), not for the hot path."""
        bit = self._replicas.pop(replica, None)
        if bit is None:
            return 0
        n = 0
        for m in self._maps.values():
            for b in m.values():
                if b.hbm >> bit & 1:
                    b.hbm &= ~(1 << bit)
                    n += 1
                    if not b.hbm:
                        self._hbm_blocks -= 1
        return n

    # ---------------------------------------------------------------- eviction
    def victims(self, tier: Tier, n: int) -> list[Block]:
        """Up to `n` blocks that may leave `tier` now, coldest first; changes nothing. Each stays
        evictable until a call changes that block (pin, insert of a child, a drop)."""
        out: list[Block] = []
        if n <= 0:
            return out
        for b in self._queue_of(tier):
            out.append(b)
            if len(out) == n:
                break
        return out

    def evict(self, tier: Tier, n: int, *, write_back: bool = False) -> list[Evicted]:
        """Evict up to `n` blocks from `tier` (fewer if fewer are evictable), coldest first.

        With `write_back` (DRAM only), a DRAM-only victim that the admission rule admits goes to
        SSD (WRITTEN_BACK) together with its DRAM-only ancestors (WRITTEN, they stay in DRAM) to
        keep SSD prefix-closed, evicting SSD leaves for room; without room it is DROPPED. The
        result lists every change including those SSD evictions, in order. Meant for synchronous
        callers (the simulator); the mover uses `victims` + `add_tier`/`demote`.
        """
        out: list[Evicted] = []
        self._evict(self._queue_of(tier), tier, n, write_back, out)
        return out

    def evict_count(self, tier: Tier, n: int, *, write_back: bool = False) -> int:
        """`evict` for callers that only need the counters (`stats`): the same changes, but
        returns only how many blocks left `tier` as victims, building no `Evicted` records."""
        return self._evict(self._queue_of(tier), tier, n, write_back, None)

    def _evict(self, q: EvictionQueue, tier: Tier, n: int, write_back: bool,
               out: list[Evicted] | None) -> int:
        done = 0
        write_back = write_back and tier is _DRAM
        admits = self.admission.admits
        while done < n:
            b = q.first()
            if b is None:
                break
            done += 1
            if (write_back and not b.flags & ON_SSD and admits(b)
                    and self._write_chain(b, out)):
                self._drop(b, tier, out, written_back=True)
            else:
                self._drop(b, tier, out)
        return done

    def _write_chain(self, b: Block, out: list[Evicted] | None) -> bool:
        chain = [b]
        p = b.parent
        while p is not None and not p.flags & ON_SSD:
            chain.append(p)
            p = p.parent
        cap = self._cap[_SSD]
        if cap is not None:
            free = cap - self._count[_SSD]
            if free < len(chain):
                if free + len(self._qs) < len(chain):
                    return False
                self._evict(self._qs, _SSD, len(chain) - free, False, out)
        for c in reversed(chain):
            self._add(c, _SSD, None)
            if c is not b and out is not None:
                out.append(Evicted(c.tenant, c.key, _SSD, _WRITTEN, c.dram_slot))
        return True

    def admits(self, b: Block) -> bool:
        """The SSD admission rule (k-th access)."""
        return self.admission.admits(b)

    def stats(self) -> IndexStats:
        return IndexStats(
            entries=self._entries,
            dram_blocks=self._count[_DRAM],
            ssd_blocks=self._count[_SSD],
            hbm_blocks=self._hbm_blocks,
            pinned_blocks=self._pinned,
            pins=self._pins,
            evictable_dram=len(self._queue[_DRAM]),
            evictable_ssd=len(self._queue[_SSD]),
            dram_capacity=self._cap[_DRAM],
            ssd_capacity=self._cap[_SSD],
            block_bytes=self.block_bytes,
            ssd_writes=self._ssd_writes,
            evictions=dict(self._evictions),
            history_size=self.history.size,
            history_entries=self.history.entries,
            history_recalled=self.history.recalled,
        )

    # ---------------------------------------------------------------- internals
    def _queue_of(self, tier: Tier) -> EvictionQueue:
        q = self._queue.get(tier)
        if q is None:
            raise ValueError(f"{tier.label} is not managed by the index (HBM belongs to engines)")
        return q

    def _need(self, tenant: Tenant, key: BlockKey) -> Block:
        b = self.get(tenant, key)
        if b is None:
            shown = key.hex()[:16] if isinstance(key, bytes) else repr(key)
            raise UnknownBlock(f"block {shown} of tenant {tenant!r} is not cached")
        return b

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

    def _check_closure(self, parent: Block | None) -> None:
        if parent is not None and not parent.flags & ON_SSD:
            raise MissingParent(
                f"parent {parent.key.hex()[:16]} is not on SSD; SSD holds whole prefixes")

    def _add(self, b: Block, tier: Tier, slot: int | None) -> None:
        b.flags |= 1 << tier
        self._count[tier] += 1
        if tier is _SSD:
            self._ssd_writes += 1
        if slot is not None:
            b.flags |= (slot + 1) << SLOT_SHIFT
            self._slot_used[slot] = 1
        self._requeue(b)

    def _drop(self, b: Block, tier: Tier, out: list[Evicted] | None, *,
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
        if out is not None:
            out.append(Evicted(b.tenant, b.key, tier, reason, slot))

    def _unlink(self, b: Block) -> None:
        """Remove an entry that left its last tier (a leaf); its access count goes to history."""
        self._requeue(b)
        if b.hbm:
            self._hbm_blocks -= 1
        m = self._maps[b.tenant]
        del m[b.key]
        if not m:
            del self._maps[b.tenant]
        self._entries -= 1
        self.history.remember(b.tenant, b.key, b.stamp & HITS_MAX)
        p = b.parent
        if p is not None:
            p.children -= 1
            if not p.children:
                self._requeue(p)

    def _requeue(self, b: Block) -> None:
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
