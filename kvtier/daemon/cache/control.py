"""Operators' actions on the cache: evict, pin, unpin, list pins (prefetch is an Acquire then a
Release, in `kvtier.daemon.cache.cache`). The rules:

- Scope. A tenant's token acts on its own namespaces only; naming another tenant, or every
  tenant, needs an admin token (PermissionDenied). Namespaces are narrowed by model id (the
  caller's registrations say which layout is which model's: a namespace this daemon holds
  blocks of but whose layout no engine registered since the start — the SSD tier after a
  restart — is matched by its layout id only) and by layout id.
- Evict removes from DRAM and SSD at once (`PrefixIndex.purge`): whole namespaces, or each
  given key's block and every block under it. What a lease, a queued write or a page move
  holds is *doomed*: found by no lookup from now on, removed when released (`reap`, run by
  `Residency.apply`). The operator pins on them end. Whole namespaces also lose their write leases
  not yet committed (what an engine is writing now is of the weights being evicted). Remote
  copies: `remote_work` says what to delete there (whole namespaces: every key under them in
  the store, whichever node wrote it; keys: those blocks and the ones under them that this node
  held), done off the cache lock by `delete_remote`.
- Pin holds one index pin per block (`kvtier.daemon.cache.pins`) until its deadline; a block's
  cost is what it can take — its DRAM stride and SSD copy — whichever tier it is in now, and a
  tenant's pinned blocks may never cost more than its DRAM quota or slice of the pool (nor the
  pool), or its SSD quota (nor the SSD tier): a pin that would is refused whole.

Threading: everything here runs with the cache lock held, except `delete_remote` (a worker
thread, no lock: network round trips).
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable
from typing import NamedTuple

from kvtier.core.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvtier.core.keys import LAYOUT_ID_BYTES, check_model_id
from kvtier.daemon.cache.api import EvictResult, PinInfo, PinResult, Scope
from kvtier.daemon.cache.namespaces import KEY_WIDTHS, Namespace, Namespaces, Tenant
from kvtier.daemon.cache.pins import Cost, PinTable
from kvtier.daemon.cache.residency import Residency
from kvtier.daemon.metrics import DaemonMetrics

log = logging.getLogger(__name__)

REMOTE_FLUSH_S = 5.0
"""How long an evict waits for queued remote writes to go out before it deletes remote keys
(a write of an evicted block still queued would otherwise land after the delete)."""


class RemoteWork(NamedTuple):
    """What an evict deletes from the remote store: every key of `whole` namespaces, and
    `keys` of the other ones."""

    whole: list[Namespace]
    keys: list[tuple[Namespace, list[bytes]]]


class Evicting(NamedTuple):
    """An evict's local part done: its figures so far and the remote work left."""

    result: EvictResult
    remote: RemoteWork


def split(keys: bytes, width: int, most: int) -> list[bytes]:
    """Packed keys (`width` bytes each, at most `most`) as a list; InvalidArgument otherwise."""
    if width not in KEY_WIDTHS:
        raise InvalidArgument(f"key_width must be 16 or 32, got {width}")
    if len(keys) % width:
        raise InvalidArgument(f"keys length {len(keys)} is not a multiple of {width}")
    n = len(keys) // width
    if n > most:
        raise InvalidArgument(f"{n} keys exceed the limit of {most} per request")
    return list(struct.unpack(f"{width}s" * n, keys))


def no_layout(scope: Scope) -> NotFound:
    """The refusal of a pin or prefetch that names no registered layout (a client's own layout
    after a daemon restart: "unknown layout", which makes it register again)."""
    if scope.layout_id:
        return NotFound(f"unknown layout {scope.layout_id.hex()[:16]}: call RegisterLayout "
                        "first")
    return NotFound(f"no registered layout matches ({describe(scope)}): the engine registers "
                    "its layouts when it connects")


def describe(scope: Scope, clear: bool = False) -> str:
    """The scope as a log line names it (never a key: their count)."""
    parts = ["every tenant" if scope.all_tenants else f"tenant {scope.tenant}" if scope.tenant
             else "own tenant"]
    if scope.model_id:
        parts.append(f"model {scope.model_id!r}")
    if scope.layout_id:
        parts.append(f"layout {scope.layout_id.hex()[:16]}")
    if scope.keys:
        parts.append(f"{len(scope.keys) // max(1, scope.key_width)} key(s)")
    elif clear:
        parts.append("everything")
    return ", ".join(parts)


