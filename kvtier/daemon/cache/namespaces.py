"""Layouts, tenants and namespaces of one daemon, and the request checks. Pure
bookkeeping. (The domain errors are `kvtier.core.errors`; layout ids `kvtier.core.keys`.)

A registered layout is (model id, layout fingerprint), registered per tenant; its *layout id* is
`kvtier.core.keys.root_seed(model_id, fingerprint)` (32 bytes: SHA-256 over canonical CBOR of
`("kvtier-root/v1", model_id, fingerprint)`), the id every data request names. Two models with the
same layout fingerprint (two fine-tunes of one base) therefore get two layout ids, and their
blocks never mix even when their keys are equal (vLLM-compatible keys carry no model of their
own). A namespace is (tenant, layout id) (`Namespace`), stored as `"<tenant>/ns2:<layout id
hex>"` — the key of blocks in the prefix index and in the SSD store. The `ns2:` tag tells it apart
from the old `"<tenant>/<fingerprint hex>"` form (no model id), whose stored blocks are never
served: the SSD rebuild drops them (`Namespace.parse` returns None for them).
Requests are validated here against their layout (key width, counts) before anything changes.

Layouts (with their cost models) belong to the tenant that registered them: a tenant only ever
sees, names, reshapes or re-prices its own registrations, so another tenant re-registering the
same (model id, fingerprint) makes a second, independent layout, a data request naming a layout
id the caller never registered is NOT_FOUND whoever else has it, and no error message names
anything but the caller's own registrations.

Not thread-safe: the cache calls it under its lock.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvtier.core.costmodel import CostModel
from kvtier.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from kvtier.core.keys import LAYOUT_ID_BYTES, check_model_id, layout_id
from kvtier.core.types import Tier

KEY_WIDTHS = (16, 32)
FINGERPRINT_BYTES = (8, 64)
_NS_TAG = "ns2:"


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller (`kvtier.daemon.auth` maps tokens to them) and its quotas."""

    name: str
    dram_quota_bytes: int = 0  # 0 = unlimited
    ssd_quota_bytes: int = 0
    dram_guarantee_bytes: int = 0  # its slice of an isolated pool is at least this
    admin: bool = False  # Stats / WatchEvents see the whole node


class Namespace(str):
    """(tenant, layout id): the namespace of the prefix index (``PrefixIndex[Namespace]``: every
    block and journal entry gives it back as its `ns`), the SSD store and the remote tier.

    Typed: `tenant` and `layout_id` are fields, never parsed back out of a string. Its *value* is
    the stored form `"<tenant>/ns2:<layout id hex>"`, so it keys the index and the stores as it
    is: the SSD store's keys (and the remote tier's) are the ones earlier versions wrote, and the
    index's policies hash the same bytes they always did. A key read back from a store becomes a
    Namespace once, at the tier boundary (`Namespace.parse`: the SSD rebuild)."""

    tenant: str
    layout_id: bytes

    def __new__(cls, tenant: str, layout_id: bytes) -> Namespace:
        self = super().__new__(cls, f"{tenant}/{_NS_TAG}{layout_id.hex()}")
        self.tenant = tenant
        self.layout_id = layout_id
        return self

    def __getnewargs__(self) -> tuple[str, bytes]:  # type: ignore[override]
        return self.tenant, self.layout_id

    @classmethod
    def parse(cls, stored: str) -> Namespace | None:
        """The namespace a store key names; None for any other form (the pre-model-id
        `"<tenant>/<fingerprint hex>"`)."""
        tenant, _, tail = stored.rpartition("/")
        if not tail.startswith(_NS_TAG) or len(tail) != len(_NS_TAG) + 2 * LAYOUT_ID_BYTES:
            return None
        try:
            return cls(tenant, bytes.fromhex(tail[len(_NS_TAG):]))
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class LayoutInfo:
    id: bytes  # layout_id(model_id, fingerprint): what data requests name
    model_id: str
    fingerprint: bytes
    block_bytes: int
    block_tokens: int
    key_width: int
    cost: CostModel | None
    groups: tuple[tuple[str, int], ...] = ()
    """How a block's bytes split over the engine's KV cache groups (name, bytes), if declared."""


