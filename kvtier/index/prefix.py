"""The prefix index: which blocks are cached, in which tiers, who pins them, what to evict next.

Pure bookkeeping — no I/O, no tensors, no protobuf, no threads. Entries are keyed by
``(ns, key)``: the namespace (`ns`, of the type the index is instantiated with: the daemon's
`Namespace`, chosen by the server after authentication, or the simulator's int; see
`kvtier.index.types`), and the block key of `kvtier.core.keys` (opaque bytes here). One `Block`
per entry.

Residency. An entry exists exactly while the daemon *stores* the block: in a DRAM slot, on SSD,
or both (promotion keeps the SSD copy, so a later DRAM eviction of that block is a free demotion).
HBM is the engines' memory: replicas report what they hold (`hbm_add`/`hbm_drop`) and the index
keeps that as a per-replica bit mask on stored entries, for lookups and statistics; it never
evicts HBM, and HBM never keeps an entry alive.

Invariants (checked by tests/test_index_props.py after every step):

1. No stranded block: every entry's parent is an entry of the same namespace (or it is a root).
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

Eviction structure: one queue per managed tier holds exactly the blocks that may leave it now, so
a victim is a queue's cold end, never a scan (`kvtier.index.state`); `kvtier.index.evict` picks
and evicts victims (demotion or leaf-first drop, never a write); `kvtier.index.placement` decides
write-backs and room for the daemon and the simulator alike.

Access statistics: `hits` counts accesses (the commit is the first, each lookup hit adds one);
`last` is the index's logical clock at the last access (one tick per insert and per touching
lookup that hits). Admission
history: when an entry leaves its last tier (eviction, drop, remove), its `hits` go to a
fixed-size `kvtier.index.policies.AdmissionHistory`; an insert of the same (ns, key) while the
history still remembers it starts at that count + 1, so a block reused at a distance larger than
DRAM can still reach the k-th access that admits it to SSD. The history holds no key and never
grows (4 bytes a word, one word per block of DRAM + SSD capacity by default).

Journal: with ``journal=True`` every copy added to or dropped from a tier and every DRAM slot move
is a `Change`, whichever call made it; `take_changes` hands them out oldest first. The owner acts
on them in one place (the daemon's applier) instead of after each call.

Exceptions are `IndexStateError` subclasses; a call that raises has changed nothing (and journals
nothing).
Threading: not thread-safe; the owner serialises calls (the daemon holds one lock around it).
Block objects returned are live views: read them, never write them, and don't keep them across
calls that may remove the entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, itemgetter
from typing import cast

from kvtier.core.types import BlockKey, Tier
from kvtier.index.evict import Eviction
from kvtier.index.hbm import HbmReports
from kvtier.index.history import ADMISSION_HISTORY_PER_BLOCK
from kvtier.index.purge import Purge, Purged
from kvtier.index.state import short
from kvtier.index.types import (
    EVICTION_COUNTERS,
    FLAG_BITS,
    HITS_BITS,
    HITS_MAX,
    IN_DRAM,
    ON_SSD,
    Q_DRAM,
    Q_SSD,
    SLOT_SHIFT,
    BadSlot,
    Block,
    Change,
    Drops,
    DuplicateBlock,
    Evicted,
    IndexStateError,
    IndexStats,
    MissingParent,
    NotEvictable,
    Ns,
    NsT,
    Op,
    PinnedBlock,
    Prefix,
    Reason,
    TierFull,
    UnknownBlock,
)

__all__ = [
    "ADMISSION_HISTORY_PER_BLOCK", "EVICTION_COUNTERS", "BadSlot", "Block", "Change", "Drops",
    "DuplicateBlock", "Evicted", "IndexStateError", "IndexStats", "MissingParent",
    "NotEvictable", "Ns", "NsT", "Op", "PinnedBlock",
    "Prefix", "PrefixIndex", "Purged", "Reason", "TierFull", "UnknownBlock",
]

# Module constants: an enum member lookup (`Tier.SSD`) costs ~0.1 us on Python 3.11.
_HBM, _DRAM, _SSD = Tier.HBM, Tier.DRAM, Tier.SSD
_PARENT = attrgetter("parent")


def _walk(m: dict[BlockKey, Block[NsT]], keys: Sequence[BlockKey]) -> list[Block[NsT]]:
    """The blocks of the longest prefix of `keys` cached as one chain (keys[0] cached as a
    root): each key's block whose parent is the previous key's block. When the last key is
    cached (a full hit, most likely) the dict look-ups, the parents and the check are C loops
    (`map`, list equality by identity); otherwise, or when the chain breaks at a cached key
    under another parent, one key at a time up to the first miss."""
    if m.get(keys[-1]) is not None:
        found = list(map(m.get, keys))
        try:
            parents = list(map(_PARENT, found))
        except AttributeError:  # a key not cached in between
            parents = None
        if parents is not None and parents[1:] == found[:-1]:  # Blocks compare by identity
            return cast("list[Block[NsT]]", found)
    blocks: list[Block[NsT]] = []
    get, add = m.get, blocks.append
    parent = None
    for key in keys:
        b = get(key)
        if b is None or b.parent is not parent:
            break
        add(b)
        parent = b
    return blocks


class PrefixIndex(Eviction[NsT], HbmReports[NsT], Purge[NsT]):
    """Prefix index over DRAM and SSD with HBM annotations (contract in the module docstring).

    `dram_blocks`/`ssd_blocks`: tier capacities in blocks (None = unbounded). DRAM slot ids, when
    used, are validated against ``range(dram_blocks)`` and must be unique. `block_bytes`: the
    fixed size of one block, for byte accounting. `policy`: a
    `kvtier.index.policies.POLICIES` name (eviction order, DRAM admission via `admit`, SSD
    admission). `admission_k`: SSD admission on the k-th access. `admission_history`: words of the
    `kvtier.index.policies.AdmissionHistory` that keeps the access counts of dropped blocks (4 bytes
    each; 0 = off, a reinserted block starts again at 1); None = `ADMISSION_HISTORY_PER_BLOCK` x
    (dram_blocks + ssd_blocks) when both are bounded and ssd_blocks > 0 or the policy reads
    ghosts (`Policy.ghosts`: vllm-arc, lmcache-s3fifo, kvtier), else 0. `journal`: keep the
    journal of residency changes that `take_changes` hands out (`kvtier.index.state`).

    Queries, `stats` and the constructor: `kvtier.index.state.IndexState`; `victims`, `evict`,
    `evict_count`, `admits`: `kvtier.index.evict`; `hbm_add`, `hbm_drop`, `drop_replica`:
    `kvtier.index.hbm`. Here: lookup, commit, residency changes and leases.
    """

    # ---------------------------------------------------------------- lookup
    def lookup(
        self,
        ns: NsT,
        keys: Sequence[BlockKey],
        *,
        replica: str | int | None = None,
        touch: bool = True,
    ) -> Prefix[NsT]:
        """Longest cached prefix of the chain `keys` (keys[0] a root, each next key's parent the
        previous one; the walk stops at the first key not cached *as that chain's next block*).

        Best tier per block: HBM if `replica` holds it (any replica when `replica` is None),
        else DRAM, else SSD. With `touch`, each hit block counts an access (hits, last, and its
        eviction-queue position). O(len(prefix)).
        """
        m = self._maps.get(ns)
        if m is None or not keys or (first := m.get(keys[0])) is None or first.parent is not None:
            blocks: list[Block[NsT]] = []
            if touch and self._hooks:
                self._policy.looked_up(ns, keys, blocks)
            return Prefix(blocks, [])
        blocks = _walk(m, keys)
        if self._doomed:  # a purge's pinned leftovers: never found again
            doomed = self._doomed
            cut = next((i for i, b in enumerate(blocks) if b in doomed), None)
            if cut is not None:
                del blocks[cut:]
        if replica is None:
            mask = -1
        else:
            bit = self._replicas.get(replica)
            mask = 0 if bit is None else 1 << bit
        hbm, dram, ssd = _HBM, _DRAM, _SSD
        if mask:
            tiers = [hbm if b.hbm & mask else dram if b.flags & IN_DRAM else ssd for b in blocks]
        elif self._count[dram] == self._entries:  # every entry is in DRAM: no check per block
            tiers = [dram] * len(blocks)
        else:
            tiers = [dram if b.flags & IN_DRAM else ssd for b in blocks]
        if touch and self._hooks:
            self._policy.looked_up(ns, keys, blocks)
        if touch:
            self._clock += 1
            now = self._clock << HITS_BITS
            qd, qs = self._qd, self._qs
            mark = self._policy.mark if self._marks else None
            for b in blocks:
                hits = (b.stamp & HITS_MAX) + 1
                b.stamp = now | (hits if hits < HITS_MAX else HITS_MAX)
                f = b.flags
                if f & Q_DRAM:
                    qd.touch(b)
                elif f & Q_SSD:
                    qs.touch(b)
                elif mark is not None:
                    mark(b)
        return Prefix(blocks, tiers)

    # ---------------------------------------------------------------- commit
    def admit(self, ns: NsT, keys: Sequence[BlockKey], start: int, *,
              partial_last: bool = False) -> int:
        """DRAM admission: how many blocks of ``keys[start:]`` — the part of a looked-up chain
        that missed, ``keys[:start]`` being cached — the caller should store, from the first
        (storing fewer strands nothing: the rest is a suffix). `partial_last`: the last block
        holds fewer tokens than a full one. Asks the policy (`kvtier.index.policies.Policy.admit`);
        changes nothing but the policy's own statistics. O(len(keys) - start)."""
        if not 0 <= start <= len(keys):
            raise ValueError(f"start {start} is outside the chain (0..{len(keys)})")
        parent = None
        if start:
            parent = self.get(ns, keys[start - 1])
            if parent is None:
                raise MissingParent(f"block {short(keys[start - 1])} is not cached")
        return self._policy.admit(ns, keys, start, parent, partial_last)

    def insert(
        self,
        ns: NsT,
        key: BlockKey,
        parent: BlockKey | None,
        tier: Tier = _DRAM,
        *,
        dram_slot: int | None = None,
    ) -> Block[NsT]:
        """Record a committed block stored in `tier` (DRAM or SSD) under `parent` (None = root).

        Raises DuplicateBlock if (ns, key) is cached (one payload per key: the caller frees
        its copy), MissingParent if `parent` is not cached, TierFull, BadSlot.
        """
        if not isinstance(key, bytes) or not key:
            raise TypeError("a block key is non-empty bytes")
        if tier is _HBM:
            raise ValueError("HBM residency is reported with hbm_add, not inserted")
        m = self._maps.get(ns)
        if m is not None and key in m:
            raise DuplicateBlock(f"block {short(key)} in namespace {ns!r} is already cached")
        p = None
        if parent is not None:
            p = None if m is None else m.get(parent)
            if p is None:
                raise MissingParent(f"parent {short(parent)} is not cached; insert it first")
        self._check_room(tier, dram_slot)
        if tier is _SSD:
            self._check_closure(p)
        if m is None:
            m = self._maps[ns] = {}
        self._clock += 1
        hits = 1 + self.history.recall(ns, key) if self.history.entries else 1
        b = Block(key, ns, p, stamp=self._clock << HITS_BITS | hits)
        if self._hooks:
            self._policy.inserted(b)
        m[key] = b
        self._entries += 1
        if p is not None:
            p.children += 1
            self._requeue(p)
            if self._doomed and p in self._doomed:
                self._doomed.add(b)  # under a purged block: it goes with it
        self._add(b, tier, dram_slot)
        return b

    def add_tier(self, ns: NsT, key: BlockKey, tier: Tier, *,
                 dram_slot: int | None = None) -> Block[NsT]:
        """A copy of a cached block now also lives in `tier`: promotion SSD -> DRAM (with its
        slot), or a completed write-back DRAM -> SSD. Raises if already there, TierFull, BadSlot.
        """
        b = self._need(ns, key)
        if tier is _HBM:
            raise ValueError("HBM residency is reported with hbm_add")
        if b.flags & (1 << tier):
            raise DuplicateBlock(f"block {short(key)} is already in {tier.label}")
        self._check_room(tier, dram_slot)
        if tier is _SSD:
            self._check_closure(b.parent)
        self._add(b, tier, dram_slot)
        return b

    promote = add_tier

    def demote(self, ns: NsT, key: BlockKey) -> Evicted[NsT]:
        """DRAM -> SSD bookkeeping once the bytes are on SSD: adds the SSD copy if missing and
        drops the DRAM copy; children stay reachable. Raises PinnedBlock, TierFull."""
        b = self._need(ns, key)
        if not b.flags & IN_DRAM:
            raise UnknownBlock(f"block {short(key)} is not in dram")
        self._check_unpinned(b)
        written = not b.flags & ON_SSD
        if written:
            self._check_room(_SSD, None)
            self._check_closure(b.parent)
            self._add(b, _SSD, None)
        out: list[Evicted[NsT]] = []
        self._drop(b, _DRAM, out, written_back=written)
        return out[0]

    def drop(self, ns: NsT, key: BlockKey, tier: Tier) -> Evicted[NsT]:
        """Drop the copy in `tier`. Raises PinnedBlock; NotEvictable when the block has children
        and the copy is its last, or is an SSD copy (a child may need it: SSD prefix closure)."""
        b = self._need(ns, key)
        if tier is _HBM or not b.flags & (1 << tier):
            raise UnknownBlock(f"block {short(key)} is not in {tier.label}")
        self._check_unpinned(b)
        if b.children and (tier is _SSD or not b.flags & ON_SSD):
            raise NotEvictable(f"block {short(key)} has {b.children} cached children")
        out: list[Evicted[NsT]] = []
        self._drop(b, tier, out)
        return out[0]

    def remove(self, ns: NsT, key: BlockKey) -> list[Evicted[NsT]]:
        """Remove a leaf block from every tier (e.g. its SSD copy failed verification)."""
        b = self._need(ns, key)
        self._check_unpinned(b)
        if b.children:
            raise NotEvictable(f"block {short(key)} has {b.children} cached children")
        out: list[Evicted[NsT]] = []
        for tier in (_SSD, _DRAM):
            if b.flags & (1 << tier):
                self._drop(b, tier, out, count=False)
        self._evictions["removed"] += 1
        return out

    def remove_subtree(self, ns: NsT, key: BlockKey) -> list[Evicted[NsT]]:
        """Remove a block and every cached descendant (e.g. its only copy failed verification,
        so the whole subtree can never hit again). Children before parents in the result.

        O(entries of the namespace) — one pass, since entries iterate parents before children;
        for rare events, never the request path. Raises PinnedBlock (nothing removed) if any
        block of the subtree is pinned."""
        top = self._need(ns, key)
        doomed = [top]
        inside = {top}
        for b in self._maps[ns].values():
            if b.parent in inside:
                inside.add(b)
                doomed.append(b)
        pinned = next((b for b in doomed if b.pins), None)
        if pinned is not None:
            raise PinnedBlock(f"block {short(pinned.key)} of the subtree is pinned")
        out: list[Evicted[NsT]] = []
        for b in reversed(doomed):
            out.extend(self.remove(ns, b.key))
        return out

    def move_dram(self, ns: NsT, key: BlockKey, slot: int) -> Block[NsT]:
        """Repoints an unpinned DRAM block at another free slot (the pool moved its bytes to
        free a page); residency, queue position and counters stay. Raises PinnedBlock,
        UnknownBlock, BadSlot."""
        b = self._need(ns, key)
        self._check_unpinned(b)
        old = b.dram_slot
        if old is None:
            raise BadSlot(f"block {short(key)} has no DRAM slot")
        if not 0 <= slot < len(self._slot_used) or self._slot_used[slot]:
            raise BadSlot(f"DRAM slot {slot!r} is outside the pool or holds another block")
        self._slot_used[old] = 0
        self._slot_used[slot] = 1
        b.flags = b.flags & FLAG_BITS | (slot + 1) << SLOT_SHIFT
        if self._journal is not None:
            self._journal.append(Change(Op.MOVE, ns, key, _DRAM, slot, None, old))
        return b

    # ---------------------------------------------------------------- leases
    def pin(self, ns: NsT, key: BlockKey) -> Block[NsT]:
        """Take one lease: the block cannot leave any tier until the matching `unpin`."""
        b = self._need(ns, key)
        b.pins += 1
        self._pins += 1
        if b.pins == 1:
            self._pinned += 1
            s = b.flags >> SLOT_SHIFT
            if s:
                self._slot_used[s - 1] = 2
            self._requeue(b)
        return b

    def unpin(self, ns: NsT, key: BlockKey) -> Block[NsT]:
        b = self._need(ns, key)
        if not b.pins:
            raise IndexStateError(f"block {short(key)} is not pinned")
        b.pins -= 1
        self._pins -= 1
        if not b.pins:
            self._pinned -= 1
            s = b.flags >> SLOT_SHIFT
            if s:
                self._slot_used[s - 1] = 1
            self._requeue(b)
            if self._doomed and b in self._doomed:
                self._reap_due = True
        return b

    def slot_pinned(self, slot: int) -> bool:
        """Whether DRAM slot `slot` holds a pinned block (the pins' one owner: the daemon's pool
        asks this, `kvtier.tiers.dram.PinOwner`)."""
        return 0 <= slot < len(self._slot_used) and self._slot_used[slot] == 2

    def any_pinned(self, slots: list[int]) -> bool:
        """`slot_pinned` of any of `slots` (every one in range), at C speed."""
        if len(slots) == 1:
            return self._slot_used[slots[0]] == 2
        return 2 in itemgetter(*slots)(self._slot_used) if slots else False

    @property
    def pinned_slots(self) -> int:
        """DRAM slots holding pinned blocks (counted when asked: a C-speed scan of one byte per
        slot, so pin and unpin stay as cheap as they were)."""
        return self._slot_used.count(2)
