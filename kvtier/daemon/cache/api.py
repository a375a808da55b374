"""The cache as the transports see it: `CacheApi`, the calls `kvtier.daemon.rpc` makes, and the
results they return. `kvtier.daemon.cache.cache.Cache` implements it; rpc imports only this
module of the cache's internals, so it reaches the index and the tiers through these calls alone.

Contract of every call (the facade's rules, `kvtier.daemon.cache.cache`):
- the tenant is the authenticated caller's (`Tenant`), never something a request claims; a
  layout id names one of that tenant's registrations (NOT_FOUND otherwise);
- a refused request raises a `kvtier.core.errors.CacheError` subclass and changes nothing;
- a lease is used only by its tenant, for its kind, while it lives (TTL, session);
- the plain methods take the cache lock for a short time and return; the `*_async` ones run on
  the event loop and do their waits (the remote tier's round trips, SSD reads, page moves) on a
  worker thread without the lock, shielded: a cancelled caller's steps still end (its lease
  then expires).

Lifetimes: offsets and the segment are valid while the lease that returned them lives; a
`SlotStream` from `reading`/`writing` touches slots only while its lease is in the table.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import NamedTuple, Protocol, TypeAlias

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import Plan
from kvtier.core.segment import SegmentHandle
from kvtier.core.types import Tier
from kvtier.daemon.cache.events import EventLog
from kvtier.daemon.cache.namespaces import LayoutInfo, Tenant
from kvtier.daemon.cache.spec import CacheSpec
from kvtier.daemon.metrics import DaemonMetrics, MrcGauges

Buffer: TypeAlias = bytes | memoryview


class SlotStream(Protocol):
    """A streaming call's view of the slots its lease holds (ReadBlocks reads them, WriteBlocks
    fills them; block i is the lease's i-th slot): every piece is checked against the live lease
    and copied under the cache lock, so a slot is never touched once its lease ended (a stream
    stalled past its TTL fails at its next piece, NotFound). A piece renews the lease once half
    its TTL has passed and the stream moved some bytes since the last renewal (a trickle keeps
    no lease). Any thread."""

    block_bytes: int
    copied: int  # bytes read or written so far (what Release/Commit report)
    ttl_s: float  # the lease's TTL: how long a transport may wait for its client at most

    def __len__(self) -> int: ...

    def read(self, block: int, at: int, n: int, head: bytes = b"") -> bytes:
        """`head` followed by up to `n` bytes of block `block` from byte `at` (one copy)."""

    def write(self, block: int, at: int, data: Buffer) -> None:
        """`data` into block `block` at byte `at`."""


class Registered(NamedTuple):
    layout_id: bytes  # what data requests name (see `kvtier.core.keys.layout_id`)
    segment: SegmentHandle


class SegmentView(NamedTuple):
    """The pool as one tenant maps it: its handle, the slot grid of one size class (`stride`),
    and whether it is mapped from an fd the fd socket hands out (an isolated pool)."""

    handle: SegmentHandle
    stride: int
    by_fd: bool


class LookupResult(NamedTuple):
    tiers: list[Tier]
    plan: Plan | None


class AcquireResult(NamedTuple):
    lease_id: str  # "" when nothing was acquired
    offsets: list[int]
    source_tiers: list[Tier]
    ttl_s: float


class AllocateResult(NamedTuple):
    lease_id: str  # "" when every key was already cached
    indices: list[int]
    offsets: list[int]
    ttl_s: float


class Quarantined(NamedTuple):
    """What a verification report's quarantine removed: DRAM and SSD copies, remote copies
    deleted; `deferred`: a block of the subtree was pinned (it leaves when the pin goes)."""

    dram: int
    ssd: int
    remote: int
    deferred: bool


class GroupUsage(NamedTuple):
    """Bytes one KV cache group of a model holds per tier: its layouts' blocks there times the
    group's bytes per block (`RegisterLayoutRequest.groups`)."""

    model_id: str
    group: str
    dram_bytes: int
    ssd_bytes: int


