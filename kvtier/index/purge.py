"""Removing blocks on purpose (an operator's evict or clear): a whole key space, or the blocks
under given keys, from every tier at once.

    select(ns, None)      every block of `ns` (one of the daemon's namespaces)
    select(ns, keys)      each given key's block and every block under it
    purge(ns, blocks)     removes the selection leaf-first from DRAM and SSD, journaled

A block some pin holds cannot go now (invariant 3), nor can its ancestors (invariant 2): they
stay *doomed*. A lookup stops before a doomed block, so nothing new pins it; a block committed
under one is doomed too; `reap` removes the doomed blocks that nothing pins and that have no
children left (leaf-first, each one's doomed parent after it), and `reap_due` says whether a pin
or a child went since the last `reap`. A doomed block that pressure evicts meanwhile simply goes.

Cost: `purge` is one pass over the selection with the removal inlined (no requeueing of a parent
that goes too, no admission history: an operator's removal says nothing about reuse); its
journal lists every DRAM drop, then every SSD drop, so the applier's events come as one
BlockRemoved per tier. `select` of a subtree is one pass over the namespace's entries (they iterate
parents before children). Pure, like the rest of the index; contract in `kvtier.index.prefix`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvtier.core.types import BlockKey, Tier
from kvtier.index.state import IndexState
from kvtier.index.types import (
    IN_DRAM,
    ON_SSD,
    Q_DRAM,
    QUEUED,
    SLOT_SHIFT,
    Block,
    Drops,
    NsT,
)

_DRAM, _SSD = Tier.DRAM, Tier.SSD


class Purged(NamedTuple):
    """What `purge` did: blocks removed, their DRAM and SSD copies, the keys removed, and the
    blocks left doomed (pinned, or above a pinned one)."""

    removed: int
    dram: int
    ssd: int
    keys: list[BlockKey]
    doomed: int


class Purge(IndexState[NsT]):
    """`select`, `purge`, `reap` over an `IndexState` (see the module docstring)."""

    def namespaces(self) -> list[NsT]:
        """The namespaces that hold at least one block."""
        return list(self._maps)

    def select(self, ns: NsT, keys: Sequence[BlockKey] | None = None) -> list[Block[NsT]]:
        """`ns`'s blocks (None: all) or each given key's block and every block under it,
        parents before children. Keys not cached are skipped."""
        m = self._maps.get(ns)
        if not m:
            return []
        if keys is None:
            return list(m.values())
        tops = {b for k in keys if (b := m.get(k)) is not None}
        if not tops:
            return []
        inside = set(tops)
        out: list[Block[NsT]] = []
        for b in m.values():
            if b in inside or b.parent in inside:
                inside.add(b)
                out.append(b)
        return out

    def purge(self, ns: NsT, blocks: list[Block[NsT]]) -> Purged:
        """Removes `blocks` (a `select` result, parents before children) from every tier; a
        pinned block and its ancestors among them stay, doomed. The drops are journaled as one
        `Drops` entry per tier (`take_drops`)."""
        m = self._maps.get(ns)
        if not m or not blocks:
            return Purged(0, 0, 0, [], 0)
        keep: set[Block[NsT]] = set()
        pinned = [b for b in blocks if b.pins]
        if pinned:
            chosen = set(blocks)
            for b in pinned:
                a: Block[NsT] | None = b
                while a is not None and a in chosen and a not in keep:
                    keep.add(a)
                    a = a.parent
        whole = len(blocks) == len(m) and not keep
        gone = [b for b in blocks if b not in keep] if keep else blocks
        dram = [b for b in gone if b.flags & IN_DRAM]
        ssd_keys = [b.key for b in gone if b.flags & ON_SSD]
        slots = [s - 1 for b in dram if (s := b.flags >> SLOT_SHIFT)]
        qd, qs, used = self._qd, self._qs, self._slot_used
        for b in gone:  # the only per-block work: queue links and the slot table
            f = b.flags
            if f & QUEUED:
                if f & Q_DRAM:
                    qd.discard(b)
                else:
                    qs.discard(b)
            b.flags = 0
        for s in slots:
            used[s] = 0
        if self._hooks:
            self._policy.forget(gone)
        keys = [b.key for b in gone]
        if whole:
            del self._maps[ns]
        else:
            gone_set = set(gone)
            for b in reversed(gone):  # children first: a parent that stays is requeued last
                del m[b.key]
                p = b.parent
                if p is not None:
                    p.children -= 1
                    if p not in gone_set:
                        self._requeue(p)
            if not m:
                del self._maps[ns]
        if keep:
            self._doomed.update(keep)
        if self._doomed:
            self._doomed.difference_update(gone)
        n = len(gone)
        self._entries -= n
        self._hbm_blocks -= sum(1 for b in gone if b.hbm)
        self._count[_DRAM] -= len(dram)
        self._count[_SSD] -= len(ssd_keys)
        self._evictions["removed"] += n
        if self._journal is not None:
            if dram:
                self._drops.append(Drops(ns, _DRAM, [b.key for b in dram], slots, whole))
            if ssd_keys:
                self._drops.append(Drops(ns, _SSD, ssd_keys, [], whole))
        return Purged(n, len(dram), len(ssd_keys), keys, len(keep))

    def take_drops(self) -> list[Drops[NsT]]:
        """The purges' drops since the last call (`Drops`, oldest first), and a fresh list."""
        d = self._drops
        if not d:
            return []
        self._drops = []
        return d

    def doomed(self, ns: NsT, key: BlockKey) -> bool:
        """Whether `ns`'s block `key` is doomed (waits for its pins to go)."""
        b = self.get(ns, key)
        return b is not None and b in self._doomed

    @property
    def doomed_blocks(self) -> int:
        return len(self._doomed)

    @property
    def reap_due(self) -> bool:
        """A doomed block lost its last pin or child since the last `reap`."""
        return self._reap_due

    def reap(self) -> list[tuple[NsT, BlockKey]]:
        """Removes every doomed block that nothing pins and that has no children (then its
        doomed parent when it is left so, and so on); the (ns, key) removed."""
        self._reap_due = False
        doomed = self._doomed
        ready = [b for b in doomed if not b.pins and not b.children]
        out: list[tuple[NsT, BlockKey]] = []
        while ready:
            b = ready.pop()
            if b not in doomed or b.pins or b.children:
                continue
            p = b.parent
            for tier in (_SSD, _DRAM):
                if b.flags & (1 << tier):
                    self._drop(b, tier, None, count=False)  # the last one unlinks it
            self._evictions["removed"] += 1
            out.append((b.ns, b.key))
            if p is not None and p in doomed and not p.pins and not p.children:
                ready.append(p)
        self._reap_due = False
        return out
