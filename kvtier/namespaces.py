"""Layouts, tenants and namespaces of one daemon, and the domain errors. Pure bookkeeping.

A namespace is (tenant, layout fingerprint), named `"<tenant>/<fingerprint hex>"` — the string
that keys blocks in the prefix index and in the SSD store. Requests are validated here against
their layout (key width, counts) before anything changes.

Not thread-safe: the cache calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.auth import Tenant
from kvtier.costmodel import CostModel
from kvtier.errors import KvtierError
from kvtier.types import Tier

KEY_WIDTHS = (16, 32)
FINGERPRINT_BYTES = (8, 64)


def namespace(tenant: str, fingerprint: bytes) -> str:
    return f"{tenant}/{fingerprint.hex()}"


def namespace_tenant(ns: str) -> str:
    return ns.rpartition("/")[0]


def namespace_layout(ns: str) -> bytes:
    return bytes.fromhex(ns.rpartition("/")[2])


class CacheError(KvtierError):
    """A request the cache refuses; the service maps the subclass to a gRPC status."""


class InvalidArgument(CacheError):
    pass


class NotFound(CacheError):
    pass


class PermissionDenied(CacheError):
    pass


class ResourceExhausted(CacheError):
    pass


class FailedPrecondition(CacheError):
    pass


class Unavailable(CacheError):
    """The daemon is draining: no new leases."""


@dataclass(frozen=True, slots=True)
class LayoutInfo:
    fingerprint: bytes
    block_bytes: int
    block_tokens: int
    key_width: int
    cost: CostModel | None


@dataclass(slots=True)
class TenantState:
    tenant: Tenant
    dram_bytes: int = 0
    ssd_bytes: int = 0


@dataclass(slots=True, eq=False)
class Namespace:
    name: str  # the index/SSD namespace string
    tenant: TenantState
    layout: LayoutInfo
    pending: dict[bytes, str] = field(default_factory=dict)  # key -> WRITE lease id


class Namespaces:
    """Registered layouts, known tenants (with their usage) and namespaces."""

    def __init__(self, slot_bytes: int, max_blocks_per_request: int) -> None:
        self.slot_bytes = slot_bytes
        self.max_blocks = max_blocks_per_request
        self.layouts: dict[bytes, LayoutInfo] = {}
        self.tenants: dict[str, TenantState] = {}
        self._namespaces: dict[tuple[str, bytes], Namespace] = {}

    def register(
        self, fingerprint: bytes, block_bytes: int, block_tokens: int, key_width: int,
        cost: CostModel | None,
    ) -> LayoutInfo:
        if not FINGERPRINT_BYTES[0] <= len(fingerprint) <= FINGERPRINT_BYTES[1]:
            raise InvalidArgument(
                f"layout fingerprint must be {FINGERPRINT_BYTES[0]}..{FINGERPRINT_BYTES[1]} "
                f"bytes, got {len(fingerprint)}"
            )
        if key_width not in KEY_WIDTHS:
            raise InvalidArgument(f"key_width must be 16 or 32, got {key_width}")
        if not 0 < block_bytes <= self.slot_bytes:
            raise InvalidArgument(
                f"block_bytes must be in 1..{self.slot_bytes} (the daemon's slot size), "
                f"got {block_bytes}"
            )
        if not 0 < block_tokens <= 1 << 20:
            raise InvalidArgument(f"block_tokens must be in 1..{1 << 20}, got {block_tokens}")
        info = LayoutInfo(fingerprint, block_bytes, block_tokens, key_width, cost)
        old = self.layouts.get(fingerprint)
        shape = (block_bytes, block_tokens, key_width)
        if old is not None and (old.block_bytes, old.block_tokens, old.key_width) != shape:
            raise FailedPrecondition(
                f"layout {fingerprint.hex()[:16]} is already registered with "
                f"block_bytes={old.block_bytes} block_tokens={old.block_tokens} "
                f"key_width={old.key_width}"
            )
        if old is not None and (cost is None or old.cost == cost):
            return old
        self.layouts[fingerprint] = info
        for ns in self._namespaces.values():
            if ns.layout.fingerprint == fingerprint:
                ns.layout = info
        return info

    def layout(self, fingerprint: bytes) -> LayoutInfo:
        info = self.layouts.get(fingerprint)
        if info is None:
            raise NotFound(f"unknown layout {fingerprint.hex()[:16]}: call RegisterLayout first")
        return info

    def get(self, tenant: Tenant, fingerprint: bytes) -> Namespace:
        ns = self._namespaces.get((tenant.name, fingerprint))
        if ns is None:
            layout = self.layout(fingerprint)
            ns = Namespace(namespace(tenant.name, fingerprint), self.tenant(tenant.name, tenant),
                           layout)
            self._namespaces[(tenant.name, fingerprint)] = ns
        return ns

    def tenant(self, name: str, tenant: Tenant | None = None) -> TenantState:
        """The usage record of a tenant (created on first sight; quotas from `tenant`)."""
        state = self.tenants.get(name)
        if state is None:
            state = self.tenants[name] = TenantState(tenant or Tenant(name))
        elif tenant is not None and state.tenant != tenant:
            state.tenant = tenant
        return state

    def charge(self, tenant: str, tier: Tier, nbytes: int) -> None:
        state = self.tenant(tenant)
        if tier is Tier.DRAM:
            state.dram_bytes += nbytes
        else:
            state.ssd_bytes += nbytes

    def ssd_quota_ok(self, tenant: str, nbytes: int) -> bool:
        state = self.tenant(tenant)
        quota = state.tenant.ssd_quota_bytes
        return not quota or state.ssd_bytes + nbytes <= quota

    def split_keys(self, ns: Namespace, keys: bytes, key_width: int, unique: bool) -> list[bytes]:
        """The packed chain as a list of keys, validated against the layout and the limits."""
        width = ns.layout.key_width
        if key_width != width:
            raise InvalidArgument(f"key_width {key_width} does not match the layout's {width}")
        if len(keys) % width:
            raise InvalidArgument(f"keys length {len(keys)} is not a multiple of {width}")
        n = len(keys) // width
        if n > self.max_blocks:
            raise InvalidArgument(f"{n} keys exceed the limit of {self.max_blocks} per request")
        out = list(map(keys.__getitem__, map(slice, range(0, len(keys), width),
                                             range(width, len(keys) + width, width))))
        if unique and len(set(out)) != n:
            raise InvalidArgument("keys repeat within the chain")
        return out
