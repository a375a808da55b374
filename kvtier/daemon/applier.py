"""The applier: the one place where the index's residency changes reach the rest of the daemon.

The prefix index journals every copy added to or dropped from a tier and every DRAM slot move
(`kvtier.index.prefix.PrefixIndex.take_changes`), whichever call made it. `Applier.apply` drains
the journal in order and does, per entry, what the daemon owes it:

    ADD  DRAM   publish BlockStored (consecutive blocks of one chain: one event); the slot was
                charged to its tenant when it was taken (`Tiers.take_slots`)
    ADD  SSD    charge the tenant the stored bytes (and count them in `ssd_bytes`); publish
                BlockStored
    DROP DRAM   give the slot back to the pool and its bytes back to the tenant; count the
                eviction under `why`; publish BlockRemoved
    DROP SSD    delete the key from the store (one batch per `apply`); give the bytes back;
                count; publish BlockRemoved

Remote copies are not in the index: `stored_remote` publishes BlockStored (Tier.REMOTE) for the
blocks the remote store took, and nothing publishes their removal (the store evicts on its own,
unseen).
    MOVE DRAM   nothing: the pool already moved the bytes, and a slot of the same size class
                costs the tenant the same

Events go to WatchEvents subscribers now; the KV-event publisher of the routing work is one more
consumer here.

When to apply: a call that drops copies applies before it needs what they freed (eviction for
room applies before the next allocation) and names its reason; every operation applies before it
gives the cache lock back, so the journal is empty whenever the lock is free.

Threading: called with the cache lock held (it guards the index, the pool's ownership and the
tenants). Lock order: cache lock, then the SSD store's write lock (inside `delete_many`), then the
event log's own lock (inside `emit`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.types import Tier
from kvtier.daemon.events import EventLog
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.namespaces import Namespaces, namespace_layout, namespace_tenant
from kvtier.index.prefix import Change, Op, PrefixIndex
from kvtier.tiers.dram import DramPool
from kvtier.tiers.ssd.store import SsdStore

_ADD, _DROP = Op.ADD, Op.DROP
_DRAM, _SSD = Tier.DRAM, Tier.SSD


class Applier:
    """Drains the index's journal (module docstring). `ssd_cost(ns)`: the stored bytes of one
    block of namespace `ns`. `store` is set once the SSD tier is open (None: no SSD tier)."""

    def __init__(
        self, index: PrefixIndex, pool: DramPool, names: Namespaces, events: EventLog,
        metrics: DaemonMetrics, ssd_cost: Callable[[str], int],
    ) -> None:
        self.index = index
        self.pool = pool
        self.names = names
        self.events = events
        self.metrics = metrics
        self.ssd_cost = ssd_cost
        self.store: SsdStore | None = None
        self.ssd_bytes = 0  # bytes of the SSD copies the index holds (payload + header)

    def apply(self, why: str = "capacity", publish: bool = True) -> None:
        """Acts on every journal entry since the last call. `why`: the eviction reason label
        of the drops among them (capacity, share, quota, checksum); `publish=False` (the SSD
        rebuild at start) charges and frees but publishes nothing."""
        changes = self.index.take_changes()
        if not changes:
            return
        names, pool = self.names, self.pool
        deletes: list[tuple[str, bytes]] = []
        run: list[Change] = []
        for c in changes:
            ns = str(c.tenant)
            if c.op is _ADD:
                if c.tier is _SSD:
                    cost = self.ssd_cost(ns)
                    self.ssd_bytes += cost
                    names.charge(namespace_tenant(ns), _SSD, cost)
                if not publish:
                    continue
                if run and not (c.tenant == run[-1].tenant and c.tier is run[-1].tier
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
            tenant = namespace_tenant(ns)
            if c.tier is _DRAM:
                if c.slot is not None:
                    names.charge(tenant, _DRAM, -pool.stride_of(c.slot))
                    pool.free(c.slot)
            else:
                deletes.append((ns, c.key))
                cost = self.ssd_cost(ns)
                self.ssd_bytes -= cost
                names.charge(tenant, _SSD, -cost)
            self.metrics.evictions.labels(c.tier.label, why).inc()
            if publish:
                self.events.emit(tenant, namespace_layout(ns), False, c.tier, [c.key])
        if run:
            self._stored(run)
        if deletes and self.store is not None:
            self.store.delete_many(deletes)

    def stored_remote(self, written: list[tuple[str, bytes]]) -> None:
        """Publishes BlockStored in Tier.REMOTE for blocks (namespace, key) the remote store
        just took (the remote writer's callback, cache lock held), a chain's consecutive blocks
        as one event. The index keeps no remote copies, and the store's own evictions are not
        seen here: nothing publishes a remote BlockRemoved."""
        run: list[Change] = []
        for ns, key in written:
            block = self.index.get(ns, key)
            parent = None if block is None else block.parent_key
            c = Change(_ADD, ns, key, Tier.REMOTE, None, parent)
            if run and not (c.tenant == run[-1].tenant and c.parent == run[-1].key):
                self._stored(run)
                run = []
            run.append(c)
        if run:
            self._stored(run)

    def _stored(self, run: list[Change]) -> None:
        """One BlockStored event for a run of consecutive blocks of one chain in one tier."""
        first = run[0]
        ns = str(first.tenant)
        tenant, lid = namespace_tenant(ns), namespace_layout(ns)
        layout = self.names.layouts.get((tenant, lid))
        self.events.emit(tenant, lid, True, first.tier, [c.key for c in run], first.parent or b"",
                         0 if layout is None else layout.block_tokens)
