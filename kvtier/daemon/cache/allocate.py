"""The store path: Allocate slots under a WRITE lease, then Commit the blocks or Abort.

    allocate  keys not cached and not being written get fresh slots, as far as the index's
              DRAM admission (its policy, `PrefixIndex.admit`) stores them (tenant DRAM quota
              first: its own unpinned blocks are evicted for room, else RESOURCE_EXHAUSTED; then a
              full pool, or a tenant's full slice of it, makes room by eviction); the keys
              become `pending` in their namespace, so a second Allocate skips them
    commit    inserts the blocks in chain order as DRAM blocks; one whose parent vanished
              meanwhile (or that appeared meanwhile) is dropped and its slot freed, so no block
              is ever stranded; BlockStored events per run of consecutive blocks
    end       (Abort, expiry, shutdown) frees every slot of the lease, exactly once

A hand-off's lease (`WriteLease.handoff`: a prefill's blocks, whose keys the cache marked
pending in the remote store) writes its blocks to the remote tier at Commit, urgently; the
markers of blocks it does not write there (dropped at Commit, or the lease ended) are deleted.

Every slot of a WRITE lease is charged to its tenant from `allocate` until `commit` makes it a
block's (still charged) or `end` frees it. The lease table, ownership checks and TTLs are the
cache's (`kvtier.daemon.cache.cache`); this module only sees leases it was handed.

Threading: every function is called with the cache lock held.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TypeVar, cast

from kvtier.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvtier.core.types import Tier
from kvtier.core.units import format_bytes
from kvtier.daemon.cache.api import AllocateResult
from kvtier.daemon.cache.leases import LeaseKind, LeaseTable
from kvtier.daemon.cache.namespaces import Namespace, NamespaceInfo, Tenant, TenantUsage
from kvtier.daemon.cache.residency import Residency, Steps
from kvtier.index import placement
from kvtier.index.prefix import Block, DuplicateBlock, MissingParent

T = TypeVar("T")


@dataclass(slots=True)
class WriteLease:
    """A WRITE lease's payload: the chain and the slots being filled."""

    ns: NamespaceInfo
    keys: list[bytes]
    parent: bytes
    todo: list[tuple[int, int]]  # (index in keys, slot)
    handoff: bool = False
    """A prefill's hand-off (set by the cache once granted): see the module docstring."""

    def slot_of(self, block: int) -> int:
        """The slot of the lease's `block`-th block (`SlotStream`)."""
        return self.todo[block][1]


def quota_room(residency: Residency, usage: TenantUsage, n: int, stride: int) -> bool:
    """Whether `n` more slots of `stride` bytes fit the tenant's DRAM quota, after evicting its
    own unpinned DRAM blocks for them if needed (`placement.over_quota`)."""
    quota, more = usage.tenant.dram_quota_bytes, n * stride
    while over := placement.over_quota(usage.dram_bytes, more, quota, stride):
        if not residency.evict_tenant_dram(usage.tenant.name, over):
            return False
    return True


class _Stopped:
    """Counts the page-move stops of a step generator it passes through."""

    def __init__(self) -> None:
        self.count = 0

    def watch(self, steps: Steps[T]) -> Steps[T]:
        try:
            moves = next(steps)
            while True:
                self.count += 1
                yield moves
                moves = steps.send(None)
        except StopIteration as stop:
            return cast(T, stop.value)


