"""What a `Cache` is built from. The shell derives it from the daemon's settings
(`kvtier.daemon.config.cache_spec`); the cache reads nothing else of the configuration, so it can
be built in-process (tests, benchmarks) from these specs alone. Frozen: a reload that changes a
live setting calls the owner of that setting (the write budget, the remote tier), never a spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers.dram import DramSpec
from kvtier.tiers.remote import RemoteSpec
from kvtier.tiers.ssd.types import SsdSpec

STORE_FINGERPRINT = b"kvtier-daemon-store/v1"
"""The SSD store's layout fingerprint: its blocks' headers name it (`kvtier.tiers.blockfmt`)."""

@dataclass(frozen=True, slots=True)
class RemoteTierSpec:
    """`queue_bytes` bounds the DRAM pinned by queued writes (slots); `write_bytes_per_s` is the
    long-run write rate, `burst_bytes` what may go at once."""

    queue_bytes: int
    write_bytes_per_s: float
    burst_bytes: int
    batch_blocks: int = 16
    backoff_first_s: float = 0.5
    backoff_max_s: float = 30.0


@dataclass(frozen=True, slots=True)
class SsdTier:
    """The SSD tier: its store, the wear budget (bytes a day, burst) and the write-back queue."""

    store: SsdSpec
    write_bytes_per_day: float
    write_burst_bytes: int
    queue_bytes: int


@dataclass(frozen=True, slots=True)
class RemoteTier:
    """The remote tier: the store, its write-through queue and rate, the k-th access that admits
    a block to it (1: every committed block), and how the store was named (for the log)."""

    store: RemoteSpec
    writes: RemoteTierSpec
    admit_after: int
    mode: str


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The DRAM pool, the optional SSD and remote tiers, the index's eviction policy and SSD
    admission (the k-th access), the lease rules (default and longest TTL, keys per request),
    the longest pin, and how long a Lookup may wait for blocks being written."""

    pool: DramSpec
    ssd: SsdTier | None
    remote: RemoteTier | None
    policy: str
    ssd_admit_after: int
    lease_ttl_s: float
    max_lease_ttl_s: float
    max_blocks_per_request: int
    max_pin_ttl_s: float = 86400.0  # the longest an operator's pin (or a request's hint) lasts
    max_pending_wait_s: float = 10.0
    """Longest a Lookup may wait for blocks being written (`LookupRequest.wait_pending_ms`)."""

    @property
    def ssd_bytes(self) -> int:
        """The SSD tier's capacity (0: no SSD tier)."""
        return self.ssd.store.capacity_bytes if self.ssd is not None else 0

    @property
    def max_block_bytes(self) -> int:
        return self.pool.max_block or self.pool.slot_size
