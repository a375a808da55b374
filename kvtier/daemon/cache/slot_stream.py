"""`LeasedSlots`, the cache's `kvtier.daemon.cache.api.SlotStream`: a streaming call's view of
the slots its lease holds (ReadBlocks reads them, WriteBlocks fills them), and the rule that a
slot is touched only under a live lease that holds it.

Every chunk takes the cache lock, checks that the stream's lease is still in the lease table (same
tenant, same kind), and copies its bytes out of or into the slot before letting go of the lock. A
lease leaves the table — and its slots are freed for reuse — only under that lock (Release,
Commit, Abort, the reaper's expiry, a session's end), so once a lease is gone its stream can never
touch the slot again: a stream that stalls past its TTL fails at its next chunk (NotFound) instead
of reading bytes another tenant wrote there since, or writing into a block another tenant
committed. A chunk renews the lease once half its TTL has passed and the stream has moved
`RENEW_BYTES` since the last renewal, so a stream that keeps moving keeps its lease; one that
stops — or trickles, a byte now and then — loses it after the TTL like any other holder.

Threading: any thread; `read`/`write` take the cache lock (an RLock: callers may hold it).
"""

from __future__ import annotations

import threading
from typing import Protocol, TypeAlias, cast

from kvtier.core.errors import NotFound
from kvtier.daemon.cache.leases import LeaseKind, LeaseTable
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.tiers.dram import DramPool

Buffer: TypeAlias = bytes | memoryview
RENEW_BYTES = 64 << 10


class SlotHolder(Protocol):
    """A lease payload that names its slots (`WriteLease`, `ReadLease`): slot ids, not
    offsets (an isolated pool's offsets are per region)."""

    def slot_of(self, block: int) -> int: ...


class LeasedSlots:
    """The slots of one lease (block i = the lease's i-th slot, at pool offset `offsets[i]`)."""

    def __init__(self, lock: threading.RLock, leases: LeaseTable, pool: DramPool,
                 tenant: Tenant, lease_id: str, offsets: list[int], block_bytes: int,
                 ttl_s: float = 0.0) -> None:
        """`ttl_s`: the lease's TTL (what a transport may wait for its client at most)."""
        self._lock = lock
        self._leases = leases
        self._pool = pool
        self.tenant = tenant
        self.lease_id = lease_id
        self.offsets = offsets
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.copied = 0  # bytes read or written so far (what Release/Commit report)
        self._renewed_at = 0  # `copied` at the last renewal

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, block: int, at: int, n: int, head: bytes = b"") -> bytes:
        """`head` followed by up to `n` bytes of block `block` from byte `at` (one copy).
        Raises NotFound once the lease ended."""
        out = self._chunk(LeaseKind.READ, block, at, n, None, head)
        self.copied += len(out) - len(head)
        return out

    def write(self, block: int, at: int, data: Buffer) -> None:
        """`data` into block `block` at byte `at`. Raises NotFound once the lease ended."""
        self._chunk(LeaseKind.WRITE, block, at, len(data), data)
        self.copied += len(data)

    def _chunk(self, kind: LeaseKind, block: int, at: int, n: int, data: Buffer | None,
               head: bytes = b"") -> bytes:
        with self._lock:
            lease = self._leases.get(self.lease_id)
            if lease is None or lease.tenant != self.tenant.name or lease.kind is not kind:
                raise NotFound(
                    f"lease {self.lease_id[:12]!r} of this stream expired or ended (a stream "
                    "stalled past its TTL loses its slots)"
                )
            if (lease.expires_at - self._leases.clock() < lease.ttl_s / 2
                    and self.copied - self._renewed_at >= RENEW_BYTES):
                self._leases.renew(lease.id, lease.ttl_s)
                self._renewed_at = self.copied
            # the lease's own slot: pinned, never moved nor freed while the lease lives
            slot = cast(SlotHolder, lease.payload).slot_of(block)
            view = memoryview(self._pool.view(slot, self.block_bytes))  # type: ignore[arg-type]
            if data is None:
                return head + view[at : at + n]
            view[at : at + len(data)] = data
            return b""
