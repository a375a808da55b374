"""Acquire: pin a cached prefix under a READ lease, promoting SSD-only blocks into DRAM first.

Steps, so that the SSD and remote reads leave the cache lock (and, via `Cache.acquire_async`,
the event loop):

    check   (no lock)     with a remote tier that is up, and a local prefix that ends before the
                          chain does, `Cache` asks the store how many keys after that prefix it
                          holds (`RemoteTier.present`: one pipelined EXISTS round trip) →
                          `RemoteCheck`
    begin   (cache lock)  pin every block of the prefix in the index; per block the planner
                          promotes (`placement.promotions`: the SSD-only ones) claim a
                          DRAM slot (`Residency.claiming`: evicts for room, charges the tenant) and
                          register the promotion — or, if another Acquire is promoting that
                          block, note its `done` event; the prefix ends before a block that gets
                          no slot (nothing is forgotten); when the whole local prefix is in
                          hand, it claims a slot per further key the store holds
                          (`placement.remote_fetches` over the check; those keys are in no
                          index) and none for a key it does not hold (a claim evicts for room:
                          it would evict a useful block for nothing). A claim may stop for page
                          moves (`beginning`, `Residency.taking`'s steps): the lock is let go while
                          they copy, and each block is looked at again when it resumes
    finish  (no lock)     read + verify the claimed blocks in one LMDB read transaction
                          (`Residency.read_claimed`), fetch + verify the remote keys in one
                          pipelined round trip (`RemoteTier.fetch_into`; a key the store evicted
                          since the check is a miss), then wait for the other Acquires noted
    end     (cache lock)  each good slot becomes its block's DRAM copy; the prefix is cut before
                          the first block not in DRAM (a lost payload: the block is forgotten
                          with its subtree); if the local prefix is whole, the fetched remote
                          blocks follow it as new DRAM blocks (up to the first miss, or a key
                          that appeared locally meanwhile); the rest is unpinned or unclaimed,
                          the lease granted

Invariants: a pinned block is never evicted (the index refuses); a claimed slot belongs to its
Acquire until `end` settles or frees it (`Residency.claimed` counts them, so `Cache.leaked_slots`
stays 0); a block is read by one Acquire at a time; `end` runs exactly once per `begin` — when
`finish` raises or its caller is cancelled too — and `wait_idle` lets shutdown wait for it before
the store closes.

A READ lease ends (Release, TTL, shutdown) with `release`, which unpins its blocks.

Threading: `begin` (`Acquirer.beginning`) and `release` are called with the cache lock held,
`end` takes it; `finish` must be called without it, from any thread: it reads SSD and remote
payloads into the claimed slots (pinned, owned by the claim) with no daemon lock held, and waits
on `_settled` (a condition on the cache lock) for another Acquire's promotion of the same block.
Lock order: `kvtier.daemon.cache.cache`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.core.types import Tier
from kvtier.daemon.cache.api import AcquireResult
from kvtier.daemon.cache.leases import LeaseKind, LeaseTable
from kvtier.daemon.cache.namespaces import Namespace, NamespaceInfo, Tenant
from kvtier.daemon.cache.residency import Residency, Steps
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.rates.book import Link, RateBook
from kvtier.index import placement
from kvtier.index.prefix import Block, IndexStateError

_Claim = Callable[[NamespaceInfo], Steps[int | None]]

PROMOTION_WAIT_S = 30.0
"""How long an Acquire waits for another Acquire's promotion of the same block before ending its
prefix there."""


@dataclass(slots=True)
class ReadLease:
    """A READ lease's payload: the pinned blocks (pinned in the index, which the pool asks)."""

    ns: NamespaceInfo
    blocks: list[Block[Namespace]]
    h2d_bytes_per_s: float  # the planner's DRAM-read estimate when granted (prediction error)

    def slot_of(self, block: int) -> int:
        """The slot of the lease's `block`-th pinned block (`SlotStream`)."""
        slot = self.blocks[block].dram_slot
        assert slot is not None  # pinned in DRAM for the lease's life
        return slot


class RemoteCheck(NamedTuple):
    """The remote store's existence check for an Acquire's chain, made before `begin` without
    the cache lock (`Cache`, `RemoteTier.present`): it holds `held` keys after the first `after`
    (the local prefix then)."""

    after: int
    held: int


NOT_ASKED = RemoteCheck(0, 0)  # no remote tier, or not asked: nothing is fetched


