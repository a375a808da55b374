"""Where blocks live: the prefix index over the DRAM pool, the SSD store and mover, the remote tier.

`Residency` is the cache's storage half. It owns the `PrefixIndex`, the `DramPool`, and (when
`ssd_bytes > 0`) the `SsdStore` and `Mover`, and keeps them agreeing. Deciding is the placement
planner's (`kvtier.index.placement`, pure, shared with `kvtier simulate`: write-backs, SSD and
DRAM room, quota victims, victims across size classes, promotions, remote offers); the index
journals every residency change and the `Applier` (`kvtier.daemon.cache.applier`) acts on it
(slots freed, tenants charged, SSD keys deleted, events); what is left here is
applying the planner's intents and moving:

- index DRAM residency == an allocated pool slot; a pinned index block == a pinned pool slot,
  by derivation: the pool asks the index (`DramPool.owner`), and nothing pins a slot itself
  (page moves' targets, which hold no block, are the pool's own);
- DRAM eviction goes through the index (leaf-first, or demotion when an SSD copy exists):
  `placement.dram_room` with one size class, `placement.class_victim` (one at a time) with
  several; in an isolated pool (tenants) a tenant's region holds its blocks only, so its own
  coldest go (`placement.tenant_victims`);
- write-back (mover) starts when the planner says so (`placement.write_backs`: a DRAM-only block
  admitted by the k-th access whose parent is on SSD or queued, so SSD stays prefix-closed); the
  block is pinned while queued;
- SSD room is made *before* a write-back is queued, by index SSD eviction (`placement.ssd_room`,
  then the byte bound) + store deletes, so the store never refuses for capacity; the index
  bounds SSD blocks at ssd_bytes / (slot + header);
- promotion copies a verified SSD payload into a fresh slot; a failed verification is a miss,
  a counter, and the block's removal. It runs in three steps so the read can leave the event
  loop and the cache lock: `claiming` a slot (lock held; the tenant is charged now, so concurrent
  claims see each other), `read_claimed` (no cache lock, any thread; one LMDB read transaction
  for the batch), then `settle` (the slot becomes the block's DRAM copy) or `unclaim` (lock held).
  Until then the slot belongs to the claimant (`claimed` counts them) and the block must stay
  pinned in the index by the caller.

Index "tenants" are namespaces, `Namespace(tenant, layout id)` (layout id = H(model id, layout
fingerprint), `kvtier.daemon.cache.namespaces`), whose value `"<tenant>/ns2:<layout id hex>"` is
also the SSD store's (and the remote tier's) key, so after a restart the stored blocks come back
under the right tenant, model and layout (the rebuild turns each stored key back into a
`Namespace`). Blocks stored under any other namespace form — the pre-model-id
`"<tenant>/<fingerprint hex>"` — cannot be attributed to a model: the rebuild deletes them (one
warning line with the count) and never serves them.

Threading: every method is called with the cache lock held, except `on_written`, which the mover
calls on its writer thread and which takes the cache lock itself, and `read_claimed`, which must be
called without it. Lock order (all of it: `kvtier.daemon.cache.cache`): cache lock → a write queue's
lock (`Mover.submit`, `RemoteTier.offer`) → the pool's lock; cache lock → the SSD store's write lock
(deletes). The writer threads never hold their queue's or the store's lock while taking ours. Page
moves (`_gather`, `_clear_row`) are planned under the cache lock and yielded (`taking`'s steps,
`PageMoves`); the driver copies them without it (`Cache._off_loop`: a worker thread) and
`end_moves` finishes them under it. Never under the pool's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import NamedTuple, TypeVar

from kvtier.core.types import Tier
from kvtier.core.units import format_bytes
from kvtier.core.wear import WriteBudget
from kvtier.daemon.cache.applier import Applier
from kvtier.daemon.cache.events import EventLog
from kvtier.daemon.cache.namespaces import Namespace, Namespaces
from kvtier.daemon.cache.quarantine import Quarantine
from kvtier.daemon.cache.remote_tier import RemoteTier, RemoteWrite
from kvtier.daemon.cache.spec import CacheSpec, SsdTier
from kvtier.daemon.cache.spec import RemoteTier as RemoteTierConfig
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.rates.book import Link, RateBook
from kvtier.index import placement
from kvtier.index.prefix import Block, IndexStateError, PrefixIndex
from kvtier.tiers import blockfmt
from kvtier.tiers.dram import DramPool, SlotMove
from kvtier.tiers.dram_keep import Keeper, KeptBlock
from kvtier.tiers.mover import Mover, MoverSpec, Submitted, WriteBack
from kvtier.tiers.ssd.store import PutResult, SsdEntry, SsdStore, open_store

IndexBlock = Block[Namespace]
"""A block of the daemon's index, whose namespaces are `Namespace`s."""

log = logging.getLogger(__name__)

_UNSEEN = Namespace("", b"")  # `_rebuild`'s "not parsed yet" marker

"""The SSD store's own layout tag; each block's namespace (tenant + layout id) is in its key."""