MAX_GROUPS = 64


def check_groups(groups: tuple[tuple[str, int], ...], block_bytes: int) -> None:
    """A layout's declared group split: names unique, 1..64 bytes; bytes positive, summing to
    `block_bytes`; at most `MAX_GROUPS` groups (empty: none declared)."""
    if not groups:
        return
    if len(groups) > MAX_GROUPS:
        raise InvalidArgument(f"at most {MAX_GROUPS} groups, got {len(groups)}")
    names = [name for name, _ in groups]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"group names must be unique, got {names}")
    for name, nbytes in groups:
        if not 0 < len(name.encode()) <= 64 or not name.isprintable():
            raise InvalidArgument(f"group name must be 1..64 bytes of printable text: {name!r}")
        if nbytes <= 0:
            raise InvalidArgument(f"group {name!r}: block_bytes must be positive, got {nbytes}")
    total = sum(nbytes for _, nbytes in groups)
    if total != block_bytes:
        raise InvalidArgument(f"the groups' block_bytes sum to {total}, not the layout's "
                              f"block_bytes {block_bytes}")


@dataclass(slots=True)
class TenantUsage:
    """What one tenant holds and did: DRAM and SSD bytes charged to it (slots from their taking
    until freed, SSD copies and queued write-backs; see `kvtier.daemon.cache.applier`) and its
    Lookup counts. `tenant`: its authenticated identity and quotas (`kvtier.daemon.auth.Tenant`)."""

    tenant: Tenant
    dram_bytes: int = 0
    ssd_bytes: int = 0
    lookups: int = 0  # Lookup calls, and the blocks they hit / missed (the tenant's Stats)
    lookup_hits: int = 0
    blocks_hit: int = 0
    blocks_missed: int = 0
    verified: int = 0  # blocks an engine verified (ReportVerification), mismatched of them,
    mismatched: int = 0  # and blocks removed from some tier for a mismatch
    quarantined: int = 0


@dataclass(slots=True, eq=False)
class NamespaceInfo:
    """A namespace some request named: its key, its tenant's usage, its layout, its WRITE
    leases' keys."""

    name: Namespace  # the index/SSD key
    usage: TenantUsage  # its tenant's
    layout: LayoutInfo
    pending: dict[bytes, str] = field(default_factory=dict)  # key -> WRITE lease id


