"""The applier: the one place where the index's residency changes reach the rest of the daemon.

The prefix index journals every copy added to or dropped from a tier and every DRAM slot move
(`kvtier.index.prefix.PrefixIndex.take_changes`), whichever call made it. `Applier.apply` drains
the journal in order and does, per entry, what the daemon owes it:

    ADD  DRAM   publish BlockStored (consecutive blocks of one chain: one event); the slot was
                charged to its tenant when it was taken (`Residency.taking`); with a keep file,
                the slot's keep record names the block (`DramPool.record`)
    ADD  SSD    charge the tenant the stored bytes (and count them in `ssd_bytes`); publish
                BlockStored
    DROP DRAM   give the slot back to the pool and its bytes back to the tenant; count the
                eviction under `why`; publish BlockRemoved (consecutive drops of one
                namespace from one tier: one event)
    DROP SSD    delete the key from the store (one batch per `apply`); give the bytes back;
                count; publish BlockRemoved

Remote copies are not in the index: `stored_remote` publishes BlockStored (Tier.REMOTE) for the
blocks the remote store took, and `removed` their removal by an operator's evict (the store's own
evictions are unseen).

A purge (`kvtier.index.purge`: an operator's evict) journals its drops as one `Drops` entry per
tier instead of a DROP each; they are applied the same way, in bulk.
    MOVE DRAM   nothing: the pool already moved the bytes, and a slot of the same size class
                costs the tenant the same

Tenant bytes change here and nowhere else. Besides the journal, four calls move them for what is
held for a block *before* it is in a tier, which the journal does not report (no copy was added
or dropped), so the applier is told directly:

    take_slots(tenant, nbytes)  slots taken for a tenant's blocks (Allocate, a promotion claim):
                                charged now, so concurrent takers see each other in the quotas and
                                fair shares; the block that fills one later is an ADD DRAM that
                                charges nothing more
    give_back(tenant, slot)     a taken slot that never became a block's copy (an unfilled WRITE
                                lease, an unsettled claim): refunded and freed
    reserve_ssd(ns)             a queued write-back: its stored bytes are charged while queued, so
                                the tenant's SSD quota counts what is on the way
    unreserve_ssd(ns)           the write-back left the queue (written or refused); a written one
                                then arrives as an ADD SSD, which charges the copy

Events go to WatchEvents subscribers now; the KV-event publisher of the routing work is one more
consumer here.

When to apply: a call that drops copies applies before it needs what they freed (eviction for
room applies before the next allocation) and names its reason; every operation applies before it
gives the cache lock back, so the journal is empty whenever the lock is free.

Threading: every method is called with the cache lock held (it guards the index, the pool's
ownership and the tenants). Lock order: cache lock → the DRAM pool's lock (inside `free`) → the SSD
store's write lock (inside `delete_many`) → the event log's own lock (inside `stored`/`removed`);
none of these calls back into a lock before it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.types import Tier
from kvtier.daemon.cache.events import EventLog
from kvtier.daemon.cache.namespaces import Namespace, Namespaces
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.index.prefix import Change, Drops, Op, PrefixIndex
from kvtier.tiers.dram import DramPool
from kvtier.tiers.ssd.store import SsdStore

_ADD, _DROP = Op.ADD, Op.DROP
_DRAM, _SSD = Tier.DRAM, Tier.SSD
EVENT_KEYS = 8192
"""Most keys in one BlockRemoved of a purge (32-byte keys: 256 KiB, well under a message)."""


class Applier:
    """Drains the index's journal (module docstring). `ssd_cost(ns)`: the stored bytes of one
    block of namespace `ns`. `store` is set once the SSD tier is open (None: no SSD tier)."""

    def __init__(
        self, index: PrefixIndex[Namespace], pool: DramPool, names: Namespaces, events: EventLog,
        metrics: DaemonMetrics, ssd_cost: Callable[[str], int],
        payload: Callable[[str], int] | None = None,
    ) -> None:
        self.index = index
        self.pool = pool
        self.names = names
        self.events = events
        self.metrics = metrics
        self.ssd_cost = ssd_cost
        self.payload = payload  # a block's bytes in namespace ns, for the pool's keep records
        self.recording = True  # False while the blocks of a kept pool are re-entered
        self.store: SsdStore | None = None
        self.ssd_bytes = 0  # bytes of the SSD copies the index holds (payload + header)

    def apply(self, why: str = "capacity", publish: bool = True) -> None:
        """Acts on every journal entry since the last call. `why`: the eviction reason label
        of the drops among them (capacity, share, quota, checksum); `publish=False` (the SSD
        rebuild at start) charges and frees but publishes nothing."""
        changes = self.index.take_changes()
        drops = self.index.take_drops()
        for d in drops:  # (a purge applies what came before it first: the order holds)
            self._drops(d, why, publish)
        if not changes:
            return
        names, pool = self.names, self.pool
        keep = pool.keep is not None and self.payload is not None and self.recording
        deletes: list[tuple[str, bytes]] = []
        run: list[Change[Namespace]] = []
        gone: list[Change[Namespace]] = []  # a run of drops of one namespace's blocks from one tier
        dropped: dict[Tier, int] = {}  # the eviction counters, added once per tier
        for c in changes:
            ns = c.ns
            if c.op is _ADD:
                if gone:
                    self._removed(gone)
                    gone = []
                if c.tier is _SSD:
                    cost = self.ssd_cost(ns)
                    self.ssd_bytes += cost
                    names.charge(ns.tenant, _SSD, cost)
                elif keep and c.slot is not None:  # what a successor re-adopts
                    pool.record(c.slot, ns.tenant, ns.layout_id, c.key, c.parent,
                                self.payload(ns))  # type: ignore[misc]
                if not publish:
                    continue
                if run and not (c.ns == run[-1].ns and c.tier is run[-1].tier
                                and c.parent == run[-1].key):
                    self._stored(run)
                    run = []
                run.append(c)
                continue
            if c.op is not _DROP:
                continue  # MOVE
            if run:
                self._stored(run)
                run = []
            tenant = ns.tenant
            if c.tier is _DRAM:
                if c.slot is not None:
                    names.charge(tenant, _DRAM, -pool.free(c.slot))
            else:
                deletes.append((ns, c.key))
                cost = self.ssd_cost(ns)
                self.ssd_bytes -= cost
                names.charge(tenant, _SSD, -cost)
            dropped[c.tier] = dropped.get(c.tier, 0) + 1
            if publish:
                if gone and not (c.ns == gone[-1].ns and c.tier is gone[-1].tier):
                    self._removed(gone)
                    gone = []
                gone.append(c)
        if run:
            self._stored(run)
        if gone:
            self._removed(gone)
        for tier, n in dropped.items():
            self.metrics.evictions.labels(tier.label, why).inc(n)
        if deletes and self.store is not None:
            self.store.delete_many(deletes)

    def _drops(self, d: Drops[Namespace], why: str, publish: bool) -> None:
        """A purge's drops from one tier (`kvtier.index.purge`): as the DROP entries of those
        blocks would be, in bulk — the slots freed under one pool lock, the tenant charged
        once, the SSD keys deleted in one batch, BlockRemoved in events of `EVENT_KEYS`."""
        ns = d.ns
        if d.tier is _DRAM:
            if d.slots:
                self.names.charge(ns.tenant, _DRAM, -self.pool.free_many(d.slots))
        else:
            cost = self.ssd_cost(ns) * len(d.keys)
            self.ssd_bytes -= cost
            self.names.charge(ns.tenant, _SSD, -cost)
            if self.store is not None and d.whole:  # nothing of it is left: by a cursor
                self.store.delete_ns(ns)
            elif self.store is not None:
                self.store.delete_ns_keys(ns, d.keys)
        self.metrics.evictions.labels(d.tier.label, why).inc(len(d.keys))
        if publish:
            self.removed(ns, d.tier, d.keys)

    def removed(self, ns: Namespace, tier: Tier, keys: list[bytes]) -> None:
        """BlockRemoved for `keys` of `ns` in `tier`, in events of at most `EVENT_KEYS` keys
        (an event is one message of WatchEvents and of the ZMQ stream)."""
        for i in range(0, len(keys), EVENT_KEYS):
            self.events.removed(ns.tenant, ns.layout_id, tier, keys[i:i + EVENT_KEYS])

    def stored_remote(self, written: list[tuple[Namespace, bytes]]) -> None:
        """Publishes BlockStored in Tier.REMOTE for blocks (namespace, key) the remote store
        just took (the remote writer's callback, cache lock held), a chain's consecutive blocks
        as one event. The index keeps no remote copies, and the store's own evictions are not
        seen here: nothing publishes a remote BlockRemoved."""
        run: list[Change[Namespace]] = []
        for ns, key in written:
            block = self.index.get(ns, key)
            parent = None if block is None else block.parent_key
            c = Change(_ADD, ns, key, Tier.REMOTE, None, parent)
            if run and not (c.ns == run[-1].ns and c.parent == run[-1].key):
                self._stored(run)
                run = []
            run.append(c)
        if run:
            self._stored(run)

    def removed_remote(self, ns: Namespace, keys: list[bytes]) -> None:
        """Publishes BlockRemoved in Tier.REMOTE for keys whose remote copies this node deleted
        (a quarantine; cache lock held)."""
        self.events.removed(ns.tenant, ns.layout_id, Tier.REMOTE, keys)

    def _stored(self, run: list[Change[Namespace]]) -> None:
        """One BlockStored event for a run of consecutive blocks of one chain in one tier."""
        first = run[0]
        tenant, lid = first.ns.tenant, first.ns.layout_id
        layout = self.names.layouts.get((tenant, lid))
        self.events.stored(tenant, lid, first.tier, [c.key for c in run], first.parent or b"",
                           0 if layout is None else layout.block_tokens)

    def _removed(self, gone: list[Change[Namespace]]) -> None:
        """One BlockRemoved event for a run of drops of one namespace's blocks from one tier,
        in the journal's order (an eviction pass: one event, as vLLM's publisher sends one)."""
        ns = gone[0].ns
        self.events.removed(ns.tenant, ns.layout_id, gone[0].tier, [c.key for c in gone])

    # -- held for a block not yet in a tier (module docstring) ---------------------------------

    def take_slots(self, tenant: str, nbytes: int) -> None:
        """`nbytes` of DRAM slots were just taken for `tenant`'s blocks: charged until a block's
        DROP DRAM or `give_back` frees them."""
        self.names.charge(tenant, _DRAM, nbytes)

    def give_back(self, tenant: str, slot: int) -> None:
        """Frees a taken slot that holds no block and gives its bytes back to `tenant`."""
        self.names.charge(tenant, _DRAM, -self.pool.free(slot))

    def reserve_ssd(self, ns: Namespace) -> None:
        """A write-back of one of `ns`'s blocks is queued: its stored bytes are charged."""
        self.names.charge(ns.tenant, _SSD, self.ssd_cost(ns))

    def unreserve_ssd(self, ns: Namespace) -> None:
        """A queued write-back of `ns` left the queue: its reservation is given back."""
        self.names.charge(ns.tenant, _SSD, -self.ssd_cost(ns))