class Residency:
    def __init__(
        self, spec: CacheSpec, metrics: DaemonMetrics, events: EventLog, rates: RateBook,
        lock: threading.RLock, names: Namespaces, keeper: Keeper | None = None,
    ) -> None:
        self.spec = spec
        self.metrics = metrics
        self.events = events
        self.rates = rates
        self._lock = lock
        self.names = names  # tenants' usage (charged only by the applier), quotas, shares
        self.slot_bytes = spec.pool.slot_size  # the smallest slot: a block's default size
        self.pool = DramPool.create(spec.pool, keeper)
        # SSD blocks of every size: LMDB values (a slot file has one slot size) bounded in bytes
        # by `_make_ssd_room`; the index bounds their count at the smallest block's. A pool of
        # one size (slot_bytes == max_block_bytes) keeps the slot file.
        self.ssd_block_bytes = self.slot_bytes + blockfmt.HEADER_SIZE
        ssd_blocks = spec.ssd_bytes // self.ssd_block_bytes
        self.index: PrefixIndex[Namespace] = PrefixIndex(
            dram_blocks=self.pool.slot_ids, ssd_blocks=ssd_blocks,
            admission_k=spec.ssd_admit_after, policy=spec.policy, journal=True,
        )
        self.pool.owner = self.index  # the index's block pins are the only pins
        self.applier = Applier(self.index, self.pool, names, events, metrics, self.ssd_bytes_of,
                               lambda ns: self.block_bytes.get(ns, self.slot_bytes))
        self.held: list[Held] = []  # what a dead daemon's leases hold (`_adopt_dram`)
        self.held_slots = 0  # slots among them held for a dead daemon's writers
        self.adopted = ""  # the start log's line about a kept DRAM pool ("" if none)
        self.quarantine = Quarantine(self.index, self.applier.apply, metrics)
        self.stale: set[tuple[Namespace, bytes]] = set()  # DRAM blocks of a retired tenant file
        self.moved = 0  # blocks moved to free a page for another size class
        self.moving = 0  # target slots of page moves in flight (claimed, no block yet)
        self.store: SsdStore | None = None
        self.mover: Mover[Namespace] | None = None
        self.budget: WriteBudget | None = None
        self._queued: set[tuple[Namespace, bytes]] = set()
        self._read_lock = threading.Lock()  # one promotion batch at a time (exact corrupt counts)
        self.claimed = 0  # slots claimed for promotions not yet settled or unclaimed
        self.block_bytes: dict[str, int] = {}  # namespace -> payload bytes (from its layout)
        self.remote: RemoteTier | None = None
        try:
            if spec.ssd is not None:
                self._open_ssd(spec.ssd)
            self._adopt_dram()
            if spec.remote is not None:
                self.remote = _open_remote(spec.remote, self.pool, rates, metrics,
                                           self.on_remote_written)
        except BaseException:
            # never leave a fresh segment behind; an adopted one stays for the next start
            self.close(0.0, keep=self.pool.adopted is not None)
            raise

    def apply(self, why: str = "capacity", publish: bool = True) -> None:
        """`Applier.apply`; then the doomed blocks (an operator's evict) that nothing holds any
        more go (`PrefixIndex.reap`), the `stale` blocks no pin holds leave DRAM, and the
        quarantined subtrees no pin holds any more leave every tier (`Quarantine.retry`)."""
        self.applier.apply(why, publish)
        if self.index.reap_due:
            self.index.reap()
            self.applier.apply("operator", publish)
        if self.stale:
            self.drop_stale()
            self.applier.apply("rekeyed", publish)
        if self.quarantine.pending:
            self.quarantine.retry()

    def rekey(self, tenant: str) -> None:
        """A reload changed or revoked `tenant`'s token (isolated pool): what it stores from
        now on goes to a fresh file under fresh class ids (`DramPool.retire_tenant`), and its
        blocks in the old file leave DRAM now, or when the last pin on them goes (they stay on
        SSD or the remote tier where written back): a client holding the old file's fd sees
        no block stored after this. Call with the lock held."""
        if not self.pool.retire_tenant(tenant):
            return
        pool = self.pool
        for b in self.index.iter_blocks():
            slot = b.dram_slot
            if slot is not None and b.ns.tenant == tenant and pool.slot_stale(slot):
                self.stale.add((b.ns, b.key))
        self.apply()

    def _before_stale(self, ns: Namespace, blocks: list[IndexBlock]) -> list[IndexBlock]:
        """The blocks of a chain (root first) before its first `stale` one: a block of a
        retired region is leaving DRAM, and with it what hangs under it, so nothing from there
        on is pinned or written back (an `apply` inside the write-back loops may drop them)."""
        if not self.stale:
            return blocks
        for i, b in enumerate(blocks):
            if (ns, b.key) in self.stale:
                return blocks[:i]
        return blocks

    def drop_stale(self) -> None:
        """Drops the `stale` blocks no pin holds (a DRAM-only one with children takes its
        subtree: they cannot be reached without it); a pinned one waits for its release."""
        index, pool = self.index, self.pool
        for name, key in list(self.stale):
            b = index.get(name, key)
            slot = None if b is None else b.dram_slot
            if b is None or slot is None or not pool.slot_stale(slot):
                self.stale.discard((name, key))
                continue
            if b.pins:
                continue
            try:
                if b.children and not b.on_ssd:
                    index.remove_subtree(name, key)
                else:
                    index.drop(name, key, Tier.DRAM)
            except IndexStateError:
                continue  # a pinned descendant: again at its release
            self.stale.discard((name, key))

    # -- SSD ----------------------------------------------------------------------------------

    def _open_ssd(self, ssd: SsdTier) -> None:
        self.store_path = ssd.store.path
        opened = open_store(ssd.store)
        self.store = self.applier.store = opened.store
        if opened.moved_aside:
            self.metrics.ssd_damage.labels("store_moved_aside").inc()
        damaged = self.store.counters.undecodable + self.store.dropped_at_open.damaged
        if damaged:
            self.metrics.ssd_damage.labels("undecodable_entry").inc(damaged)
        self.budget = WriteBudget(ssd.write_bytes_per_day, ssd.write_burst_bytes)
        self.mover = Mover(self.pool, self.store, self.budget,
                           MoverSpec(queue_bytes=ssd.queue_bytes),
                           on_written=self.on_written)
        self._rebuild(opened.entries)

    def _rebuild(self, entries: list[SsdEntry]) -> None:
        """Re-enters every stored block into the index (parents first); drops stranded ones."""
        assert self.store is not None
        started = time.monotonic()
        by_ns: dict[Namespace, dict[bytes, bytes | None]] = {}
        foreign: list[tuple[str, bytes]] = []
        parsed: dict[str, Namespace | None] = {}
        for e in entries:
            ns = parsed.get(e.ns, _UNSEEN)
            if ns is _UNSEEN:
                ns = parsed[e.ns] = Namespace.parse(e.ns)
            if ns is None:
                foreign.append((e.ns, e.key))
                continue
            by_ns.setdefault(ns, {})[e.key] = e.parent
            self.block_bytes.setdefault(ns, e.size - blockfmt.HEADER_SIZE)
        if foreign:
            log.warning("SSD tier: dropping %d stored blocks of %d namespaces without a model id "
                        "(stored before namespaces carried one; never served)", len(foreign),
                        len({ns for ns, _ in foreign}))
            self.store.delete_many(foreign)
        doomed: list[tuple[str, bytes]] = []
        room, no_room = self.spec.ssd_bytes, False  # the byte cap (it may have shrunk)
        for ns, parents in by_ns.items():
            kids: dict[bytes, list[bytes]] = {}
            stack: list[bytes] = []
            for key, parent in parents.items():
                if not parent:
                    stack.append(key)
                elif parent in parents:
                    kids.setdefault(parent, []).append(key)
            cost = self.ssd_bytes_of(ns)
            while stack:
                key = stack.pop()
                if cost > room:
                    no_room = True
                    continue  # over the byte cap (the config shrank): it and its subtree go
                try:
                    self.index.insert(ns, key, parents[key] or None, Tier.SSD)
                except IndexStateError:
                    no_room = True
                    continue  # over the block count: the same
                room -= cost
                stack.extend(kids.get(key, ()))
            doomed.extend((ns, k) for k in parents if self.index.get(ns, k) is None)
        self.apply(publish=False)  # charges the tenants; nobody subscribes before serving
        shrunk = self.store.dropped_at_open
        if shrunk.shrunk_blocks or no_room:
            evicted = shrunk.shrunk_blocks + len(doomed)
            size = shrunk.shrunk_bytes + sum(self.ssd_bytes_of(ns) for ns, _ in doomed)
            log.warning("SSD tier shrank to %s (ssd_bytes): evicted %d stored blocks (%s) that "
                        "no longer fit, with their descendants; %d kept",
                        format_bytes(self.spec.ssd_bytes), evicted, format_bytes(size),
                        len(entries) - len(doomed) - len(foreign))
        elif doomed:
            log.warning("SSD tier: dropping %d stored blocks without a cached parent or room",
                        len(doomed))
        if doomed:
            self.store.delete_many(doomed)
        self._give_back_disk()
        log.info("SSD tier: %d blocks indexed in %.2f s", len(entries) - len(doomed) - len(foreign),
                 time.monotonic() - started)

    def _give_back_disk(self) -> None:
        """A tier that shrank: its store's file is rewritten to the new reservation, and a line
        says what that gave back (or, when it cannot be, what stays taken and how to free it)."""
        assert self.store is not None
        try:
            done = self.store.give_back()
        except OSError as exc:
            log.warning("SSD tier: its file still holds the disk of the larger size it had "
                        "(compacting it failed: %s); stop the daemon and remove %s to free it "
                        "(the SSD tier then starts empty)", exc, self.store_path)
            return
        if done is not None:
            before, after = done
            log.warning("SSD tier: its file now reserves %s (was %s): gave back %s of disk",
                        format_bytes(after), format_bytes(before), format_bytes(before - after))
    # -- a kept DRAM pool --------------------------------------------------------------------

    def _adopt_dram(self) -> None:
        """Enters the blocks of the DRAM pool a dead daemon kept (`DramPool.adopted`) into the
        index, parents first (a block whose parent is in no tier, or that repeats a key, is
        dropped and its slot freed); charges their tenants. A block a dead daemon's READ lease
        held stays pinned, and a slot its WRITE lease held stays taken, until that lease's
        deadline (`release_held`): its holder may still be copying. Cache lock not needed
        (start)."""
        kept, pool = self.pool.adopted, self.pool
        if kept is None:
            if pool.cold:
                log.warning("DRAM tier starts cold: %s", pool.cold)
            return
        started = time.monotonic()
        chains: dict[Namespace, dict[bytes, KeptBlock]] = {}
        spaces: dict[tuple[str, bytes], Namespace] = {}
        dropped = 0
        for b in kept.blocks:
            ns = spaces.get((b.tenant, b.layout_id))
            if ns is None:
                ns = spaces[b.tenant, b.layout_id] = Namespace(b.tenant, b.layout_id)
            size = self.block_bytes.setdefault(ns, b.nbytes)
            mine = chains.setdefault(ns, {})
            if b.key in mine or size != b.nbytes:
                pool.free(b.slot)
                dropped += 1
                continue
            mine[b.key] = b
        now, holds = time.monotonic(), dict[float, Held]()
        adopted = nbytes = 0
        charged: dict[str, int] = {}
        index, on_ssd = self.index, self.store is not None  # (no SSD tier: no copy to meet)
        for ns, blocks in chains.items():
            kids: dict[bytes, list[bytes]] = {}
            stack: list[bytes] = []
            for key, b in blocks.items():
                if b.parent is None or (b.parent not in blocks and on_ssd
                                        and index.get(ns, b.parent) is not None):
                    stack.append(key)
                elif b.parent in blocks:
                    kids.setdefault(b.parent, []).append(key)
            placed: set[bytes] = set()
            while stack:
                b = blocks[stack.pop()]
                try:
                    if on_ssd and index.get(ns, b.key) is not None:
                        index.add_tier(ns, b.key, Tier.DRAM, dram_slot=b.slot)
                    else:
                        index.insert(ns, b.key, b.parent, Tier.DRAM, dram_slot=b.slot)
                except IndexStateError:
                    continue
                placed.add(b.key)
                charged[ns.tenant] = charged.get(ns.tenant, 0) + b.stride
                adopted += 1
                nbytes += b.nbytes
                if b.held_until > now:
                    self.index.pin(ns, b.key)
                    holds.setdefault(b.held_until, Held(b.held_until, [], [])).blocks.append(
                        (ns, b.key))
                stack.extend(kids.get(b.key, ()))
            for key, b in blocks.items():
                if key not in placed:
                    pool.free(b.slot)
                    dropped += 1
        for slot, stride, tenant, until in kept.writing:
            self.applier.take_slots(tenant, stride)
            holds.setdefault(until, Held(until, [], [])).slots.append((tenant, slot))
            self.held_slots += 1
        self.held = sorted(holds.values(), key=lambda h: h.until)
        for tenant, n in charged.items():
            self.applier.take_slots(tenant, n)
        self.applier.recording = False  # their records are there already
        try:
            self.apply(publish=False)
        finally:
            self.applier.recording = True
        pinned = sum(len(h.blocks) for h in self.held)
        self.adopted = (
            f"DRAM tier adopted from the previous daemon: {adopted} blocks "
            f"({format_bytes(nbytes)}) in {pool.adopt_s + time.monotonic() - started:.2f} s"
            + (f"; {dropped} dropped (no cached parent, or a repeated key)" if dropped else "")
            + (f"; {pinned} blocks and {self.held_slots} slots held until the previous "
               "daemon's leases on them end" if self.held else "")
            + (f"; {pool.cold}" if pool.cold else ""))
        log.info("%s", self.adopted)

    def release_held(self, now: float | None = None) -> int:
        """Ends what a dead daemon's leases held whose deadline passed (`_adopt_dram`): their
        blocks unpinned, their write slots freed. Returns how many holds ended. Cache lock
        held."""
        now = time.monotonic() if now is None else now
        done = 0
        while self.held and self.held[0].until <= now:
            h = self.held.pop(0)
            for ns, key in h.blocks:
                if self.index.get(ns, key) is not None:
                    self.index.unpin(ns, key)
            for tenant, slot in h.slots:
                self.give_back(tenant, slot)
                self.held_slots -= 1
            done += 1
        if done:
            self.apply()
        return done

    def ssd_bytes_of(self, ns: str) -> int:
        """Stored bytes of one block of this namespace (payload + header)."""
        return self.block_bytes.get(ns, self.slot_bytes) + blockfmt.HEADER_SIZE

    def dram_bytes_of(self, ns: str) -> int:
        """DRAM one block of this namespace takes: its size class's slot stride."""
        return self.pool.stride_for(self.block_bytes.get(ns, self.slot_bytes))

    def maybe_write_back(self, ns: Namespace, blocks: list[IndexBlock]) -> None:
        """Queues the write-backs the planner calls for (`placement.write_backs`: admitted
        DRAM-only blocks of a looked-up or committed chain, root first), each after SSD room
        (`placement.ssd_room`, then the byte bound), the tenant's SSD quota and the wear budget
        (in `Mover.submit`); stops at the first that fails."""
        mover = self.mover
        if mover is None:
            return
        blocks = self._before_stale(ns, blocks)
        for w in placement.write_backs(self.index, ns, blocks, _Queued(ns, self._queued)):
            assert w.slot is not None  # every daemon DRAM block has a slot
            tenant, cost = ns.tenant, self.ssd_bytes_of(ns)
            if not self._make_ssd_room(1 + len(self._queued), cost):
                self.metrics.writeback_dropped.inc()
                return
            if not self.names.ssd_quota_ok(tenant, cost):
                self.metrics.writeback_dropped.inc()
                return
            nbytes = self.block_bytes.get(ns, self.slot_bytes)
            self.index.pin(ns, w.key)
            got = mover.submit(WriteBack(ns, w.key, w.parent, w.slot, nbytes))
            if got is Submitted.QUEUED:
                self._queued.add((ns, w.key))
                self.applier.reserve_ssd(ns)  # until written or refused
                continue
            self.index.unpin(ns, w.key)
            if got is Submitted.ALREADY_STORED:
                try:
                    self.index.add_tier(ns, w.key, Tier.SSD)
                    self.apply()
                    continue
                except IndexStateError:
                    return
            self.metrics.writeback_dropped.inc()
            return

    def _make_ssd_room(self, need: int, nbytes: int) -> bool:
        """Room on SSD for `need` blocks (the queued ones included) and `nbytes` more bytes on
        top of what is stored and queued: SSD victims in the index's order until both fit."""
        ok = placement.ssd_room(self.index, need)
        self.apply("capacity")
        if not ok:
            return False
        if self.store is None:
            return True
        # the index's SSD bytes (kept by the applier), not the store's: a batch the writer
        # thread has stored but not yet reported would count twice, stored and queued
        queued = sum(self.ssd_bytes_of(ns) for ns, _ in self._queued)
        over = self.applier.ssd_bytes + queued + nbytes - self.spec.ssd_bytes
        while over > 0:
            before = self.applier.ssd_bytes
            if not self.index.evict_count(Tier.SSD, 1):
                return False
            self.apply("capacity")
            over -= before - self.applier.ssd_bytes
        return True

    def on_written(self, batch: list[WriteBack[Namespace]], result: PutResult) -> None:
        """Mover callback (writer thread): record SSD copies, unpin, account."""
        stored = set(result.stored)
        undo: list[tuple[str, bytes]] = []
        with self._lock:
            for w in batch:
                self._queued.discard((w.ns, w.key))
                if self.index.get(w.ns, w.key) is None:  # cannot happen: it was pinned
                    continue
                self.index.unpin(w.ns, w.key)
                # the reservation ends; the applier charges the copy the index now records
                self.applier.unreserve_ssd(w.ns)  # as queued
                if (w.ns, w.key) not in stored:
                    self.metrics.writeback_dropped.inc()
                    continue
                try:
                    self.index.add_tier(w.ns, w.key, Tier.SSD)
                except IndexStateError:  # parent's copy was refused: keep SSD prefix-closed
                    undo.append((w.ns, w.key))
            self.apply()
            if undo and self.store is not None:
                self.store.delete_many(undo)
        self.metrics.ssd_bytes_written.inc(result.bytes_written)
        self.metrics.bytes_moved.labels("ssd", "demote").inc(result.bytes_written)

    def claiming(self, ns: Namespace) -> Steps[int | None]:
        """A slot to promote one of `ns`'s SSD or remote blocks into (evicting for room),
        charged to its tenant; None when there is no room (or no tier below DRAM). Steps as
        `taking`'s."""
        if self.store is None and self.remote is None:
            return None
        nbytes = self.block_bytes.get(ns, self.slot_bytes)
        if nbytes > self.pool.max_block:  # stored before max_block_bytes shrank: not served
            return None
        slots = yield from self.taking(1, ns.tenant, nbytes)
        if not slots:
            return None
        self.claimed += 1
        return slots[0]

    def unclaim(self, ns: Namespace, slot: int) -> None:
        """Gives a claimed slot back (the read failed, or the block is no longer wanted)."""
        self.give_back(ns.tenant, slot)
        self.claimed -= 1

    def settle(self, ns: Namespace, block: IndexBlock, slot: int, nbytes: int) -> None:
        """The claimed slot holds the block's verified payload: it is the block's DRAM copy
        (journaled; the caller applies before it lets the lock go)."""
        self.index.add_tier(ns, block.key, Tier.DRAM, dram_slot=slot)
        self.claimed -= 1
        self.metrics.bytes_moved.labels("ssd", "promote").inc(nbytes)

    def read_claimed(self, reads: list[tuple[str, bytes, int]]) -> tuple[list[int | None], float]:
        """Reads and verifies SSD payloads into claimed slots, (namespace, key, slot) each: the
        payload bytes per read (None: gone or corrupt — counted) and the seconds the batch took.
        Call WITHOUT the cache lock, from any thread; batches are serialized among callers."""
        assert self.mover is not None and self.store is not None
        with self._read_lock:
            corrupt_before = self.store.counters.corrupt
            started = time.perf_counter()
            try:
                got = self.mover.promote_many(reads)
            except Exception:  # an I/O error is a miss for every block of the batch
                log.exception("SSD promotion read failed")
                got = [None] * len(reads)
            seconds = time.perf_counter() - started
            corrupt = self.store.counters.corrupt - corrupt_before
        if corrupt:
            self.metrics.checksum_failures.inc(corrupt)
        nbytes = sum(n for n in got if n)
        if nbytes:
            self.rates.observe_transfer(Link.SSD_READ, nbytes, seconds)
        return got, seconds

    def drop_lost(self, ns: Namespace, block: IndexBlock) -> None:
        """Forgets an SSD-only block whose payload failed to read, with its whole subtree (no
        descendant could ever hit again). If a descendant is pinned by a lease, the subtree
        stays until a later Acquire meets the lost block again; reads of it fail fast (the store
        remembers the bad key) and Acquire stops before it."""
        if block.in_dram or block.pins:
            return
        try:
            self.index.remove_subtree(ns, block.key)
        except IndexStateError:  # a pinned descendant
            return
        self.apply("checksum")

    # -- remote -------------------------------------------------------------------------------

    def maybe_write_remote(self, ns: Namespace, blocks: list[IndexBlock], committed: bool,
                           handoff: bool = False) -> None:
        """Offers admitted DRAM blocks to the remote tier's write queue: at Commit when
        `remote_admit_after` is 1, else at the lookup that makes a block's k-th access; a
        hand-off's (`handoff`: a prefill's blocks, marked pending in the store) every block, at
        once, as urgent writes. Each offered block stays pinned until `on_remote_written`."""
        remote, spec = self.remote, self.spec.remote
        if remote is None or spec is None:
            return
        k = spec.admit_after
        nbytes = self.block_bytes.get(ns, self.slot_bytes)
        todo = ([b for b in blocks if b.in_dram] if handoff
                else placement.remote_offers(self._before_stale(ns, blocks), committed, k))
        if handoff and len(todo) < len(blocks):
            remote.unmark_later(ns, [b.key for b in blocks if not b.in_dram])
        for i, b in enumerate(todo):
            assert b.dram_slot is not None
            self.index.pin(ns, b.key)
            why = remote.offer(RemoteWrite(ns, b.key, b.dram_slot, nbytes, handoff))
            if why:
                self.index.unpin(ns, b.key)
                # the rest would sit behind a hole in the store's chain: dropped too
                remote.dropped(why, len(todo) - i - 1)
                if handoff:
                    remote.unmark_later(ns, [b.key for b in todo[i:]])
                return

    def settle_remote(
        self, ns: Namespace, key: bytes, parent: bytes | None, slot: int,
    ) -> IndexBlock:
        """A claimed slot holds a verified remote payload: it becomes a new DRAM block (raises
        the index's DuplicateBlock / MissingParent / TierFull; the caller then unclaims).
        Journaled; the caller applies before it lets the lock go."""
        block = self.index.insert(ns, key, parent, Tier.DRAM, dram_slot=slot)
        self.claimed -= 1
        self.metrics.bytes_moved.labels("remote", "promote").inc(self.block_bytes.get(
            ns, self.slot_bytes))
        return block

    def on_remote_written(self, batch: list[RemoteWrite], stored: list[RemoteWrite]) -> None:
        """Remote writer callback (its thread): the blocks may move or go again; the ones the
        store took are published as stored in Tier.REMOTE."""
        with self._lock:
            for w in batch:
                if self.index.get(w.ns, w.key) is not None:
                    self.index.unpin(w.ns, w.key)
            self.applier.stored_remote([(w.ns, w.key) for w in stored])
            if self.stale or self.index.reap_due:  # blocks of a retired region, or evicted
                self.apply()                          # by an operator, this write held

    # -- DRAM ---------------------------------------------------------------------------------

    def give_back(self, tenant: str, slot: int) -> None:
        """Frees a slot that holds no block (an unfilled WRITE lease slot, an unsettled claim)
        and gives its bytes back to `tenant` (`Applier.give_back`)."""
        self.applier.give_back(tenant, slot)

    def taking(self, n: int, tenant: str, nbytes: int) -> Steps[list[int]]:
        """`n` free slots for `tenant`'s blocks of `nbytes`, charged to it (`Applier.take_slots`,
        until the applier or `give_back` frees them), evicting unpinned DRAM blocks as needed
        in the policy's order (in an isolated pool the tenant's own: `_own_room`);
        [] when impossible (when even every unpinned block would not make room, nothing is
        evicted). Slots come in size classes on pages (`kvtier.tiers.dram_pages`): a victim of
        another class frees a slot only that class can use, so before the first eviction and
        after each one the daemon tries to empty a page of every other class by moving its
        blocks into the free slots of its own class (`_gather`, `_free_a_page`; free slots that
        earlier victims left anywhere count), and eviction goes on in the policy's order until
        that or a free page serves `nbytes` blocks. A block
        larger than a page needs a row of adjacent pages: before each eviction the blocks of
        other classes on one row are moved into free slots and pages elsewhere when they fit
        (`_clear_row`), so no more is evicted than the new blocks need. In an isolated pool
        (tenants) the tenant's blocks have a class of their own (`DramPool.class_bytes`).

        A generator: each page move is planned here and yielded as `PageMoves` (targets claimed,
        targets pinned in the pool, the blocks pinned in the index); the driver copies the
        bytes — without the cache lock, on a worker thread, for the RPCs — calls `end_moves`
        with the lock held and resumes it (lock held), and the loop goes on from there. Its
        value (StopIteration) is the slots."""
        pool = self.pool
        nbytes = pool.class_bytes(nbytes, tenant)
        stride, cls = pool.class_stride(nbytes), pool.class_of(nbytes)
        wide = stride > pool.page_bytes  # its rows span pages: move blocks off a row first
        while wide and not pool.can_alloc(n, nbytes) and (yield from self._clear_row(nbytes)):
            pass
        if not pool.can_alloc(n, nbytes):
            yield from self._gather(stride, n, nbytes)
        slots = pool.alloc_many(n, nbytes)
        if slots is not None:
            self.applier.take_slots(tenant, n * stride)
            self.apply()
            return slots
        if pool.isolated:
            yield from self._own_room(tenant, n, nbytes)
            slots = pool.alloc_many(n, nbytes) or []
            if slots:
                self.applier.take_slots(tenant, n * stride)
            self.apply()
            return slots
        one_class = pool.strides() == {cls}
        if placement.room_hopeless(self.index, n, pool.room(nbytes),
                                   self._pinned_blocks(pool.slots_pinned()), one_class):
            return []
        while not pool.can_alloc(n, nbytes):
            # one class: a victim frees one slot (`placement.dram_room`); else one victim at a
            # time (`placement.class_victim`), each freeing a slot only its own class can use,
            # until a page empties
            if pool.strides() == {cls}:
                placement.dram_room(self.index, n, pool.room(nbytes),
                                    self._pinned_blocks(pool.slots_pinned()))
                self.apply("capacity")
                break
            if not placement.class_victim(self.index):
                break
            self.apply("capacity")
            while wide and not pool.can_alloc(n, nbytes) and (
                    yield from self._clear_row(nbytes)):
                pass
            yield from self._gather(stride, n, nbytes)
        slots = pool.alloc_many(n, nbytes) or []
        if slots:
            self.applier.take_slots(tenant, n * stride)
        self.apply()
        return slots

    def _own_room(self, tenant: str, n: int, nbytes: int) -> Steps[None]:
        """Isolated pool: room for `n` of `tenant`'s blocks of class `nbytes` in its region,
        which holds its blocks only: its own coldest unpinned DRAM blocks leave (all that are
        missing at once when its region has that class only; else one at a time, each then
        gathered with the free slots of its class), until the blocks fit or none can go."""
        pool = self.pool
        stride, cls = pool.class_stride(nbytes), pool.class_of(nbytes)
        wide = stride > pool.page_bytes
        while not pool.can_alloc(n, nbytes):
            want = n - pool.room(nbytes) if pool.strides(nbytes) <= {cls} else 1
            if not self.evict_tenant_dram(tenant, max(1, want), "capacity"):
                return
            while wide and not pool.can_alloc(n, nbytes) and (
                    yield from self._clear_row(nbytes)):
                pass
            yield from self._gather(stride, n, nbytes)

    def _pinned_blocks(self, slots_pinned: int) -> int:
        """DRAM blocks that cannot leave now, from the pool's pinned slots: less the targets
        of page moves in flight (pinned slots that hold no block yet)."""
        return slots_pinned - self.moving

    def _gather(self, stride: int, n: int, nbytes: int) -> Steps[None]:
        """Free slots other classes hold (left by earlier victims): empties a page of each
        class that can move its blocks into its own free slots (`_free_a_page`), until `n`
        blocks of `nbytes` fit — moving, not evicting."""
        mine = self.pool.class_of(nbytes)
        for c in sorted(self.pool.strides(nbytes) - {mine}):
            if self.pool.can_alloc(n, nbytes):
                return
            yield from self._free_a_page(c, stride)

    def _movable(self) -> dict[int, IndexBlock]:
        """DRAM slot -> its block, for the blocks no lease, write-back, remote write or page
        move holds (those a move may relocate)."""
        owners: dict[int, IndexBlock] = {}
        for b in self.index.iter_blocks():
            s = b.dram_slot
            if s is not None and not b.pins:
                owners[s] = b
        return owners

    def _clear_row(self, nbytes: int) -> Steps[bool]:
        """Frees the pages of one row for blocks of `nbytes` larger than a page by moving the
        blocks of other classes on them (`DramPool.plan_row`); False when none can be."""
        owners = self._movable()
        moves = self.pool.plan_row(nbytes, owners.__contains__)
        if not moves:
            return False
        yield self._moving(moves, owners)
        return True

    def _free_a_page(self, stride: int, want: int = 0) -> Steps[bool]:
        """Empties one page of class `stride` by moving its blocks (DRAM blocks no lease,
        write-back or remote write holds) into the class's free slots elsewhere; the page is
        for class `want` (0: any)."""
        if not self.pool.can_evacuate(stride):
            return False
        owners = self._movable()
        moves = self.pool.plan_evacuation(stride, owners.__contains__, want)
        if moves is None:
            return False
        if moves:
            yield self._moving(moves, owners)
        return True

    def _moving(self, moves: list[SlotMove], owners: dict[int, IndexBlock]) -> PageMoves:
        """Pins the blocks of planned moves in the index (no eviction, no write to their old
        slots, a lease-free check at the end) and counts their targets as in flight."""
        blocks = [owners[m.old] for m in moves]
        for b in blocks:
            self.index.pin(b.ns, b.key)
        self.moving += len(moves)
        return PageMoves(moves, blocks)

    def end_moves(self, p: PageMoves) -> None:
        """Cache lock held, after `DramPool.copy_moves`: each block whose only pin is the move's
        now lives in its new slot and its old one is freed (a page empties when every slot left
        it); a block a lease or a write pinned meanwhile — a reader may hold its old offset —
        stays, and its target is given back."""
        done = 0
        for m, b in zip(p.moves, p.blocks, strict=True):
            self.index.unpin(b.ns, b.key)
            moved = not b.pins and b.dram_slot == m.old
            if moved:
                self.index.move_dram(b.ns, b.key, m.new)
                done += 1
            self.pool.end_move(m, moved)
        self.moving -= len(p.moves)
        if done:
            self.moved += done
            self.metrics.dram_moved_blocks.inc(done)
        self.apply()

    def evict_tenant_dram(self, tenant: str, n: int, reason: str = "quota") -> int:
        """Evicts up to `n` of one tenant's DRAM blocks, coldest first (quota, its region);
        O(evictable blocks) per block of the longest chain it shortens."""
        done = 0
        while done < n:
            mine = placement.tenant_victims(self.index, _tenant_of, tenant, n - done)
            if not mine:
                break
            for b in mine:
                self.index.drop(b.ns, b.key, Tier.DRAM)
            self.apply(reason)
            done += len(mine)
        return done

    # -- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        ok = self.mover.flush(timeout) if self.mover is not None else True
        return (self.remote.flush(timeout) if self.remote is not None else True) and ok

    def close(self, timeout: float, keep: bool = False) -> None:
        """Flushes the write-back queues, closes LMDB and the remote connection, unlinks the
        segment (`keep`: leaves the pool to a successor, `DramPool.close`). Call without the
        lock."""
        if self.remote is not None:
            self.remote.close(timeout)
        if self.mover is not None:
            self.mover.close(timeout)
        if self.store is not None:
            self.store.close()
        self.pool.close(keep)


