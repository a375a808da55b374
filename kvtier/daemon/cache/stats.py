"""What the cache reports: `CacheStats` (the Stats RPC, `kvtier stats`) and the pool gauges the
metrics registry reads at scrape time. Read-only over the cache's parts.

Threading: `cache_stats` is called with the cache lock held; `pool_gauges` reads the write budget
and mover, which lock themselves.
"""

from __future__ import annotations

from kvtier.core.types import Tier
from kvtier.daemon.cache.api import CacheStats, GroupUsage
from kvtier.daemon.cache.leases import LeaseKind, LeaseTable
from kvtier.daemon.cache.namespaces import Namespace, Namespaces, Tenant
from kvtier.daemon.cache.residency import Residency
from kvtier.daemon.cache.spec import CacheSpec
from kvtier.daemon.metrics import MrcGauges, MrcPoint, PoolGauges
from kvtier.index.mrc import ReuseSampler, capacity_grid, keys_for_budget, labelled, memory_bytes


def group_usage(residency: Residency, names: Namespaces, tenant: str | None
                ) -> tuple[GroupUsage, ...]:
    """Per (model, group) of the layouts that declared groups (of `tenant` only, or of all):
    bytes per tier. O(the blocks of those layouts): for statistics."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for (name, lid), info in names.layouts.items():
        if not info.groups or (tenant is not None and name != tenant):
            continue
        ns = Namespace(name, lid)
        dram = residency.index.blocks_of(ns.__eq__, Tier.DRAM)  # the index keys are str: a bool
        ssd = residency.index.blocks_of(ns.__eq__, Tier.SSD)
        for group, nbytes in info.groups:
            d, s = out.get((info.model_id, group), (0, 0))
            out[(info.model_id, group)] = (d + dram * nbytes, s + ssd * nbytes)
    return tuple(GroupUsage(m, g, d, s) for (m, g), (d, s) in sorted(out.items()))


def cache_stats(
    residency: Residency, leases: LeaseTable, names: Namespaces, tenant: Tenant | None,
) -> CacheStats:
    ps = residency.pool.stats()
    ss = residency.store.stats() if residency.store is not None else None
    usage = names.tenants.get(tenant.name) if tenant else None
    if tenant is not None and not tenant.admin:
        name = tenant.name

        def of_tenant(ns: object) -> bool:
            return isinstance(ns, Namespace) and ns.tenant == name

        mine = [lease for lease in leases if lease.tenant == tenant.name]
        return CacheStats(
            ps.bytes_reserved, usage.dram_bytes if usage else 0,
            residency.index.blocks_of(of_tenant, Tier.DRAM),
            ss.capacity_bytes if ss else 0, usage.ssd_bytes if usage else 0,
            residency.index.blocks_of(of_tenant, Tier.SSD),
            sum(1 for lease in mine if lease.kind is LeaseKind.READ),
            sum(1 for lease in mine if lease.kind is LeaseKind.WRITE),
            names.layouts_of(tenant.name), usage.dram_bytes if usage else 0,
            usage.ssd_bytes if usage else 0, False,
            usage.lookups if usage else 0, usage.blocks_hit if usage else 0,
            usage.blocks_missed if usage else 0, group_usage(residency, names, tenant.name),
            usage.verified if usage else 0, usage.mismatched if usage else 0,
            usage.quarantined if usage else 0,
        )
    every = names.tenants.values()
    return CacheStats(
        ps.bytes_reserved, ps.bytes_used, residency.index.blocks(Tier.DRAM),
        ss.capacity_bytes if ss else 0, ss.used_bytes if ss else 0,
        residency.index.blocks(Tier.SSD),
        leases.count(LeaseKind.READ), leases.count(LeaseKind.WRITE),
        len(names.layouts), usage.dram_bytes if usage else 0,
        usage.ssd_bytes if usage else 0, groups=group_usage(residency, names, None),
        verified=sum(u.verified for u in every), mismatched=sum(u.mismatched for u in every),
        quarantined=sum(u.quarantined for u in every),
    )


def pool_gauges(s: CacheStats, residency: Residency) -> PoolGauges:
    used_ratio = budget_rate = 0.0
    if residency.budget is not None:
        b = residency.budget.stats()
        used_ratio = 1.0 - b.available_bytes / b.burst_bytes if b.burst_bytes else 0.0
        budget_rate = b.rate_bytes_per_s
    mover = residency.mover
    return PoolGauges(
        {"dram": s.dram_capacity_bytes, "ssd": s.ssd_capacity_bytes},
        {"dram": s.dram_used_bytes, "ssd": s.ssd_used_bytes},
        {"dram": s.dram_blocks, "ssd": s.ssd_blocks},
        {"read": s.read_leases, "write": s.write_leases},
        used_ratio, mover.stats().queue_depth if mover else 0, budget_rate,
        {(g.model_id, g.group): {"dram": g.dram_bytes, "ssd": g.ssd_bytes} for g in s.groups},
    )


MRC_MIN_KEYS = 8192
"""The MRC estimator tracks at least this many keys (~1 MiB) whatever the index's size: fewer
sampled keys make the curve too noisy to act on (see `kvtier.index.mrc`)."""
INDEX_BYTES_PER_BLOCK = 288
"""Index memory per cached block with a DRAM slot (tracemalloc, bench/mrc.py and bench/index.py);
the MRC's budget is 1% of it times the index's capacity."""


def new_sampler(spec: CacheSpec, ssd_blocks: int, dram_blocks: int | None = None
                ) -> ReuseSampler:
    """The daemon's MRC estimator: capacities `capacity_grid` of its DRAM and SSD blocks
    (DRAM: `dram_blocks`, by default its smallest slots), memory bounded to 1% of the full
    index's (but at least `MRC_MIN_KEYS` keys)."""
    dram = spec.pool.slot_count if dram_blocks is None else dram_blocks
    budget = (dram + ssd_blocks) * INDEX_BYTES_PER_BLOCK // 100
    grid = capacity_grid(dram, ssd_blocks)
    ssd_points = sum(1 for _d, s in grid if s)
    return ReuseSampler(grid, admit_k=spec.ssd_admit_after,
                        max_keys=max(MRC_MIN_KEYS, keys_for_budget(budget, ssd_points)))


def mrc_gauges(sampler: ReuseSampler) -> MrcGauges:
    """The estimator's curve (its hit ratios mean nothing before `MIN_SAMPLES` sampled block
    references: /metrics leaves them out until then, Stats says how many there are)."""
    return MrcGauges(
        [MrcPoint(scaled, f, p.dram_blocks, p.ssd_blocks, p.dram_hit_ratio, p.hit_ratio)
         for scaled, f, p in labelled(sampler.points())],
        sampler.rate, sampler.tracked_keys, memory_bytes(sampler), sampler.sampled_refs,
    )