class Allocator:
    """Allocate / Commit / Abort over the cache's tiers and lease table (module docstring)."""

    def __init__(self, residency: Residency, leases: LeaseTable) -> None:
        self.residency = residency
        self._leases = leases

    def allocating(
        self, tenant: Tenant, ns: NamespaceInfo, chain: list[bytes], parent: bytes, ttl: float,
        session: str = "",
    ) -> Steps[AllocateResult]:
        """Grants a WRITE lease on fresh slots for the keys of `chain` not cached or pending.
        Steps as `Residency.taking`'s: when it stopped for page moves (the cache lock let go), the
        keys it needs are looked at again and, if another request stored or began writing one
        meanwhile, the slots go back and it starts over (the moves and evictions made stay)."""
        index = self.residency.index
        if parent:
            if len(parent) != ns.layout.key_width:
                raise InvalidArgument(
                    f"parent_key has {len(parent)} bytes, the layout's keys have "
                    f"{ns.layout.key_width}"
                )
            if index.get(ns.name, parent) is None and parent not in ns.pending:
                raise FailedPrecondition(
                    "parent_key is not cached: blocks after it could never be hit"
                )
            if parent in chain:
                raise InvalidArgument("parent_key repeats inside the chain")
        while True:  # (a parent gone meanwhile: Commit drops what would hang under it)
            need = self._need(ns, chain)
            if not need:
                return AllocateResult("", [], [], ttl)
            stopped = _Stopped()
            slots = yield from stopped.watch(self._take_slots(ns.usage, len(need),
                                                              ns.layout.block_bytes))
            if not stopped.count or all(
                    index.get(ns.name, chain[i]) is None and chain[i] not in ns.pending
                    for i in need):
                break
            for slot in slots:  # the chain changed while the lock was let go
                self.residency.give_back(ns.usage.tenant.name, slot)
        lease = self._leases.grant(
            tenant.name, LeaseKind.WRITE, ttl,
            WriteLease(ns, chain, parent, list(zip(need, slots, strict=True))), session,
        )
        for i in need:
            ns.pending[chain[i]] = lease.id
        pool = self.residency.pool
        pool.writing(slots, tenant.name, time.monotonic() + ttl)  # a successor holds them
        return AllocateResult(lease.id, need, [pool.offset(s) for s in slots], ttl)

    def _need(self, ns: NamespaceInfo, chain: list[bytes]) -> list[int]:
        """Positions of the keys not cached nor pending that the DRAM admission stores."""
        index = self.residency.index
        need = [i for i, k in enumerate(chain)
                if index.get(ns.name, k) is None and k not in ns.pending]
        return need[:self._admitted(ns, chain, need)] if need else need

    def _admitted(self, ns: NamespaceInfo, chain: list[bytes], need: list[int]) -> int:
        """How many of `need` the index's DRAM admission stores (a prefix of them; the rest
        would hang under a refused block). All when the block before the first is not in the
        index yet (pending): admission needs a cached parent."""
        start = need[0]
        try:
            n = self.residency.index.admit(ns.name, chain, start)
        except MissingParent:
            return len(need)
        return sum(1 for i in need if i < start + n)

    def _take_slots(self, usage: TenantUsage, n: int, nbytes: int) -> Steps[list[int]]:
        pool = self.residency.pool
        stride = pool.stride_for(nbytes)
        # the tenant's slice of an isolated pool, else the pool
        data = pool.slices().get(usage.tenant.name, pool.data_bytes)
        whole = data // stride
        if n > whole:  # no eviction or release could ever make room: say so, not "pinned"
            where = "its slice of the DRAM pool" if data < pool.data_bytes else "the DRAM pool"
            raise ResourceExhausted(
                f"{n} blocks of {nbytes} bytes do not fit {where} at all: its "
                f"{format_bytes(data)} hold at most {whole} slots of {stride} bytes; store "
                f"them in requests of at most {whole} blocks (or give the daemon a larger "
                "dram_bytes)"
            )
        if not quota_room(self.residency, usage, n, stride):
            raise ResourceExhausted(
                f"tenant {usage.tenant.name!r} DRAM quota of {usage.tenant.dram_quota_bytes} "
                f"bytes: {n} more blocks do not fit (it holds {usage.dram_bytes}, pinned or "
                "being written)"
            )
        slots = yield from self.residency.taking(n, usage.tenant.name, nbytes)
        if not slots:
            pool = self.residency.pool  # the room of the tenant's own class (isolated pool)
            room = pool.room(pool.class_bytes(nbytes, usage.tenant.name))
            raise ResourceExhausted(
                f"DRAM pool full: {n} slots of {stride} bytes wanted, "
                f"{room} free, the rest held by blocks pinned by leases or being written"
            )
        return slots

    def commit(self, tenant: Tenant, w: WriteLease) -> int:
        """Inserts the lease's blocks (its lease already left the table); returns how many.
        The applier publishes them (one BlockStored per run of consecutive blocks) before any
        SSD event of the same blocks."""
        ns, index = w.ns, self.residency.index
        inserted: list[Block[Namespace]] = []
        dropped: list[bytes] = []
        for i, slot in w.todo:
            key = w.keys[i]
            del ns.pending[key]
            parent = w.keys[i - 1] if i else w.parent
            try:
                inserted.append(index.insert(ns.name, key, parent or None, Tier.DRAM,
                                             dram_slot=slot))
            except (MissingParent, DuplicateBlock):  # parent gone: it could never be hit
                self.residency.give_back(ns.usage.tenant.name, slot)
                dropped.append(key)
        self.residency.apply()
        self.residency.pool.unhold([s for _, s in w.todo])  # committed or freed: no writer now
        self.residency.maybe_write_back(ns.name, inserted)  # admitted on the first access (k=1)
        self.residency.maybe_write_remote(ns.name, inserted, committed=True, handoff=w.handoff)
        if w.handoff and dropped and self.residency.remote is not None:
            self.residency.remote.unmark_later(ns.name, dropped)
        pool = self.residency.pool
        stale = [(ns.name, b.key) for b in inserted
                 if b.dram_slot is not None and pool.slot_stale(b.dram_slot)]
        if stale:  # allocated before a token change (`Residency.rekey`): out of DRAM once written
            self.residency.stale.update(stale)
            self.residency.apply()
        return len(inserted)

    def end(self, w: WriteLease) -> None:
        """Frees the slots of a lease that ends without Commit (its lease left the table)."""
        for i, slot in w.todo:
            w.ns.pending.pop(w.keys[i], None)
            self.residency.give_back(w.ns.usage.tenant.name, slot)
        if w.handoff and self.residency.remote is not None:
            self.residency.remote.unmark_later(w.ns.name, [w.keys[i] for i, _ in w.todo])

    def slots_held(self) -> int:
        """Slots held by live WRITE leases."""
        return sum(len(lease.payload.todo) for lease in self._leases
                   if isinstance(lease.payload, WriteLease))