class Namespaces:
    """Registered layouts (by tenant and layout id), known tenants (with their usage) and
    namespaces."""

    def __init__(self, max_block_bytes: int, max_blocks_per_request: int) -> None:
        self.max_block_bytes = max_block_bytes  # the pool's largest block (its size classes)
        self.max_blocks = max_blocks_per_request
        self.layouts: dict[tuple[str, bytes], LayoutInfo] = {}
        self.tenants: dict[str, TenantUsage] = {}
        self._namespaces: dict[tuple[str, bytes], NamespaceInfo] = {}

    def register(
        self, tenant: Tenant, model_id: str, fingerprint: bytes, block_bytes: int,
        block_tokens: int, key_width: int, cost: CostModel | None,
        groups: tuple[tuple[str, int], ...] = (),
    ) -> LayoutInfo:
        check_model_id(model_id)
        if not FINGERPRINT_BYTES[0] <= len(fingerprint) <= FINGERPRINT_BYTES[1]:
            raise InvalidArgument(
                f"layout fingerprint must be {FINGERPRINT_BYTES[0]}..{FINGERPRINT_BYTES[1]} "
                f"bytes, got {len(fingerprint)}"
            )
        if key_width not in KEY_WIDTHS:
            raise InvalidArgument(f"key_width must be 16 or 32, got {key_width}")
        if not 0 < block_bytes <= self.max_block_bytes:
            raise InvalidArgument(
                f"block_bytes must be in 1..{self.max_block_bytes} (the daemon's largest block, "
                f"max_block_bytes), got {block_bytes}"
            )
        if not 0 < block_tokens <= 1 << 20:
            raise InvalidArgument(f"block_tokens must be in 1..{1 << 20}, got {block_tokens}")
        check_groups(groups, block_bytes)
        lid = layout_id(model_id, fingerprint)
        info = LayoutInfo(lid, model_id, fingerprint, block_bytes, block_tokens, key_width, cost,
                          groups)
        old = self.layouts.get((tenant.name, lid))
        shape = (block_bytes, block_tokens, key_width)
        if old is not None and (old.block_bytes, old.block_tokens, old.key_width) != shape:
            raise FailedPrecondition(
                f"layout {fingerprint.hex()[:16]} of model {model_id!r} is already registered "
                "by this tenant "
                f"with block_bytes={old.block_bytes} block_tokens={old.block_tokens} "
                f"key_width={old.key_width}"
            )
        if old is not None and (cost is None or old.cost == cost) and (
                not groups or old.groups == groups):
            return old
        if old is not None:  # a re-registration keeps what it does not restate
            info = LayoutInfo(lid, model_id, fingerprint, block_bytes, block_tokens, key_width,
                              cost if cost is not None else old.cost, groups or old.groups)
        self.layouts[(tenant.name, lid)] = info
        ns = self._namespaces.get((tenant.name, lid))
        if ns is not None:
            ns.layout = info
        return info

    def layout(self, tenant: Tenant, lid: bytes) -> LayoutInfo:
        """The caller's own registration of `lid`; NotFound otherwise (whoever else has it)."""
        info = self.layouts.get((tenant.name, lid))
        if info is None:
            raise NotFound(f"unknown layout {lid.hex()[:16]}: call RegisterLayout first")
        return info

    def get(self, tenant: Tenant, lid: bytes) -> NamespaceInfo:
        ns = self._namespaces.get((tenant.name, lid))
        if ns is None:
            layout = self.layout(tenant, lid)
            ns = NamespaceInfo(Namespace(tenant.name, lid), self.tenant(tenant.name, tenant),
                               layout)
            self._namespaces[(tenant.name, lid)] = ns
        return ns

    def tenant(self, name: str, tenant: Tenant | None = None) -> TenantUsage:
        """The usage of a tenant (created on first sight; quotas from `tenant`)."""
        usage = self.tenants.get(name)
        if usage is None:
            usage = self.tenants[name] = TenantUsage(tenant or Tenant(name))
        elif tenant is not None and usage.tenant != tenant:
            usage.tenant = tenant
        return usage

    def layouts_of(self, tenant: str) -> int:
        return sum(1 for name, _ in self.layouts if name == tenant)

    def charge(self, tenant: str, tier: Tier, nbytes: int) -> None:
        """Adds `nbytes` (negative: gives back) to `tenant`'s usage in `tier`. Only the applier
        calls it (`kvtier.daemon.cache.applier`: tenant bytes change in one place)."""
        usage = self.tenant(tenant)
        if tier is Tier.DRAM:
            usage.dram_bytes += nbytes
        else:
            usage.ssd_bytes += nbytes

    def ssd_quota_ok(self, tenant: str, nbytes: int) -> bool:
        usage = self.tenant(tenant)
        quota = usage.tenant.ssd_quota_bytes
        return not quota or usage.ssd_bytes + nbytes <= quota

    def split_keys(
        self, ns: NamespaceInfo, keys: bytes, key_width: int, unique: bool,
    ) -> list[bytes]:
        """The packed chain as a list of keys, validated against the layout and the limits."""
        width = ns.layout.key_width
        if key_width != width:
            raise InvalidArgument(f"key_width {key_width} does not match the layout's {width}")
        if len(keys) % width:
            raise InvalidArgument(f"keys length {len(keys)} is not a multiple of {width}")
        n = len(keys) // width
        if n > self.max_blocks:
            raise InvalidArgument(f"{n} keys exceed the limit of {self.max_blocks} per request")
        out = list(struct.unpack(f"{width}s" * n, keys))  # one C call: ~8x a slice per key
        if unique and len(set(out)) != n:
            raise InvalidArgument("keys repeat within the chain")
        return out
