"""Who gives up DRAM when the pool is full and several tenants use it: fair shares with
guaranteed minimums. Pure logic, no I/O; the cache's tiers execute the plan.

A tenant's *share* of the pool is the larger of its guarantee (`dram_guarantee` in the tokens
file) and an equal split of the pool among the tenants holding DRAM now (plus the one asking).
"Holding" counts every slot charged to the tenant: cached blocks, pinned ones, slots being written
and promotions in flight. When an allocation of `need` slots finds `short` too few free:

1. a tenant that would hold more than its share makes room from its own blocks first;
2. then the tenants over their share give up blocks, the furthest over first, never below it;
3. then (a tenant within its share) its own blocks.

So what a tenant can count on: while it holds no more than its share, other tenants' stores and
promotions never evict its DRAM blocks, and never below its guarantee at all; only its own
allocations, its quota, the SSD write-back path (which keeps the block on SSD) or its own leases
ending move them. A tenant that wants more than its share gets the free slots and what others hold
above theirs; beyond that it recycles its own blocks (LRU), or its request is refused
(RESOURCE_EXHAUSTED) when those are pinned.
"""

from __future__ import annotations

from collections.abc import Mapping


def shares(asker: str, held: Mapping[str, int], guarantee: Mapping[str, int],
           pool: int) -> dict[str, int]:
    """Each active tenant's share of a `pool`-slot pool (slots)."""
    active = {t for t, n in held.items() if n > 0} | {asker}
    split = pool // len(active)
    return {t: max(guarantee.get(t, 0), split) for t in active}


def room_plan(asker: str, need: int, short: int, held: Mapping[str, int],
              guarantee: Mapping[str, int], pool: int) -> list[tuple[str, int]]:
    """The order in which tenants give up DRAM blocks so `asker` gets `short` more slots:
    (tenant, at most how many) pairs; the caller evicts from each in turn (coldest first)
    until it has `short`. Slots everywhere."""
    share = shares(asker, held, guarantee, pool)
    over = held.get(asker, 0) + need > share[asker]
    plan = [(asker, short)] if over else []
    others = sorted((t for t in share if t != asker), key=lambda t: share[t] - held.get(t, 0))
    plan += [(t, held.get(t, 0) - share[t]) for t in others if held.get(t, 0) > share[t]]
    if not over:
        plan.append((asker, short))
    return plan