class CacheStats(NamedTuple):
    """Node totals, or (`node_wide` False) the figures of one tenant: its used bytes, blocks,
    leases, layouts and lookups; capacities stay the node's."""

    dram_capacity_bytes: int
    dram_used_bytes: int
    dram_blocks: int
    ssd_capacity_bytes: int
    ssd_used_bytes: int
    ssd_blocks: int
    read_leases: int
    write_leases: int
    layouts: int
    tenant_dram_bytes: int  # of the tenant asked about (0 without one)
    tenant_ssd_bytes: int
    node_wide: bool = True
    lookups: int = 0  # the tenant's (node-wide ones are the metrics' counters)
    blocks_hit: int = 0
    blocks_missed: int = 0
    groups: tuple[GroupUsage, ...] = ()
    verified: int = 0  # shadow verification: the tenant's own, or every tenant's (node-wide)
    mismatched: int = 0
    quarantined: int = 0


class Scope(NamedTuple):
    """Which blocks an operator's action names (`kvtier.daemon.cache.control`): namespaces of
    `tenant` ("" = the caller's own; another tenant's, or `all_tenants`, only for an admin)
    narrowed to one model (`model_id`) and/or one layout (`layout_id`), and within them, when
    `keys` is given, the blocks of those packed keys (`key_width` bytes each): a chain from its
    first block for a pin or a prefetch; for an evict or an unpin, each key's block (an evict:
    and every block under it)."""

    tenant: str = ""
    all_tenants: bool = False
    model_id: str = ""
    layout_id: bytes = b""
    keys: bytes = b""
    key_width: int = 0


class EvictResult(NamedTuple):
    """An evict's figures: namespaces it covered, blocks removed (with their DRAM and SSD
    copies), remote keys deleted, and blocks left doomed (a lease or a write in flight holds
    them: they go when it ends, and no lookup finds them meanwhile). `remote_error`: why the
    remote tier's deletes did not complete ("" when they did or there is none)."""

    namespaces: int
    blocks: int
    dram_blocks: int
    ssd_blocks: int
    remote_blocks: int
    doomed: int
    remote_error: str = ""


class PinResult(NamedTuple):
    """A pin's figures: namespaces (layouts) it covered, keys asked per namespace, blocks of
    the chain cached and now pinned (its cached prefix, summed over the namespaces), of which
    `new` were not pinned before, and the pin's TTL."""

    namespaces: int
    asked: int
    pinned: int
    new: int
    ttl_s: float


class PrefetchResult(NamedTuple):
    """A prefetch's figures, summed over its namespaces: keys asked, blocks already in DRAM,
    promoted from SSD, fetched from the remote tier, and keys not cached anywhere (or past a
    block that could not be brought in)."""

    namespaces: int
    asked: int
    in_dram: int
    from_ssd: int
    from_remote: int
    missing: int


class PinInfo(NamedTuple):
    """One namespace's pins: its tenant, model and layout, pinned blocks, and the seconds until
    the first and the last of them expire."""

    tenant: str
    model_id: str
    layout_id: bytes
    blocks: int
    first_expiry_s: float
    last_expiry_s: float


