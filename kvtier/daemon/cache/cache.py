"""The daemon's domain logic: layouts, namespaces, blocks, leases, quotas and eviction. No gRPC.

Every block lives in a namespace (tenant, layout id = H(model id, layout fingerprint)): the same
key bytes in two namespaces are two blocks, so neither a tenant nor a model (of the same layout)
can see or overwrite another's blocks whatever keys it sends. A block is in DRAM (a slot of the
shared pool), on SSD, or both.

    Allocate ─▶ WRITE lease (slots, not yet visible) ─▶ Commit ─▶ block in DRAM ─▶ (write-back) SSD
                                                  └──▶ Abort / TTL ─▶ slots freed
    Lookup ─▶ Acquire ─▶ READ lease (blocks pinned; SSD blocks promoted to DRAM) ─▶ Release / TTL

Rules enforced here (each raises a `CacheError` subclass and changes nothing):
- the layout must be registered; key width, counts and sizes must match it;
- a lease can only be used by the tenant that holds it, and only for its kind;
- DRAM/SSD quotas per tenant; a full pool evicts unpinned blocks in the policy's order — with
  tenants, each its own in its own slice of the pool (`kvtier.tiers.dram_regions`) — or refuses.

Invariants kept:
- a pinned block is never evicted, moved or rewritten (the DramPool asks the index: its slot
  is pinned while the block is, `DramPool.owner`);
- no stranded blocks: a block leaves its last tier only when it has no cached children
  (leaf-first), and a block is committed only if its parent is still cached;
- every slot is owned by exactly one of: the free list, a WRITE lease, a cached block — leases
  that end (released, committed, aborted, expired) give back what they held exactly once.

`Cache` is the facade that takes the lock, validates requests against namespaces and owns the lease
table (who may use a lease, TTLs, expiry); the work is in its parts: `kvtier.daemon.cache.acquire`
(the load path), `kvtier.daemon.cache.allocate` (the store path), `kvtier.daemon.cache.residency`
(the tiers), `kvtier.daemon.cache.applier` (what a residency change entails) and
`kvtier.daemon.cache.stats` (what it reports).

Locks, outermost first (a thread holding one only ever takes those below it):

    1. the cache lock (`Cache._lock`, an RLock shared with Residency, the Applier, Acquire's
       condition and the slot streams): the index, the pool's ownership, leases, tenants
    2. a write queue's lock (`SlotWriteQueue._cv`, the mover's and the remote tier's): `offer`,
       taken with 1 held; the write budget is asked under it
    3. the DRAM pool's lock (`DramPool._lock`): taken with 1 and/or 2 held, takes nothing (it
       asks the index whether a slot's block is pinned, `DramPool.owner`: no lock there);
       page moves copy slot bytes under neither 1 nor 3 (`DramPool.copy_moves` on a worker
       thread, `_off_loop`)
    4. the SSD store's write lock (`SsdStore._wlock`): with 1 held (the applier's deletes, the
       rebuild) or on the writer thread with nothing held; takes only the store's inner locks
    5. the event log's lock (`EventLog._lock`): with 1 held (the applier); its sink only queues

Taken with none of these held and taking none: the MRC sampler's lock (`_mrc_lock`), the
promotion read lock (`Residency._read_lock`, then store reads, which take no store lock), the rate
books' and the metrics' locks (leaves, from anywhere). The writer threads take 1 only in their
completion callbacks (`Residency.on_written`, `on_remote_written`), holding neither 2 nor 4 then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TypeVar, cast

from kvtier.core.costmodel import CostModel
from kvtier.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvtier.core.planner import Prefix, plan
from kvtier.core.types import Tier
from kvtier.core.wear import WriteBudget
from kvtier.daemon.cache.acquire import (
    NOT_ASKED,
    Acquirer,
    Acquiring,
    ReadLease,
    RemoteCheck,
)
from kvtier.daemon.cache.allocate import Allocator, WriteLease, quota_room
from kvtier.daemon.cache.api import (
    AcquireResult,
    AllocateResult,
    CacheStats,
    EvictResult,
    LookupResult,
    PinInfo,
    PinResult,
    PrefetchResult,
    Quarantined,
    Registered,
    Scope,
    SegmentView,
)
from kvtier.daemon.cache.control import Control, describe, no_layout
from kvtier.daemon.cache.events import EventLog
from kvtier.daemon.cache.leases import Lease, LeaseKind, LeaseTable
from kvtier.daemon.cache.namespaces import (
    LayoutInfo,
    Namespace,
    NamespaceInfo,
    Namespaces,
    Tenant,
)
from kvtier.daemon.cache.pending import WriteWaits
from kvtier.daemon.cache.pins import PinTable
from kvtier.daemon.cache.quarantine import RemoteDeletes, Removed
from kvtier.daemon.cache.remote_tier import RemoteTier
from kvtier.daemon.cache.residency import PageMoves, Residency, Steps
from kvtier.daemon.cache.slot_stream import LeasedSlots
from kvtier.daemon.cache.spec import CacheSpec
from kvtier.daemon.cache.stats import cache_stats, mrc_gauges, new_sampler, pool_gauges
from kvtier.daemon.metrics import DaemonMetrics, MrcGauges, PoolGauges
from kvtier.daemon.rates.book import Link, RateBook
from kvtier.daemon.rates.gauges import RateCollector
from kvtier.daemon.rates.tenants import TenantRates
from kvtier.tiers.blockfmt import HEADER_SIZE as BLOCK_HEADER
from kvtier.tiers.dram_keep import Keeper
from kvtier.tiers.dram_regions import TenantShare

log = logging.getLogger(__name__)

T = TypeVar("T")


def _check_reported(nbytes: int, most: int) -> None:
    if nbytes > most:
        raise InvalidArgument(f"reported {nbytes} bytes copied; the lease covers {most}")


MAX_DETAIL = 1024
"""Characters of a verification report's detail the daemon takes (it goes into one log line)."""


