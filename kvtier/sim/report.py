"""One simulation's result: JSON document and human table. Pure formatting, no I/O."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvtier.core.units import format_bytes
from kvtier.sim.config import ReplayStats, TierConfig


class SimReport(NamedTuple):
    """A replay plus both ceilings, all at `config`'s capacities."""

    source: str
    distinct_blocks: int
    config: TierConfig
    block_bytes: int | None
    stats: ReplayStats
    infinite_hits: int
    belady_hits: int


def _ratio(n: int, d: int) -> float:
    return n / d if d else 0.0


def _bytes(blocks: int, block_bytes: int | None) -> int | None:
    return None if block_bytes is None else blocks * block_bytes


def to_json(r: SimReport) -> dict[str, Any]:
    """The `--json` document (stable keys; ratios are fractions of block references)."""
    s, c, refs = r.stats, r.config, r.stats.block_refs
    return {
        "source": r.source,
        "requests": s.requests,
        "block_refs": refs,
        "distinct_blocks": r.distinct_blocks,
        "capacity": {
            "dram_blocks": c.dram_blocks,
            "ssd_blocks": c.ssd_blocks,
            "block_bytes": r.block_bytes,
            "dram_bytes": _bytes(c.dram_blocks, r.block_bytes),
            "ssd_bytes": _bytes(c.ssd_blocks, r.block_bytes),
        },
        "policy": c.policy,
        "ssd_admit_k": c.ssd_admit_k,
        "admission_history": {"words": s.history_size, "recalled": s.history_recalled},
        "hits": s.hits,
        "hit_ratio": s.hit_ratio,
        "hit_ratio_by_tier": {"dram": _ratio(s.hits_dram, refs), "ssd": _ratio(s.hits_ssd, refs)},
        "infinite_hit_ratio": _ratio(r.infinite_hits, refs),
        "belady_hit_ratio": _ratio(r.belady_hits, refs),
        "belady_capacity_blocks": c.total_blocks,
        "promotions": s.promotions,
        "demotions": s.demotions,
        "ssd_blocks_written": s.ssd_blocks_written,
        "ssd_bytes_written": _bytes(s.ssd_blocks_written, r.block_bytes),
        "ssd_write_budget": None if c.ssd_write_bytes_per_day is None else {
            "bytes_per_day": c.ssd_write_bytes_per_day, "burst_bytes": c.ssd_write_burst_bytes,
            "block_write_bytes": c.ssd_block_bytes, "refused_writes": s.ssd_writes_refused},
        "dropped_dram": s.dropped_dram,
        "evicted_ssd": s.evicted_ssd,
        "inserted": s.inserted,
        "not_stored": s.not_stored,
        "stranded_blocks": s.stranded_blocks,
        "dram_blocks_end": s.dram_blocks_end,
        "ssd_blocks_end": s.ssd_blocks_end,
        "replay_seconds": s.seconds,
        "replay_cpu_seconds": s.cpu_seconds,
    }


def _cap(blocks: int, block_bytes: int | None) -> str:
    text = f"{blocks:,} blocks"
    return text if block_bytes is None else f"{text} ({format_bytes(blocks * block_bytes)})"


def _budget(c: TierConfig, block_bytes: int | None) -> str:
    per_day = c.ssd_write_bytes_per_day
    if per_day is None:
        return "no budget"
    if block_bytes is None:
        return f"budget {per_day:,.0f} blocks/day"
    return f"budget {format_bytes(int(per_day))}/day"


def format_table(r: SimReport) -> str:
    """The human report printed without `--json`."""
    s, c, refs = r.stats, r.config, r.stats.block_refs
    bb = r.block_bytes
    head = [
        f"{r.source}: {s.requests:,} requests, {refs:,} block refs (512 tokens each), "
        f"{r.distinct_blocks:,} distinct blocks",
        f"tiers: DRAM {_cap(c.dram_blocks, bb)}, SSD {_cap(c.ssd_blocks, bb)}; policy {c.policy}; "
        f"SSD admission on access {c.ssd_admit_k} (history {s.history_size:,} words)",
        "",
    ]
    rows: list[tuple[str, str, str]] = [
        ("prefix hits", f"{s.hits:,}", f"{s.hit_ratio:.1%}"),
        ("  from DRAM", f"{s.hits_dram:,}", f"{_ratio(s.hits_dram, refs):.1%}"),
        ("  from SSD", f"{s.hits_ssd:,}", f"{_ratio(s.hits_ssd, refs):.1%}"),
        ("ceiling: infinite cache", f"{r.infinite_hits:,}", f"{_ratio(r.infinite_hits, refs):.1%}"),
        (
            f"ceiling: Belady MIN at {c.total_blocks:,} blocks",
            f"{r.belady_hits:,}",
            f"{_ratio(r.belady_hits, refs):.1%}",
        ),
        ("promotions SSD -> DRAM", f"{s.promotions:,}", ""),
        ("demotions DRAM -> SSD", f"{s.demotions:,}", ""),
        (
            "SSD blocks written",
            f"{s.ssd_blocks_written:,}",
            "" if bb is None else format_bytes(s.ssd_blocks_written * bb),
        ),
        ("SSD writes refused by the write budget", f"{s.ssd_writes_refused:,}",
         _budget(c, bb)),
        ("dropped from DRAM (not on SSD)", f"{s.dropped_dram:,}", ""),
        ("evicted from SSD", f"{s.evicted_ssd:,}", ""),
        ("committed again with a remembered count", f"{s.history_recalled:,}", ""),
        ("missed blocks stored / not stored", f"{s.inserted:,} / {s.not_stored:,}", ""),
        ("stranded blocks (checked on the index)", f"{s.stranded_blocks:,}", ""),
        (
            "replay time (wall)",
            f"{s.seconds:.2f} s",
            f"{s.cpu_seconds:.2f} s CPU, {refs / s.seconds / 1e3:,.0f}k refs/s"
            if s.seconds > 0
            else "",
        ),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    body = [f"{a:<{w0}}  {b:>{w1}}  {x}".rstrip() for a, b, x in rows]
    foot = [
        "",
        "hits = longest cached prefix of each request; Belady MIN = the best any cache of DRAM+SSD",
        "blocks can do on this trace (clairvoyant; kvtier.sim.ceilings)",
    ]
    return "\n".join(head + body + foot)