class CacheApi(Protocol):
    """What the transports call (see the module docstring for the rules every call keeps)."""

    spec: CacheSpec
    metrics: DaemonMetrics
    events: EventLog  # WatchEvents subscribes here

    def register_layout(
        self, tenant: Tenant, model_id: str, fingerprint: bytes, block_bytes: int,
        block_tokens: int, key_width: int, cost: CostModel | None,
        groups: tuple[tuple[str, int], ...] = (),
    ) -> Registered:
        """Declares a model's layout for this tenant (idempotent): its layout id."""

    def layout(self, tenant: Tenant, layout_id: bytes) -> LayoutInfo: ...

    def segment(self, tenant: Tenant, block_bytes: int = 0) -> SegmentView:
        """The pool as `tenant` maps it, on the grid of `block_bytes`' class (0: the smallest
        slot's)."""

    async def lookup_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int,
        start_token: int = 0, prompt_tokens: int = 0, want_plan: bool = False,
        replica: str = "", wait_s: float = 0.0,
    ) -> LookupResult:
        """The longest cached prefix, each block's tier (HBM for `replica`'s own, REMOTE after
        the local prefix), and the plan when asked and the layout has a cost model; with
        `wait_s`, once the blocks after the prefix that are being written are (bounded)."""

    async def acquire_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, ttl_s: float,
        session: str = "",
    ) -> AcquireResult:
        """Pins the longest cached prefix under a READ lease (SSD and remote blocks promoted
        into DRAM slots first)."""

    def release(self, tenant: Tenant, lease_id: str, nbytes: int = 0,
                seconds: float = 0.0) -> None:
        """Ends a READ lease; `nbytes`/`seconds`: the client's copy (a rate sample)."""

    def renew(self, tenant: Tenant, lease_id: str, ttl_s: float) -> float: ...

    async def allocate_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, parent: bytes,
        ttl_s: float, session: str = "", handoff: bool = False,
    ) -> AllocateResult:
        """Slots for the keys neither cached nor being written, under a WRITE lease (a
        prefill's `handoff`: marked and written to the remote tier for another node)."""

    def commit(self, tenant: Tenant, lease_id: str, nbytes: int = 0,
               seconds: float = 0.0) -> int:
        """The lease's slots become cached blocks (chain order; a block whose parent vanished
        is dropped); how many were inserted."""

    def abort(self, tenant: Tenant, lease_id: str) -> None: ...

    def reading(self, tenant: Tenant, layout_id: bytes, keys: bytes,
                key_width: int) -> AbstractAsyncContextManager[SlotStream]:
        """An Acquire for a ReadBlocks: the held blocks' `SlotStream`, released at the end."""

    def writing(self, tenant: Tenant, lease_id: str, offsets: list[int],
                block_bytes: int) -> SlotStream:
        """The WriteBlocks side of `SlotStream` over a WRITE lease from `allocate_async`."""

    def report_hbm(self, tenant: Tenant, layout_id: bytes, replica: str, key_width: int,
                   added: bytes, removed: bytes, reset: bool) -> int: ...

    def report_prefill(self, tenant: Tenant, layout_id: bytes, tokens: int, seconds: float,
                       context: int) -> bool: ...

    async def report_verification_async(
        self, tenant: Tenant, layout_id: bytes, keys: bytes, key_width: int, matched: int,
        mismatched: bool, detail: str,
    ) -> Quarantined:
        """Counts an engine's verification of `keys`; a mismatch quarantines keys[matched]
        and its descendants on every tier (never served again)."""

    def stats(self, tenant: Tenant | None = None) -> CacheStats: ...

    def mrc_gauges(self) -> MrcGauges: ...

    def mrc_sampled(self) -> int:
        """Block references the miss-ratio curve has sampled so far."""

    def open_session(self, tenant: Tenant) -> str: ...

    async def evict_async(self, caller: Tenant, scope: Scope, clear: bool = False,
                          local_only: bool = False) -> EvictResult:
        """Removes the scope's blocks from DRAM and SSD now (those a lease or a write holds
        when it ends) and deletes their remote copies (unless `local_only`): with `keys`, each
        key's block and every block under it; without, whole namespaces, which needs a model,
        a layout or `clear`. Ends the operator pins on them, and for whole namespaces the
        write leases not yet committed."""

    def pin(self, caller: Tenant, scope: Scope, ttl_s: float, hint: bool = False) -> PinResult:
        """Pins the cached prefix of the scope's chain (`keys`) in each of its registered
        namespaces for `ttl_s` (a pinned block keeps the later deadline): never evicted by
        pressure until then, `unpin` or an evict. Refused (ResourceExhausted, nothing
        pinned) when the tenant's pins would exceed its DRAM quota or slice of the pool.
        `hint`: an engine's, for one request (logged at debug level, counted apart)."""

    def unpin(self, caller: Tenant, scope: Scope) -> int:
        """Ends the scope's pins (with `keys`: those blocks' only); how many."""

    def pins(self, caller: Tenant, scope: Scope) -> list[PinInfo]: ...

    async def prefetch_async(self, caller: Tenant, scope: Scope, hint: bool = False
                             ) -> PrefetchResult:
        """Brings the cached prefix of the scope's chain into DRAM in each registered namespace
        (SSD and remote blocks promoted as an Acquire does), holding no lease after."""

    def close_session(self, session: str) -> int:
        """Ends every lease still held under `session`; how many."""