class Control:
    """The operator's calls over the cache's parts (see the module docstring). `end_writes`
    ends the write leases of the given namespaces (uncommitted) and says how many; `clock` is
    the lease table's."""

    def __init__(
        self, residency: Residency, names: Namespaces, pins: PinTable, metrics: DaemonMetrics,
        clock: Callable[[], float], max_blocks: int, max_pin_ttl_s: float,
        end_writes: Callable[[set[Namespace]], int],
    ) -> None:
        self.residency = residency
        self.index = residency.index
        self.names = names
        self.pins = pins
        self.metrics = metrics
        self.clock = clock
        self.max_blocks = max_blocks
        self.max_pin_ttl_s = max_pin_ttl_s
        self.end_writes = end_writes

    # -- scope --------------------------------------------------------------------------------

    def tenants(self, caller: Tenant, scope: Scope) -> set[str] | None:
        """The tenants the scope covers (None: every one); PermissionDenied for a tenant's
        token naming another tenant or all of them."""
        if scope.all_tenants:
            if scope.tenant:
                raise InvalidArgument("give a tenant or all tenants, not both")
            if not caller.admin:
                raise PermissionDenied("acting on every tenant needs an admin token")
            return None
        if scope.tenant and scope.tenant != caller.name:
            if not caller.admin:
                raise PermissionDenied("a tenant's token acts on its own blocks only; another "
                                       "tenant's need an admin token")
            if scope.tenant not in self.names.tenants:
                raise NotFound(f"no tenant {scope.tenant!r} on this daemon")
        return {scope.tenant or caller.name}

    def check(self, scope: Scope) -> None:
        if scope.model_id:
            check_model_id(scope.model_id)
        if scope.layout_id and len(scope.layout_id) != LAYOUT_ID_BYTES:
            raise InvalidArgument(f"layout id must be {LAYOUT_ID_BYTES} bytes, got "
                                  f"{len(scope.layout_id)}")

    def namespaces(self, caller: Tenant, scope: Scope, registered: bool) -> list[Namespace]:
        """The scope's namespaces: those with blocks here or a registered layout (only the
        latter with `registered`), sorted."""
        self.check(scope)
        tenants = self.tenants(caller, scope)
        layouts = self.names.layouts
        found: set[Namespace] = {Namespace(t, lid) for t, lid in layouts}
        if not registered:
            found.update(self.index.namespaces())
        out = []
        for ns in found:
            if tenants is not None and ns.tenant not in tenants:
                continue
            if scope.layout_id and ns.layout_id != scope.layout_id:
                continue
            if scope.model_id:
                info = layouts.get((ns.tenant, ns.layout_id))
                if info is None or info.model_id != scope.model_id:
                    continue
            out.append(ns)
        return sorted(out)

    def _chain(self, scope: Scope) -> list[bytes]:
        if not scope.keys:
            return []
        return split(scope.keys, scope.key_width, self.max_blocks)

    # -- evict --------------------------------------------------------------------------------

    def evict(self, caller: Tenant, scope: Scope, clear: bool) -> Evicting:
        """The local part of an evict (module docstring); the remote work it leaves."""
        keys = self._chain(scope)
        if not keys and not (clear or scope.model_id or scope.layout_id):
            raise InvalidArgument("name what to evict: a model, a layout, keys, or everything "
                                  "(clear)")
        if keys and clear:
            raise InvalidArgument("clear evicts whole namespaces: give no keys")
        nss = self.namespaces(caller, scope, registered=False)
        self.residency.apply()  # (the journal is empty whenever the lock is free; to be sure)
        writes = 0 if keys else self.end_writes(set(nss))
        blocks = dram = ssd = doomed = 0
        remote = RemoteWork([], [])
        index = self.index
        for ns in nss:
            selection = index.select(ns, keys or None)
            for key in self.pins.drop(ns, None if not keys else [b.key for b in selection]):
                index.unpin(ns, key)
            got = index.purge(ns, selection)
            blocks, dram, ssd = blocks + got.removed, dram + got.dram, ssd + got.ssd
            doomed += got.doomed
            if not keys:
                remote.whole.append(ns)
            else:
                held = [b.key for b in selection]
                seen = set(held)
                remote.keys.append((ns, held + [k for k in keys if k not in seen]))
        self.residency.apply("operator")
        if writes:
            log.info("evict: %d write lease(s) of the evicted namespaces ended uncommitted",
                     writes)
        return Evicting(EvictResult(len(nss), blocks, dram, ssd, 0, doomed), remote)

    def delete_remote(self, work: RemoteWork) -> tuple[list[tuple[Namespace, list[bytes]]], str]:
        """Deletes the remote copies an evict leaves (no cache lock: network): the keys
        deleted per namespace, and why it stopped early ("" when it did not)."""
        remote = self.residency.remote
        if remote is None:
            return [], ""
        remote.flush(REMOTE_FLUSH_S)
        deleted, error = remote.delete(work.whole, work.keys)
        return deleted, error

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, caller: Tenant, scope: Scope, ttl_s: float) -> PinResult:
        if not (math.isfinite(ttl_s) and 0 < ttl_s <= self.max_pin_ttl_s):
            raise InvalidArgument(f"pin TTL must be in (0, {self.max_pin_ttl_s:g}] seconds "
                                  f"(max_pin_ttl_s), got {ttl_s}")
        chain = self._chain(scope)
        if not chain:
            raise InvalidArgument("a pin needs the keys of a prefix (a chain from its first "
                                  "block)")
        nss = self.namespaces(caller, scope, registered=True)
        if not nss:
            raise no_layout(scope)
        width = scope.key_width
        found: list[tuple[Namespace, list[bytes], Cost]] = []
        extra: dict[str, list[int]] = {}
        for ns in nss:
            info = self.names.layouts[(ns.tenant, ns.layout_id)]
            if info.key_width != width:
                continue
            blocks = self.index.lookup(ns, chain, touch=False).blocks
            cost = Cost(self.residency.dram_bytes_of(ns), self.residency.ssd_bytes_of(ns))
            keys = [b.key for b in blocks]
            new = sum(1 for k in keys if self.pins.until(ns, k) is None)
            e = extra.setdefault(ns.tenant, [0, 0])
            e[0] += new * cost.dram
            e[1] += new * cost.ssd
            found.append((ns, keys, cost))
        if not found:
            raise InvalidArgument(f"key_width {width} matches no registered layout in scope")
        for tenant, (more_dram, more_ssd) in extra.items():
            self._check_room(tenant, more_dram, more_ssd)
        until = self.clock() + ttl_s
        pinned = added = 0
        for ns, keys, cost in found:
            for key in keys:
                if self.pins.pin(ns, key, until, cost):
                    self.index.pin(ns, key)
                    added += 1
            pinned += len(keys)
        return PinResult(len(found), len(chain), pinned, added, ttl_s)

    def _check_room(self, tenant: str, dram: int, ssd: int) -> None:
        """Refuses pins that would make `tenant`'s pinned blocks cost more than it may hold."""
        if not dram and not ssd:
            return
        usage = self.names.tenant(tenant)
        pool = self.residency.pool
        held = self.pins.held(tenant)
        limits = [pool.data_bytes]
        if usage.tenant.dram_quota_bytes:
            limits.append(usage.tenant.dram_quota_bytes)
        slices = pool.slices()
        if tenant in slices:
            limits.append(slices[tenant])
        if held.dram + dram > min(limits):
            raise ResourceExhausted(
                f"pin refused: tenant {tenant}'s pinned blocks would take {held.dram + dram} "
                f"bytes of DRAM, over the {min(limits)} it may hold (its quota or slice of the "
                "pool); unpin some first or pin a shorter prefix")
        if self.residency.store is None:
            return
        ssd_limit = usage.tenant.ssd_quota_bytes or self.residency.spec.ssd_bytes
        if held.ssd + ssd > ssd_limit:
            raise ResourceExhausted(
                f"pin refused: tenant {tenant}'s pinned blocks would take {held.ssd + ssd} "
                f"bytes of SSD, over the {ssd_limit} it may hold")

    def unpin(self, caller: Tenant, scope: Scope) -> int:
        chain = self._chain(scope)
        n = 0
        for ns in self.namespaces(caller, scope, registered=False):
            for key in self.pins.drop(ns, chain or None):
                self.index.unpin(ns, key)
                n += 1
        if n:
            self.residency.apply("operator")  # doomed blocks whose last pin this was go now
        return n

    def expire(self) -> int:
        """Ends the pins past their deadline."""
        gone = self.pins.expired(self.clock())
        for ns, key in gone:
            self.index.unpin(ns, key)
        return len(gone)

    def listing(self, caller: Tenant, scope: Scope) -> list[PinInfo]:
        nss = set(self.namespaces(caller, scope, registered=False))
        now = self.clock()
        out = []
        for ns, n, first, last in self.pins.namespaces():
            if ns in nss:
                info = self.names.layouts.get((ns.tenant, ns.layout_id))
                out.append(PinInfo(ns.tenant, "" if info is None else info.model_id,
                                   ns.layout_id, n, max(0.0, first - now),
                                   max(0.0, last - now)))
        return sorted(out)

    def drop_tenant(self, tenant: str) -> int:
        """Ends every pin of `tenant` (its token changed: its blocks leave DRAM)."""
        n = 0
        for ns, _, _, _ in list(self.pins.namespaces()):
            if ns.tenant == tenant:
                for key in self.pins.drop(ns):
                    self.index.unpin(ns, key)
                    n += 1
        return n
