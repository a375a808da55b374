"""What a replay is given (`TierConfig`) and what it counts (`ReplayStats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtier.index.policies import DEFAULT_POLICY


@dataclass(frozen=True)
class TierConfig:
    """Capacities in trace blocks, the index's eviction policy, the SSD admission threshold, the
    admission history's size in words (None = the index's default; 0 = no history) and the SSD
    write budget as the daemon enforces it (`kvtier.core.wear.WriteBudget`: bytes a day, burst
    bytes, bytes one block write costs — payload and header; None = no budget)."""

    dram_blocks: int
    ssd_blocks: int = 0
    policy: str = DEFAULT_POLICY
    ssd_admit_k: int = 2
    admission_history: int | None = None
    ssd_write_bytes_per_day: float | None = None
    ssd_write_burst_bytes: int = 0
    ssd_block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dram_blocks < 0 or self.ssd_blocks < 0:
            raise ValueError("capacities must be >= 0 blocks")
        if self.ssd_admit_k < 1:
            raise ValueError(f"SSD admission k must be >= 1, got {self.ssd_admit_k}")
        if self.admission_history is not None and self.admission_history < 0:
            raise ValueError(f"admission history must be >= 0, got {self.admission_history}")
        if self.ssd_write_bytes_per_day is not None and not (
                self.ssd_write_bytes_per_day >= 0
                and 0 < self.ssd_block_bytes <= self.ssd_write_burst_bytes):
            raise ValueError("an SSD write budget needs bytes per day >= 0 and a burst that "
                             f"holds one block write (burst {self.ssd_write_burst_bytes}, "
                             f"block {self.ssd_block_bytes})")

    @property
    def total_blocks(self) -> int:
        """Distinct blocks the tiers can hold together (the ceilings' capacity)."""
        return self.dram_blocks + self.ssd_blocks


class ReplayStats(NamedTuple):
    """Counters of one replay. Hits follow the prefix rule of `kvtier.sim.ceilings`.

    hits_dram / hits_ssd: prefix-hit blocks by the fastest tier holding them at lookup.
    promotions: SSD-resident hits copied into DRAM. demotions: DRAM victims kept on SSD.
    ssd_blocks_written: blocks written to SSD (a demotion of a block that still has an SSD copy
    writes nothing). dropped_dram: DRAM victims not admitted to SSD, gone from the cache.
    evicted_ssd: blocks evicted from SSD. inserted: missed blocks committed into DRAM;
    not_stored: missed blocks left out, because the policy's DRAM admission refused them
    (`bypassed` of them) or every DRAM block was in use by the request.
    stranded_blocks: cached blocks whose parent is cached in no tier, counted on the index at the
    end (DESIGN invariant 2 says 0). dram_blocks_end / ssd_blocks_end: occupancy at the end.
    seconds / cpu_seconds: wall and process CPU time of the replay loop.
    history_size: words of the index's admission history (0 = off); history_recalled: missed
    blocks committed again that got their earlier access count back from it.
    ssd_writes_refused: write-backs the SSD write budget refused (the block stayed DRAM-only).
    hits_remote: blocks after the local prefix fetched from the shared remote tier (a fleet
    replay, `kvtier.sim.fleet`; 0 on one node without it).
    """

    requests: int
    block_refs: int
    hits_dram: int
    hits_ssd: int
    promotions: int
    demotions: int
    ssd_blocks_written: int
    dropped_dram: int
    evicted_ssd: int
    inserted: int
    not_stored: int
    stranded_blocks: int
    dram_blocks_end: int
    ssd_blocks_end: int
    seconds: float
    cpu_seconds: float
    history_size: int = 0
    history_recalled: int = 0
    bypassed: int = 0
    ssd_writes_refused: int = 0
    hits_remote: int = 0

    @property
    def hits(self) -> int:
        return self.hits_dram + self.hits_ssd + self.hits_remote

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.block_refs if self.block_refs else 0.0