T = TypeVar("T")
Steps = Generator["PageMoves", None, T]
"""A residency operation that may stop for page moves: it yields each batch (`PageMoves`) and
is resumed, cache lock held, once the driver copied it and called `Residency.end_moves`."""


class Held(NamedTuple):
    """What a dead daemon's leases that end at `until` held: blocks (pinned) and write slots
    (taken, with their tenant)."""

    until: float
    blocks: list[tuple[Namespace, bytes]]
    slots: list[tuple[str, int]]


class PageMoves(NamedTuple):
    """Page moves planned under the cache lock (`Residency.taking`): the pool's moves (targets
    claimed and pinned) and the block of each (pinned in the index)."""

    moves: list[SlotMove]
    blocks: list[IndexBlock]


class _Queued:
    """One namespace's keys among the queued write-backs, for `placement.write_backs`."""

    __slots__ = ("ns", "queued")

    def __init__(self, ns: Namespace, queued: set[tuple[Namespace, bytes]]) -> None:
        self.ns = ns
        self.queued = queued

    def __contains__(self, key: object) -> bool:
        return (self.ns, key) in self.queued


def _tenant_of(ns: Namespace) -> str:
    """The tenant of a namespace of the index (`placement.tenant_victims`'s owner)."""
    return ns.tenant


def _open_remote(
    spec: RemoteTierConfig, pool: DramPool, rates: RateBook, metrics: DaemonMetrics,
    on_written: Callable[[list[RemoteWrite], list[RemoteWrite]], None],
) -> RemoteTier:
    from kvtier.tiers.remote import RemoteStore

    tier = RemoteTier(RemoteStore(spec.store), pool, rates, metrics.registry, spec.writes,
                      on_written)
    try:
        tier.store.ping()
        log.info("remote tier: %s (%s)", tier.store.where(), spec.mode)
    except Exception as exc:  # a store down at start is an outage, not a failed start
        tier.backoff.failed()
        tier.metrics.outages.inc()
        log.warning("remote store unavailable at start; local tiers only, retrying with "
                    "backoff: %s", exc)
    return tier