def _printable(text: str) -> str:
    """`text` safe for one log line: control characters (newlines: a forged line) as '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


_NO_REPLICA = "-"  # never registered (real names contain the namespace): lookups without HBM


def dram_shares(tenants: Iterable[Tenant]) -> list[TenantShare]:
    """What each tenant may hold in DRAM, as the pool slices it (`DramPool.set_tenants`)."""
    return [TenantShare(t.name, t.dram_quota_bytes, t.dram_guarantee_bytes) for t in tenants]


class Cache:
    """Owns all block metadata and the tiers. See the module docstring for the rules."""

    def __init__(
        self, spec: CacheSpec, metrics: DaemonMetrics, events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic, rates: RateBook | None = None,
        keeper: Keeper | None = None,
    ) -> None:
        """`keeper`: with `spec.pool.keep`, what the daemon found of a pool a dead daemon kept
        (`kvtier.tiers.dram_keep`): its blocks are adopted (`Residency._adopt_dram`)."""
        self.spec = spec
        self.metrics = metrics
        self.events = events or EventLog()
        self.rates = rates if rates is not None else RateBook()
        self.tenant_rates = TenantRates(self.rates)
        self.draining = False
        self._closed = False
        self._lock = threading.RLock()
        self._mrc_lock = threading.Lock()  # the MRC sampler's own: off the cache lock
        self._leases = LeaseTable(clock)
        self.names = Namespaces(spec.max_block_bytes, spec.max_blocks_per_request)
        self.residency = Residency(spec, metrics, self.events, self.rates, self._lock, self.names,
                           keeper)
        self.pool = self.residency.pool
        self.names.max_block_bytes = self.pool.max_block  # a small pool's pages may be smaller
        self.index = self.residency.index
        self.acquirer = Acquirer(self._lock, self.residency, self._leases, metrics, self.rates,
                                 self._claim)
        self.allocator = Allocator(self.residency, self._leases)
        self.waits = WriteWaits()  # Lookups waiting for other clients' writes (`pending.py`)
        metrics.attach_pool(self.gauges)
        metrics.attach(RateCollector(self.rates))
        self.pin_table = PinTable()
        self.control = Control(self.residency, self.names, self.pin_table, metrics,
                               self._leases.clock, spec.max_blocks_per_request,
                               spec.max_pin_ttl_s, self._end_writes)
        metrics.pinned_blocks.set_function(self._pinned)
        self.mrc = new_sampler(spec, self.index.capacity(Tier.SSD) or 0)
        self._sized_for: list[int] = []  # block sizes `_size_by_blocks` last saw
        self._sized_dram = spec.pool.slot_count  # DRAM blocks the MRC and the policy are sized for
        metrics.attach_mrc(self.mrc_gauges)
        self.residency.quarantine.on_removed = self._quarantine_removed
        self._remote_deletes = RemoteDeletes(self._lock, self._delete_remote,
                                             self._remote_deleted)

    def _delete_remote(self, ns: Namespace, keys: list[bytes]) -> int:
        remote = self.residency.remote
        return 0 if remote is None else remote.delete_quarantined(ns, keys)

    def register_layout(
        self, tenant: Tenant, model_id: str, fingerprint: bytes, block_bytes: int,
        block_tokens: int, key_width: int, cost: CostModel | None,
        groups: tuple[tuple[str, int], ...] = (),
    ) -> Registered:
        """Declares a model's layout for this tenant (idempotent); returns its layout id (what
        data requests name) and the segment clients map. See `Namespaces`."""
        with self._lock:
            info = self.names.register(tenant, model_id, fingerprint, block_bytes, block_tokens,
                                       key_width, cost, groups)
            sizes = sorted({i.block_bytes for i in self.names.layouts.values()})
        if sizes != self._sized_for:
            self._size_by_blocks(sizes)
        return Registered(info.id, self.pool.handle())

    def _size_by_blocks(self, sizes: list[int]) -> None:
        """The MRC and the policy count capacity in blocks, and a block's slot is its layout's
        size class: estimate the blocks each tier holds from the registered layouts' block
        sizes (their mean), not from the smallest slot, and re-size both when the estimate moves
        by more than a quarter (a new MRC sample starts; the policy's mini caches start again)."""
        self._sized_for = sizes
        stride = sum(map(self.pool.stride_for, sizes)) / len(sizes)
        dram = max(1, int(self.pool.stats().bytes_reserved // stride))
        ssd_cap = self.index.capacity(Tier.SSD)
        ssd = 0
        if ssd_cap:
            ssd = max(1, int(self.spec.ssd_bytes // (sum(sizes) / len(sizes) + BLOCK_HEADER)))
        if abs(dram - self._sized_dram) <= self._sized_dram // 4:
            return
        log.info("capacity in blocks for the MRC and the %s policy: DRAM %d, SSD %d (mean block "
                 "%d B over %d layout size(s))", self.spec.policy, dram, ssd,
                 sum(sizes) // len(sizes), len(sizes))
        self._sized_dram = dram
        with self._lock:
            self.index.resize_policy(dram)
        with self._mrc_lock:
            self.mrc = new_sampler(self.spec, ssd, dram)

    def layout(self, tenant: Tenant, layout_id: bytes) -> LayoutInfo:
        with self._lock:
            return self.names.layout(tenant, layout_id)

    @property
    def write_budget(self) -> WriteBudget | None:
        """The SSD tier's wear budget (a reload retunes it); None without an SSD tier."""
        return self.residency.budget

    @property
    def remote(self) -> RemoteTier | None:
        """The remote tier (a reload retunes its writes or replaces its store), if on."""
        return self.residency.remote

    def segment(self, tenant: Tenant, block_bytes: int = 0) -> SegmentView:
        """The pool as `tenant` maps it, on the grid of `block_bytes`' class (0: the smallest
        slot's)."""
        pool = self.pool
        stride = (pool.class_stride(pool.class_bytes(block_bytes, tenant.name)) if block_bytes
                  else pool.slot_stride)
        return SegmentView(pool.tenant_handle(tenant.name), stride, pool.isolated)

    def _ns(self, tenant: Tenant, layout_id: bytes) -> NamespaceInfo:
        ns = self.names.get(tenant, layout_id)
        self.residency.block_bytes.setdefault(ns.name, ns.layout.block_bytes)
        return ns

    # -- lookup, acquire, release -----------------------------------------------------------

    async def lookup_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int,
        start_token: int = 0, prompt_tokens: int = 0, want_plan: bool = False,
        replica: str = "", wait_s: float = 0.0,
    ) -> LookupResult:
        """Longest cached prefix with each block's tier: HBM only for blocks `replica` reported
        holding (ReportHbm), else DRAM or SSD — where the daemon would serve it from — then
        REMOTE for the blocks after it that the remote tier holds (asked on a worker thread,
        without the cache lock: a network round trip with a bounded wait). The miss-ratio curve
        sees the keys right after the reply is on its way (the loop's next callback: before any
        later request's handler, so a Stats after this Lookup counts it). With `wait_s`, first
        waits (bounded) for blocks after the cached prefix that another client is still
        writing (`_wait_pending`)."""
        if wait_s > 0:
            self.metrics.pending_waiting.inc()
            try:
                await self._wait_pending(tenant, layout_id, keys, key_width, wait_s)
            finally:
                self.metrics.pending_waiting.dec()
        ns, chain, tiers = self._lookup_local(tenant, layout_id, keys, key_width, replica)
        asyncio.get_running_loop().call_soon(self._observe, ns.name, keys, key_width)
        remote = self.residency.remote
        if remote is not None and len(tiers) < len(chain) and remote.ready():
            more = await asyncio.to_thread(self._remote_present, ns, chain, len(tiers))
            tiers += [Tier.REMOTE] * more
        return self._lookup_result(ns, chain, tiers, start_token, prompt_tokens, want_plan)

    async def _wait_pending(self, tenant: Tenant, layout_id: bytes, keys: bytes,
                            key_width: int, wait_s: float) -> None:
        """Waits, up to `wait_s` (at most `max_pending_wait_s`), while the first block after
        the cached prefix of `keys` is being written: here, by another WRITE lease (until it
        commits — then looks again —, ends without committing, or the bound: `pending.py`),
        else, with a remote tier, marked pending there by another daemon's hand-off
        (`RemoteTier.wait_written`, on a worker thread). Nothing is counted as a lookup here;
        each wait is metered (`kvtier_pending_waits_total{tier, result}`, its seconds)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + min(wait_s, self.spec.max_pending_wait_s)
        outcome = ""
        while True:
            with self._lock:
                ns = self._ns(tenant, layout_id)
                chain = self.names.split_keys(ns, keys, key_width, unique=False)
                hit = len(self.index.lookup(ns.name, chain, touch=False).blocks)
                lease = ns.pending.get(chain[hit]) if hit < len(chain) else None
                fut = self.waits.wait(lease) if lease is not None else None
            if fut is None or lease is None:
                break
            try:
                left = deadline - loop.time()
                if left > 0:
                    await asyncio.wait({fut}, timeout=left)
            finally:
                if not fut.done():
                    with self._lock:
                        self.waits.forget(lease, fut)
            if not fut.done():
                outcome = "timeout"
                break
            outcome = "committed" if fut.result() else "aborted"
            if outcome == "aborted":
                break
        if outcome:
            self.metrics.record_pending_wait("dram", outcome, loop.time() - started)
            return
        remote = self.residency.remote
        left = deadline - loop.time()
        if remote is None or hit >= len(chain) or left <= 0 or not remote.ready():
            return
        _, outcome = await asyncio.to_thread(remote.wait_written, ns.name, chain[hit:], left)
        if outcome:
            self.metrics.record_pending_wait("remote", outcome, loop.time() - started)

    def _lookup_local(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, replica: str,
    ) -> tuple[NamespaceInfo, list[bytes], list[Tier]]:
        with self._lock:
            ns = self._ns(tenant, layout_id)
            chain = self.residency.quarantine.cut(
                ns.name, self.names.split_keys(ns, keys, key_width, unique=False))
            who = f"{ns.name}#{replica}" if replica else _NO_REPLICA
            found = self.index.lookup(ns.name, chain, replica=who)
            self.residency.maybe_write_back(ns.name, found.blocks)
            self.residency.maybe_write_remote(ns.name, found.blocks, committed=False)
        return ns, chain, list(found.tiers)

    def _observe(self, ns: str, keys: bytes, key_width: int) -> None:
        with self._mrc_lock:
            self.mrc.observe_packed(ns, keys, key_width)

    def _remote_present(self, ns: NamespaceInfo, chain: list[bytes], local: int) -> int:
        """Blocks after the local prefix that the remote tier holds (no cache lock)."""
        remote = self.residency.remote
        if remote is None or local >= len(chain):
            return 0
        return remote.present(ns.name, chain[local:])

    def _lookup_result(
        self, ns: NamespaceInfo, chain: list[bytes], tiers: list[Tier], start_token: int,
        prompt_tokens: int, want_plan: bool,
    ) -> LookupResult:
        with self._lock:
            mine = ns.usage
            mine.lookups += 1
            mine.lookup_hits += bool(tiers)
            mine.blocks_hit += len(tiers)
            mine.blocks_missed += len(chain) - len(tiers)
        m = self.metrics
        counted = bytes(tiers)  # bytes.count: C speed, no Tier comparisons
        hits = {t.label: n for t in Tier if (n := counted.count(t))}
        m.record_lookup(ns.usage.tenant.name, ns.layout.model_id, hits, len(chain) - len(tiers))
        the_plan = None
        lay = ns.layout
        if want_plan and lay.cost is not None:
            cached_end = start_token + len(tiers) * lay.block_tokens
            suffix = max(0, prompt_tokens - cached_end) if prompt_tokens else (
                (len(chain) - len(tiers)) * lay.block_tokens
            )
            prefix = Prefix.uniform([int(t) for t in tiers], lay.block_tokens, lay.block_bytes,
                                    start_token)
            # its own reports + the daemon's SSD and remote links
            rates = self.tenant_rates.plan_rates(ns.usage.tenant.name)
            the_plan = plan(prefix, lay.cost, rates, suffix_tokens=suffix)
            m.record_plan(the_plan)
        return LookupResult(tiers, the_plan)

    async def acquire_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, ttl_s: float,
        session: str = "",
    ) -> AcquireResult:
        """Pins the longest cached prefix under a READ lease, promoting SSD blocks into DRAM
        slots; stops before a block that cannot be promoted. After a whole local prefix, the
        blocks the remote store holds follow it (fetched into DRAM slots claimed for them only).
        See `kvtier.daemon.cache.acquire`. The remote store's check, SSD and remote reads (and
        waits for other Acquires' promotions of the same blocks) run on a worker thread, without
        the cache lock. The worker finishes the Acquire even if the caller is cancelled; its
        lease then expires after the TTL."""
        ttl = self._new_lease_ttl(ttl_s)
        ns, chain, local = self._acquire_request(tenant, layout_id, keys, key_width, session)
        held = NOT_ASKED
        if local is not None:
            held = RemoteCheck(local, await asyncio.to_thread(self._remote_present, ns, chain,
                                                             local))

        def beginning() -> Steps[Acquiring]:
            self._check_session(tenant, session)  # (it may have ended during the check)
            a = yield from self.acquirer.beginning(tenant, ns, chain, ttl, held)
            a.session = session
            return a

        steps = beginning()
        a, moves = self._first_step(steps)
        if moves is None:
            assert a is not None
            return await self._acquired(a)

        async def rest() -> AcquireResult:
            assert moves is not None
            return await self._acquired(await self._off_loop(steps, moves))

        # shielded: an Acquire stopped at a page move holds pins and claims until it ends
        return await asyncio.shield(rest())

    async def _acquired(self, a: Acquiring) -> AcquireResult:
        if not a.io:
            return self._in_session(self.acquirer.end(a), a)
        # shielded: a caller cancelled while the read waits for a worker thread must not drop
        # it (its claims and pins would stay, and every later Acquire of its blocks would wait
        # PROMOTION_WAIT_S for a promotion that never ends); its lease then expires by TTL
        return self._in_session(
            await asyncio.shield(asyncio.to_thread(self.acquirer.finish, a)), a)

    def _first_step(self, steps: Steps[T]) -> tuple[T | None, PageMoves | None]:
        """Runs a residency operation's steps (`Residency.taking`) under the cache lock up to its
        first page move: (its value, None) when it needed none, else (None, the moves)."""
        with self._lock:
            try:
                return None, next(steps)
            except StopIteration as stop:
                return cast(T, stop.value), None

    async def _off_loop(self, steps: Steps[T], moves: PageMoves) -> T:
        """Drives steps stopped at page moves for the event loop: the moves copied on a worker
        thread without the cache lock (`_move`), each step resumed under the lock once they
        ended, until the operation returns."""
        while True:
            try:
                await asyncio.to_thread(self._move, moves)
            except BaseException:
                with self._lock:
                    steps.close()  # its `finally` blocks run under the lock
                raise
            with self._lock:
                try:
                    moves = steps.send(None)
                except StopIteration as stop:
                    return cast(T, stop.value)

    def _move(self, moves: PageMoves) -> None:
        """Copies planned page moves (no cache lock: the targets and the blocks are pinned), then
        ends them under the lock (`Residency.end_moves`), even when the copy failed."""
        try:
            self.pool.copy_moves(moves.moves)
        finally:
            with self._lock:
                self.residency.end_moves(moves)

    def _in_session(self, res: AcquireResult, a: Acquiring) -> AcquireResult:
        """An Acquire whose session ended while it read from SSD: its lease ends now (nobody
        is left to release it)."""
        if a.session and res.lease_id:
            with self._lock:
                if not self._leases.session_open(a.session, a.tenant.name):
                    lease = self._leases.pop(res.lease_id)
                    if lease is not None:
                        self._end(lease)
        return res

    def _acquire_request(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, session: str,
    ) -> tuple[NamespaceInfo, list[bytes], int | None]:
        """An Acquire's namespace and chain (validated), and the length of its local prefix now
        when the remote store is to be asked about the keys after it (a remote tier that is up
        or due for a probe, a chain longer than the prefix), else None."""
        with self._lock:
            self._check_session(tenant, session)
            ns = self._ns(tenant, layout_id)
            chain = self.residency.quarantine.cut(
                ns.name, self.names.split_keys(ns, keys, key_width, unique=False))
            remote = self.residency.remote
            if remote is None or not remote.ready():
                return ns, chain, None
            local = len(self.index.lookup(ns.name, chain, touch=False).blocks)
            return ns, chain, local if local < len(chain) else None

    def _claim(self, ns: NamespaceInfo) -> Steps[int | None]:
        if not quota_room(self.residency, ns.usage, 1, self.residency.dram_bytes_of(ns.name)):
            return None
        return (yield from self.residency.claiming(ns.name))

    def release(self, tenant: Tenant, lease_id: str, nbytes: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            lease = self._own(tenant, lease_id, LeaseKind.READ)
            r: ReadLease = lease.payload  # type: ignore[assignment]
            _check_reported(nbytes, len(r.blocks) * r.ns.layout.block_bytes)
            self._leases.pop(lease.id)
            self.acquirer.release(r)
        if nbytes:
            self.metrics.bytes_moved.labels("dram", "to_client").inc(nbytes)
        if seconds > 0:
            self.metrics.copy_seconds.labels("to_client").observe(seconds)
        if nbytes and seconds > 0:
            self.metrics.observe_fetch(Link.DRAM_READ, seconds, nbytes / r.h2d_bytes_per_s)
            self.tenant_rates.observe(
                tenant.name, lambda book: book.observe_transfer(Link.DRAM_READ, nbytes, seconds))

    def renew(self, tenant: Tenant, lease_id: str, ttl_s: float) -> float:
        ttl = self._ttl(ttl_s)
        with self._lock:
            lease = self._own(tenant, lease_id, None)
            self._leases.renew(lease.id, ttl)
            p = lease.payload
            slots = ([s for _, s in p.todo] if isinstance(p, WriteLease)
                     else [b.dram_slot for b in p.blocks if b.dram_slot is not None]
                     if isinstance(p, ReadLease) else [])
            self.pool.hold(slots, time.monotonic() + ttl)  # the keep records' deadline
        return ttl

    # -- allocate, commit, abort ------------------------------------------------------------

    async def allocate_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, parent: bytes,
        ttl_s: float, session: str = "", handoff: bool = False,
    ) -> AllocateResult:
        """Slots for the keys not cached or being written, under a WRITE lease (see
        `kvtier.daemon.cache.allocate`). The page moves that make room for the new blocks' size
        class copy on a worker thread, without the cache lock (`_off_loop`; shielded, so the
        steps end when the caller is cancelled — its lease then expires after its TTL); a
        hand-off's marks in the remote store on a worker thread too."""
        ttl = self._new_lease_ttl(ttl_s)
        ns_chain: list[tuple[NamespaceInfo, list[bytes]]] = []

        def allocating() -> Steps[AllocateResult]:
            self._check_session(tenant, session)
            ns = self._ns(tenant, layout_id)
            chain = self.names.split_keys(ns, keys, key_width, unique=True)
            ns_chain.append((ns, chain))
            return (yield from self.allocator.allocating(tenant, ns, chain, parent, ttl, session))

        steps = allocating()
        res, moves = self._first_step(steps)
        if moves is not None:
            res = await asyncio.shield(self._off_loop(steps, moves))
        assert res is not None
        if handoff:
            await asyncio.to_thread(self._handoff, *ns_chain[0], res)
        return res

    def _handoff(self, ns: NamespaceInfo, chain: list[bytes], res: AllocateResult) -> None:
        """A prefill's Allocate (`AllocateRequest.handoff`; blocking, called without the cache
        lock, before the reply): its lease becomes a hand-off (`WriteLease.handoff`) and, with
        a remote tier, its keys are marked pending in the store; the chain's blocks cached here
        in DRAM that the store lacks are marked and written too (urgent writes), so a consumer
        on another node finds the whole prefix coming."""
        remote = self.residency.remote
        with self._lock:
            lease = self._leases.get(res.lease_id) if res.lease_id else None
            if lease is not None:
                cast(WriteLease, lease.payload).handoff = True
            if remote is None:
                return
            mine = set(res.indices)
            cached = [k for i, k in enumerate(chain)
                      if i not in mine and (b := self.index.get(ns.name, k)) is not None
                      and b.in_dram]
        ttl = 2 * res.ttl_s  # the write follows the commit: the marker outlives the lease
        allocated = [chain[i] for i in res.indices]
        if not remote.mark(ns.name, allocated, ttl):
            return
        lacking = remote.lacking(ns.name, cached)
        marked = bool(lacking) and remote.mark(ns.name, lacking, ttl)
        with self._lock:
            if lease is not None and self._leases.get(lease.id) is None:
                remote.unmark_later(ns.name, allocated)  # it ended while the marks were set
            if not marked:
                return
            blocks = [b for k in lacking if (b := self.index.get(ns.name, k)) is not None]
            remote.unmark_later(ns.name, [k for k in lacking
                                          if self.index.get(ns.name, k) is None])
            self.residency.maybe_write_remote(ns.name, blocks, committed=True, handoff=True)

    def commit(self, tenant: Tenant, lease_id: str, nbytes: int = 0, seconds: float = 0.0) -> int:
        """Makes the lease's filled slots cached blocks; returns how many were inserted."""
        with self._lock:
            lease = self._own(tenant, lease_id, LeaseKind.WRITE)
            w: WriteLease = lease.payload  # type: ignore[assignment]
            _check_reported(nbytes, len(w.todo) * w.ns.layout.block_bytes)
            self._leases.pop(lease.id)
            inserted = self.allocator.commit(tenant, w)
            self.waits.ended(lease.id, True)
        if nbytes:
            self.metrics.bytes_moved.labels("dram", "from_client").inc(nbytes)
        if seconds > 0:
            self.metrics.copy_seconds.labels("from_client").observe(seconds)
            self.tenant_rates.observe(
                tenant.name, lambda book: book.observe_transfer(Link.DRAM_WRITE, nbytes, seconds))
        return inserted

    def abort(self, tenant: Tenant, lease_id: str) -> None:
        with self._lock:
            lease = self._own(tenant, lease_id, LeaseKind.WRITE)
            self._leases.pop(lease.id)
            self._end(lease)

    # -- leases -----------------------------------------------------------------------------

    # -- sessions ---------------------------------------------------------------------------

    def open_session(self, tenant: Tenant) -> str:
        """A new session id; leases granted under it end at `close_session`."""
        with self._lock:
            return self._leases.open_session(tenant.name)

    def close_session(self, session: str) -> int:
        """Ends every lease still held under the session (its client is gone); how many."""
        with self._lock:
            gone = self._leases.pop_session(session)
            for lease in gone:
                self._end(lease)
        for lease in gone:
            self.metrics.leases_expired.labels(lease.kind.value).inc()
        return len(gone)

    def _check_session(self, tenant: Tenant, session: str) -> None:
        if session and not self._leases.session_open(session, tenant.name):
            raise FailedPrecondition(
                f"session {session[:12]!r} is not open (it ended, or another tenant's): "
                "open a new one"
            )

    def _new_lease_ttl(self, ttl_s: float) -> float:
        if self.draining:
            raise Unavailable("the daemon is shutting down; no new leases")
        return self._ttl(ttl_s)

    def _ttl(self, ttl_s: float) -> float:
        if not ttl_s >= 0:
            raise InvalidArgument(f"lease TTL must be >= 0, got {ttl_s}")
        if ttl_s > self.spec.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease TTL {ttl_s:g} s exceeds the maximum {self.spec.max_lease_ttl_s:g} s"
            )
        return ttl_s or self.spec.lease_ttl_s

    def _own(self, tenant: Tenant, lease_id: str, kind: LeaseKind | None) -> Lease:
        if not lease_id:
            raise InvalidArgument("lease_id is empty")
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no live lease {lease_id[:12]!r} (released, committed or expired)")
        if lease.tenant != tenant.name:
            raise PermissionDenied("the lease belongs to another tenant")
        if kind is not None and lease.kind is not kind:
            raise FailedPrecondition(f"lease {lease_id[:12]} is a {lease.kind.value} lease")
        return lease

    def _end(self, lease: Lease) -> None:
        """Undoes what a lease held once it left the table (unpin, or free unfilled slots)."""
        if lease.kind is LeaseKind.READ:
            self.acquirer.release(lease.payload)  # type: ignore[arg-type]
        else:
            self.allocator.end(lease.payload)  # type: ignore[arg-type]
            self.waits.ended(lease.id, False)

    def expire(self) -> int:
        """Ends every lease past its TTL (unpin / abort) and every operator pin past its
        deadline. Returns how many leases ended."""
        with self._lock:
            gone = self._leases.expired()
            for lease in gone:
                self._end(lease)
            if self.residency.held:
                self.residency.release_held()
            pins = self.control.expire()
            if pins or self.index.reap_due:
                self.residency.apply()
        for lease in gone:
            self.metrics.leases_expired.labels(lease.kind.value).inc()
        return len(gone)

    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- operators' actions (`kvtier.daemon.cache.control`) ----------------------------------

    async def evict_async(self, caller: Tenant, scope: Scope, clear: bool = False,
                          local_only: bool = False) -> EvictResult:
        """Removes the scope's blocks from every tier (see `CacheApi.evict_async`): DRAM and
        SSD under the lock, then the remote store's copies on a worker thread without it."""
        with self._lock:
            got = self.control.evict(caller, scope, clear)
        result, error = got.result, ""
        work = got.remote
        if self.residency.remote is not None and not local_only and (work.whole or work.keys):
            deleted, error = await asyncio.to_thread(self.control.delete_remote, work)
            with self._lock:
                for ns, keys in deleted:
                    self.residency.applier.removed(ns, Tier.REMOTE, keys)
            result = result._replace(remote_blocks=sum(len(k) for _, k in deleted),
                                     remote_error=error)
        action = "clear" if clear else "evict"
        self.metrics.operator_actions.labels(action).inc()
        self.metrics.operator_blocks.labels(action).inc(result.blocks)
        log.info("%s by %s (%s): %d block(s) removed from %d namespace(s) (DRAM %d, SSD %d, "
                 "remote %d)%s%s", action, caller.name, describe(scope, clear), result.blocks,
                 result.namespaces, result.dram_blocks, result.ssd_blocks, result.remote_blocks,
                 f"; {result.doomed} held by leases or writes go when released"
                 if result.doomed else "",
                 f"; remote deletes incomplete: {error}" if error else "")
        return result

    def pin(self, caller: Tenant, scope: Scope, ttl_s: float, hint: bool = False) -> PinResult:
        """Pins the cached prefix of the scope's chain (`CacheApi.pin`). `hint`: sent by an
        engine for one request (logged at debug level, counted apart)."""
        with self._lock:
            got = self.control.pin(caller, scope, ttl_s)
        action = "pin_hint" if hint else "pin"
        self.metrics.operator_actions.labels(action).inc()
        self.metrics.operator_blocks.labels(action).inc(got.new)
        log.log(logging.DEBUG if hint else logging.INFO,
                "pin by %s (%s) for %g s: %d of %d block(s) cached and pinned (%d new) in %d "
                "namespace(s)", caller.name, describe(scope), ttl_s, got.pinned,
                got.asked * got.namespaces, got.new, got.namespaces)
        return got

    def unpin(self, caller: Tenant, scope: Scope) -> int:
        with self._lock:
            n = self.control.unpin(caller, scope)
        self.metrics.operator_actions.labels("unpin").inc()
        self.metrics.operator_blocks.labels("unpin").inc(n)
        log.info("unpin by %s (%s): %d block(s)", caller.name, describe(scope), n)
        return n

    def pins(self, caller: Tenant, scope: Scope) -> list[PinInfo]:
        with self._lock:
            return self.control.listing(caller, scope)

    async def prefetch_async(self, caller: Tenant, scope: Scope, hint: bool = False
                             ) -> PrefetchResult:
        """Brings the cached prefix of the scope's chain into DRAM in each of its registered
        namespaces: an Acquire (promotions from SSD, fetches from the remote tier), released
        at once. `hint`: as for `pin`."""
        if not scope.keys:
            raise InvalidArgument("a prefetch needs the keys of a prefix")
        with self._lock:
            targets = [(ns, self.names.tenant(ns.tenant).tenant)
                       for ns in self.control.namespaces(caller, scope, registered=True)
                       if self.names.layouts[(ns.tenant, ns.layout_id)].key_width
                       == scope.key_width]
        if not targets:
            raise no_layout(scope)
        asked = len(scope.keys) // scope.key_width
        dram = ssd = remote = missing = 0
        for ns, owner in targets:
            got = await self.acquire_async(owner, ns.layout_id, scope.keys, scope.key_width,
                                           0.0)
            if got.lease_id:
                self.release(owner, got.lease_id)
            counted = bytes(got.source_tiers)
            dram += counted.count(Tier.DRAM)
            ssd += counted.count(Tier.SSD)
            remote += counted.count(Tier.REMOTE)
            missing += asked - len(counted)
        result = PrefetchResult(len(targets), asked, dram, ssd, remote, missing)
        action = "prefetch_hint" if hint else "prefetch"
        self.metrics.operator_actions.labels(action).inc()
        self.metrics.operator_blocks.labels(action).inc(ssd + remote)
        log.log(logging.DEBUG if hint else logging.INFO,
                "prefetch by %s (%s): %d block(s) promoted from SSD, %d fetched from the "
                "remote tier, %d already in DRAM, %d missing", caller.name, describe(scope),
                ssd, remote, dram, missing)
        return result

    def _end_writes(self, namespaces: set[Namespace]) -> int:
        """Ends the WRITE leases of `namespaces` uncommitted (an evict of them). Lock held."""
        ended = [lease for lease in self._leases if lease.kind is LeaseKind.WRITE
                 and cast(WriteLease, lease.payload).ns.name in namespaces]
        for lease in ended:
            self._leases.pop(lease.id)
            self._end(lease)
        return len(ended)

    def _pinned(self) -> int:
        with self._lock:
            return len(self.pin_table)

    # -- streaming byte path ----------------------------------------------------------------

    @asynccontextmanager
    async def reading(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int,
    ) -> AsyncIterator[LeasedSlots]:
        """Acquire (`acquire_async`) under a READ lease for a ReadBlocks stream, then release.
        The stream copies its bytes out with `SlotStream.read`, one chunk at a time under the
        lock (see `SlotStream`)."""
        got = await self.acquire_async(tenant, layout_id, keys, key_width, 0.0)
        stream = LeasedSlots(self._lock, self._leases, self.pool, tenant, got.lease_id,
                             got.offsets, self.layout(tenant, layout_id).block_bytes, got.ttl_s)
        try:
            yield stream
        finally:
            if got.lease_id:
                with contextlib.suppress(NotFound):  # expired meanwhile: already freed
                    self.release(tenant, got.lease_id, stream.copied)

    def writing(self, tenant: Tenant, lease_id: str, offsets: list[int],
                block_bytes: int) -> LeasedSlots:
        """The WriteBlocks side of `SlotStream` over a WRITE lease from `allocate_async`."""
        return LeasedSlots(self._lock, self._leases, self.pool, tenant, lease_id, offsets,
                          block_bytes)

    def slot_view(self, offset: int, nbytes: int, tenant: str | None = None) -> memoryview:
        """View of a slot the caller holds under a lease (READ: read it; WRITE: fill it); in
        an isolated pool, at `offset` of `tenant`'s region now."""
        slot = self.pool.slot_at(offset, tenant)
        if slot is None:
            raise InvalidArgument(f"no slot starts at offset {offset}")
        return memoryview(self.pool.view(slot, nbytes))  # type: ignore[arg-type]

    # -- engines' reports -------------------------------------------------------------------

    def report_hbm(
        self, tenant: Tenant, layout_id: bytes, replica: str, key_width: int, added: bytes,
        removed: bytes, reset: bool,
    ) -> int:
        """A replica's GPU-pool holdings changed; returns how many added keys are cached."""
        if not 0 < len(replica) <= 128:
            raise InvalidArgument("replica must be a name of 1..128 characters")
        with self._lock:
            ns = self._ns(tenant, layout_id)
            add = self.names.split_keys(ns, added, key_width, unique=False)
            drop = self.names.split_keys(ns, removed, key_width, unique=False)
            name = f"{ns.name}#{replica}"  # replicas are per namespace: tenants never share them
            if reset:
                self.index.drop_replica(name)
            for key in drop:
                self.index.hbm_drop(name, ns.name, key)
            return sum(self.index.hbm_add(name, ns.name, key) for key in add)

    def report_prefill(
        self, tenant: Tenant, layout_id: bytes, tokens: int, seconds: float, context: int,
    ) -> bool:
        """An engine's realized prefill; False when the layout has no cost model or it is noise."""
        info = self.layout(tenant, layout_id)
        if tokens <= 0 or not 0 < seconds < 1e6:
            raise InvalidArgument("tokens and seconds must be positive (seconds finite)")
        cost = info.cost
        if cost is None:
            return False
        return self.tenant_rates.observe(
            tenant.name, lambda book: book.observe_prefill_tokens(cost, context, tokens, seconds))

    # -- shadow verification ----------------------------------------------------------------

    async def report_verification_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, matched: int,
        mismatched: bool, detail: str,
    ) -> Quarantined:
        """An engine compared `keys` (a chain's consecutive blocks) with its own recomputed KV:
        the first `matched` matched; with `mismatched`, the next one did not, and it is
        quarantined with its descendants on every tier (`kvtier.daemon.cache.quarantine`):
        removed from DRAM and SSD now (or, when a block of its subtree is pinned, once the pin
        goes; lookups stop before it at once), its remote copies deleted on a worker thread.
        One WARNING line names the tenant, model, layout and block."""
        if len(detail) > MAX_DETAIL:
            raise InvalidArgument(f"detail is {len(detail)} characters; at most {MAX_DETAIL}")
        with self._lock:
            ns = self._ns(tenant, layout_id)
            chain = self.names.split_keys(ns, keys, key_width, unique=True)
            if matched > len(chain) or (mismatched and matched >= len(chain)):
                raise InvalidArgument(
                    f"matched {matched}{' + 1 mismatched' if mismatched else ''} of "
                    f"{len(chain)} keys")
            usage = ns.usage
            usage.verified += matched + int(mismatched)
            usage.mismatched += int(mismatched)
            self.metrics.record_verification(tenant.name, ns.layout.model_id, matched,
                                             int(mismatched))
            if not mismatched:
                return Quarantined(0, 0, 0, False)
            key = chain[matched]
            got = self.residency.quarantine.begin(ns.name, key)
            if got is not None:
                usage.quarantined += len(got.keys) if got.dram or got.ssd else 0
        lay = ns.layout
        log.warning(
            "verification MISMATCH: tenant %s, model %s, layout %s (fingerprint %s), block %s: "
            "the engine's recomputed KV differs from the stored bytes (%s); quarantined with "
            "its descendants: %s", tenant.name, lay.model_id, layout_id.hex()[:16],
            lay.fingerprint.hex()[:16], key.hex(), _printable(detail) or "no detail",
            "pending (a block of its subtree is pinned; lookups stop before it now)"
            if got is None else f"{got.dram} DRAM, {got.ssd} SSD copies removed")
        if got is None:
            return Quarantined(0, 0, 0, True)
        remote = self.residency.remote
        deleted = 0
        if remote is not None:
            deleted = await asyncio.to_thread(remote.delete_quarantined, ns.name, got.keys)
        with self._lock:
            self._remote_deleted(ns.name, key, got.keys, deleted)
        return Quarantined(got.dram, got.ssd, max(0, deleted), False)

    def _remote_deleted(self, ns: Namespace, key: bytes, keys: list[bytes], deleted: int
                        ) -> None:
        """A quarantined subtree's remote copies were deleted (`deleted` of `keys`; -1: the
        store could not be asked, so `key` stays cut). Cache lock held."""
        if deleted > 0:
            self.metrics.verify_quarantined.labels("remote").inc(deleted)
            self.residency.applier.removed_remote(ns, keys)
        if deleted < 0:
            log.warning("quarantined block %s: its remote copies could not be deleted (the "
                        "store is down); this daemon never fetches them (until it restarts)",
                        key.hex())
            return
        self.residency.quarantine.settle(ns, key)

    def _quarantine_removed(self, ns: Namespace, key: bytes, got: Removed) -> None:
        """A pending quarantine's subtree left the local tiers (cache lock held): its remote
        copies are deleted off the lock, then the key settles."""
        usage = self.names.tenants.get(ns.tenant)
        if usage is not None:
            usage.quarantined += len(got.keys)
        if self.residency.remote is None:
            self.residency.quarantine.settle(ns, key)
        else:
            self._remote_deletes.start(ns, key, got.keys)

    # -- reporting and shutdown -------------------------------------------------------------

    def stats(self, tenant: Tenant | None = None) -> CacheStats:
        with self._lock:
            return cache_stats(self.residency, self._leases, self.names, tenant)

    def mrc_gauges(self) -> MrcGauges:
        """The online miss-ratio curve (`kvtier.index.mrc`), for the metrics and Stats."""
        with self._mrc_lock:
            return mrc_gauges(self.mrc)

    def mrc_sampled(self) -> int:
        """Block references the miss-ratio curve has sampled so far."""
        with self._mrc_lock:
            return self.mrc.sampled_refs

    def gauges(self) -> PoolGauges:
        return pool_gauges(self.stats(), self.residency)

    def leaked_slots(self) -> int:
        """Slots neither free nor held by a DRAM block, a WRITE lease, a promotion or a page
        move in flight (must always be 0)."""
        with self._lock:
            r = self.residency
            held = (self.index.blocks(Tier.DRAM) + r.claimed + self.allocator.slots_held()
                    + r.moving + r.held_slots)
            return self.pool.stats().slots_used - held

    def flush(self, timeout: float) -> bool:
        """Waits for queued SSD write-backs (tests, drain)."""
        return self.residency.flush(timeout)

    def set_tenants(self, tenants: Iterable[Tenant], revoked: Iterable[str],
                    rekeyed: Iterable[str] = (), where: object = "tokens file") -> None:
        """The tokens file's tenants (at start, and at a reload): their quotas apply from now
        on; a revoked tenant keeps its blocks (evicted like any, reachable again if it comes
        back). In an isolated pool each tenant's slice of the pool is set (UsageError when they
        do not fit, nothing changed), and a `rekeyed` tenant (revoked, or its token changed) or
        one whose slice changed moves to a fresh region: its DRAM blocks in the old one leave
        DRAM, now or at their release (`Residency.rekey`; SSD and remote copies stay), and its
        write leases end uncommitted (what their holders wrote is the old token's)."""
        tenants = list(tenants)
        with self._lock:
            resized = self.pool.set_tenants(dram_shares(tenants), where)
            for tenant in tenants:
                self.names.tenant(tenant.name, tenant)
            for name in revoked:
                if name in self.names.tenants:
                    self.names.tenant(name, Tenant(name))
            moved = {*rekeyed, *resized}
            if not moved:
                return
            if resized:
                log.warning("tenants %s: their DRAM slice changed (the pool was divided again "
                            "for the tenants added or changed): they move to fresh regions, "
                            "their DRAM blocks leave DRAM (SSD and remote copies stay)",
                            ", ".join(resized))
            # a write begun before (under the old token, into the old region) never commits:
            # its lease ends now, its slots go back, its stream or Commit finds it gone
            ended = [lease for lease in self._leases
                     if lease.kind is LeaseKind.WRITE and lease.tenant in moved]
            for lease in ended:
                self._leases.pop(lease.id)
                self._end(lease)
            if ended:
                log.info("reload: %d write lease(s) of rekeyed tenants ended uncommitted",
                         len(ended))
            for name in sorted(moved):
                self.control.drop_tenant(name)  # pins would hold the old region's slots
                self.residency.rekey(name)

    def close(self, timeout: float = 10.0, keep: bool = False) -> None:
        """Ends all leases, flushes write-backs, closes LMDB and unlinks the shared segment
        (`keep`: leaves the DRAM pool to the next daemon, its keep records as they are before
        the leftover leases end: their holders may still be using their slots).

        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.acquirer.wait_idle(timeout)  # promotions finish before the store closes
            if keep:
                self.pool.freeze_keep()
            for lease in self._leases.pop_all():
                self._end(lease)
        self._remote_deletes.join(timeout)
        self.residency.close(timeout, keep)
        self.events.close()
