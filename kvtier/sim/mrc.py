"""The online MRC (`kvtier.index.mrc`) against replays: what the estimator says about a trace at the
daemon's capacity grid, and what `kvtier simulate`'s replay measures there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvtier.index.mrc import FACTORS, ReuseSampler, capacity_grid, labelled
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import key_of, replay
from kvtier.sim.trace import Request


class Compared(NamedTuple):
    """One capacity: which tier is scaled by what, the blocks, the estimate and the replay."""

    scaled: str
    factor: float
    dram_blocks: int
    ssd_blocks: int
    estimated: float
    replayed: float

    @property
    def error(self) -> float:
        return self.estimated - self.replayed


def estimate(requests: Sequence[Request], sampler: ReuseSampler, ns: object = 0) -> None:
    """Feeds every request of the trace to `sampler` as one lookup of its whole chain."""
    for r in requests:
        sampler.observe(ns, [key_of(i) for i in r.hash_ids])


def compare(
    requests: Sequence[Request], dram_blocks: int, ssd_blocks: int, *, admit_k: int = 2,
    max_keys: int, ns: object = 0, factors: Sequence[float] = FACTORS,
) -> tuple[list[Compared], ReuseSampler]:
    """Estimate at the `capacity_grid` of (dram_blocks, ssd_blocks), then replay each point
    under `lru`, the policy the estimator models (LRU reuse distances), whatever the default."""
    grid = capacity_grid(dram_blocks, ssd_blocks, factors)
    sampler = ReuseSampler(grid, admit_k=admit_k, max_keys=max_keys)
    estimate(requests, sampler, ns)
    out = []
    for scaled, factor, p in labelled(sampler.points(), factors):
        real = replay(requests, TierConfig(p.dram_blocks, p.ssd_blocks, policy="lru",
                                           ssd_admit_k=admit_k))
        out.append(Compared(scaled, factor, p.dram_blocks, p.ssd_blocks, p.hit_ratio,
                            real.hit_ratio))
    return out, sampler