@dataclass(slots=True)
class Acquiring:
    """An Acquire between `begin` and `end`. Positions index `blocks`."""

    tenant: Tenant
    ns: NamespaceInfo
    ttl: float
    blocks: list[Block[Namespace]]  # the prefix, each pinned in the index
    claimed: dict[int, int]  # position -> slot claimed to promote that SSD-only block into
    waits: dict[int, threading.Event]  # position -> the promoting Acquire's `done`
    done: threading.Event  # set once this Acquire's promotions are settled
    h2d_bytes_per_s: float  # the rates when it began (prediction error)
    ssd_bytes_per_s: float
    got: list[int | None] | None = None  # per claimed slot, in order: payload bytes or None
    read_s: float = 0.0
    remote_keys: list[bytes] = field(default_factory=list)  # after the local prefix
    remote_slots: list[int] = field(default_factory=list)  # claimed, one per remote key
    remote_got: list[int | None] | None = None
    session: str = ""  # the lease's session (see `kvtier.daemon.cache.leases`)

    @property
    def io(self) -> bool:
        """Whether `finish` has anything to do (else `end` may follow `begin` directly)."""
        return bool(self.claimed or self.waits or self.remote_slots)


class Acquirer:
    """The Acquire steps over the cache's tiers and lease table (see the module docstring)."""

    def __init__(
        self, lock: threading.RLock, residency: Residency, leases: LeaseTable,
        metrics: DaemonMetrics,
        rates: RateBook, claim: _Claim,
    ) -> None:
        self._lock = lock
        self.residency = residency
        self._leases = leases
        self._metrics = metrics
        self._rates = rates
        self._claim = claim  # (namespace) -> slot | None: tenant quota, then `Residency.claiming`
        self._settled = threading.Condition(lock)
        self._in_flight = 0  # Acquires with I/O between begin and end
        self._promoting: dict[tuple[str, bytes], threading.Event] = {}

    def beginning(
        self, tenant: Tenant, ns: NamespaceInfo, chain: list[bytes], ttl: float,
        remote: RemoteCheck = NOT_ASKED,
    ) -> Steps[Acquiring]:
        """Step 1 (`begin`), as `Residency.taking`'s steps: it stops for the page moves a claim
        needs, the cache lock let go meanwhile (each resumption holds it again, so what another
        request changed then is checked again: a block promoted or being promoted, a key now
        local).
        `remote`: what the remote store holds after the local prefix (slots are claimed for
        those keys only)."""
        index = self.residency.index
        blocks = list(index.lookup(ns.name, chain, touch=False).blocks)
        for block in blocks:  # first, so promotions cannot evict the rest
            index.pin(ns.name, block.key)
        a = Acquiring(tenant, ns, ttl, blocks, {}, {}, threading.Event(),
                      self._rates.bandwidth(Link.DRAM_READ), self._rates.bandwidth(Link.SSD_READ))
        self._in_flight += 1  # `wait_idle` waits for an Acquire stopped at a page move too
        try:
            for i in placement.promotions(blocks):
                block, slot = blocks[i], None
                while not block.in_dram:  # (another Acquire may promote it while moves copy)
                    other = self._promoting.get((ns.name, block.key))
                    if other is not None:
                        a.waits[i] = other
                        break
                    if slot is not None:
                        self._promoting[(ns.name, block.key)] = a.done
                        a.claimed[i], slot = slot, None
                        break
                    slot = yield from self._claim(ns)
                    if slot is None:
                        break
                if slot is not None:  # promoted, or being promoted, by another meanwhile
                    self.residency.unclaim(ns.name, slot)
                if not block.in_dram and i not in a.claimed and i not in a.waits:
                    # no room: nothing is forgotten, the prefix ends here
                    for rest in blocks[i:]:
                        index.unpin(ns.name, rest.key)
                    del blocks[i:]
                    break
            fetch = placement.remote_fetches(len(blocks), remote.after, remote.held)
            store = self.residency.remote
            if store is not None and fetch and store.ready():
                for key in chain[len(blocks):len(blocks) + fetch]:
                    if index.get(ns.name, key) is not None:
                        break
                    slot = yield from self._claim(ns)
                    if slot is None:
                        break
                    if index.get(ns.name, key) is not None:  # stored while moves were copied
                        self.residency.unclaim(ns.name, slot)
                        break
                    a.remote_keys.append(key)
                    a.remote_slots.append(slot)
        finally:
            if not a.io:
                self._in_flight -= 1
                self._settled.notify_all()  # (the lock is held: each step runs under it)
        return a

    def finish(self, a: Acquiring) -> AcquireResult:
        """Steps 2 and 3: read the claimed blocks, wait for other promoters, then `end`.
        Call without the cache lock."""
        try:
            if a.claimed:
                name = a.ns.name
                a.got, a.read_s = self.residency.read_claimed(
                    [(name, a.blocks[i].key, slot) for i, slot in a.claimed.items()])
            remote = self.residency.remote
            if a.remote_slots and remote is not None:
                a.remote_got = remote.fetch_into(a.ns.name, a.remote_keys, a.remote_slots,
                                                 a.ns.layout.block_bytes)
            for done in a.waits.values():
                done.wait(PROMOTION_WAIT_S)
        finally:
            result = self.end(a)
        return result

    def end(self, a: Acquiring) -> AcquireResult:
        """Step 3 (takes the lock): settle promotions, cut the prefix before the first block not
        in DRAM, grant the lease."""
        ns, name = a.ns, a.ns.name
        residency, pool = self.residency, self.residency.pool
        got = dict(zip(a.claimed, a.got or [None] * len(a.claimed), strict=True))
        pinned: list[Block[Namespace]] = []
        sources: list[Tier] = []
        stop, lost, promoted = len(a.blocks), None, 0
        with self._lock:
            try:
                for i, block in enumerate(a.blocks):
                    n = got.get(i)
                    if i in a.claimed:
                        del self._promoting[(name, block.key)]
                        if n is not None and i < stop:
                            residency.settle(name, block, a.claimed[i], n)
                            promoted += 1
                        else:
                            residency.unclaim(name, a.claimed[i])
                            if n is None and i < stop:
                                lost = block
                            stop = min(stop, i)
                    elif i in a.waits and not block.in_dram:
                        stop = min(stop, i)  # the other promoter failed or is late
                    if (i < stop and block.dram_slot is not None
                            and pool.slot_stale(block.dram_slot)):
                        stop = i  # in a retired tenant file (`Residency.rekey`): not served
                        residency.stale.add((name, block.key))
                    if i >= stop:
                        residency.index.unpin(name, block.key)
                        continue
                    assert block.dram_slot is not None  # pinned in the index since begin
                    pinned.append(block)
                    sources.append(Tier.SSD if i in a.claimed or i in a.waits else Tier.DRAM)
                if lost is not None:
                    residency.drop_lost(name, lost)
                self._settle_remote(a, stop == len(a.blocks), pinned, sources)
                lease_id, offsets = "", []
                if pinned:
                    lease_id = self._leases.grant(a.tenant.name, LeaseKind.READ, a.ttl,
                                                  ReadLease(ns, pinned, a.h2d_bytes_per_s),
                                                  a.session).id
                    offsets = [pool.offset(b.dram_slot or 0) for b in pinned]
                    if pool.keep is not None:  # a successor keeps them until the deadline
                        pool.hold([b.dram_slot or 0 for b in pinned], time.monotonic() + a.ttl)
            finally:
                a.done.set()
                if a.io:
                    self._in_flight -= 1
                    self._settled.notify_all()
        if promoted:
            self._metrics.observe_fetch(
                Link.SSD_READ, a.read_s, promoted * ns.layout.block_bytes / a.ssd_bytes_per_s)
        return AcquireResult(lease_id, offsets, sources, a.ttl)

    def _settle_remote(self, a: Acquiring, whole: bool, pinned: list[Block[Namespace]],
                       sources: list[Tier]) -> None:
        """Fetched remote payloads after a whole local prefix become DRAM blocks, pinned for the
        lease; every other remote claim is given back. Cache lock held."""
        residency, name = self.residency, a.ns.name
        got = a.remote_got or [None] * len(a.remote_slots)
        parent = a.blocks[-1].key if a.blocks else None
        ok = whole
        for key, slot, n in zip(a.remote_keys, a.remote_slots, got, strict=True):
            if ok and n is not None and residency.pool.slot_stale(slot):
                ok = False  # claimed before a token change (`Residency.rekey`): not settled
            if ok and n is not None:
                try:
                    block = residency.settle_remote(name, key, parent, slot)
                except IndexStateError:  # it appeared locally meanwhile, or its parent went
                    ok = False
                else:
                    residency.index.pin(name, key)
                    pinned.append(block)
                    sources.append(Tier.REMOTE)
                    parent = key
                    continue
            ok = False
            residency.unclaim(name, slot)
        residency.apply()  # BlockStored for the new blocks (one run), and the promotions before

    def release(self, r: ReadLease) -> None:
        """Unpins a READ lease's blocks (Release, expiry, shutdown; its lease left the table).
        The caller holds the cache lock."""
        index = self.residency.index
        for block in r.blocks:
            index.unpin(r.ns.name, block.key)
        pool = self.residency.pool
        if pool.keep is not None:  # no lease holds them any more
            pool.unhold([b.dram_slot for b in r.blocks if not b.pins and b.dram_slot is not None])
        if self.residency.stale or index.reap_due or self.residency.quarantine.pending:
            self.residency.apply()  # blocks that waited for this release: of a retired tenant
            # file, evicted by an operator, quarantined

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no Acquire is between `begin` and `end` with I/O; False on timeout.
        Call with the cache lock held (it is released while waiting)."""
        deadline = time.monotonic() + timeout
        while self._in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._settled.wait(left)
        return True
