"""The placement planner: where blocks go, decided once for the daemon and for `kvtier simulate`.

Pure functions over a `kvtier.index.prefix.PrefixIndex`; the daemon (`kvtier.daemon.residency`)
and the simulator (`kvtier.sim.replay`) call the same ones at the same points of a request, so
the simulator's hits and SSD writes are the daemon's (tests/test_sim_equals_daemon.py replays one
trace through both):

    write_backs  which blocks of a looked-up or just committed chain go to SSD now: DRAM-only,
                 admitted by the index's rule (the k-th access), root first and only under a
                 parent that is on SSD or goes before it (SSD stays prefix-closed). Intents:
                 the caller checks quota and wear budget, copies, then records each SSD copy
                 with `add_tier`, stopping at the first it cannot write.
    ssd_room     evicts SSD victims (the index's order) until `need` more blocks fit.
    dram_room    evicts DRAM victims (the index's order: demotion of blocks on SSD, else
                 leaf-first drops) until `n` blocks fit; nothing when even every unpinned block
                 would not make room.

Evictions change the index, which journals them (`PrefixIndex.take_changes`): the daemon's
applier frees their slots and deletes their SSD keys; the simulator only counts. The daemon's
pool has size classes of several block sizes; with one size (the simulator's, and a daemon whose
layouts share one block size) a DRAM victim frees one slot, and `dram_room` is the whole rule.

Threading: none; the daemon calls these under its cache lock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import NamedTuple

from kvtier.core.types import BlockKey, Tier
from kvtier.index.prefix import Block, PrefixIndex, Tenant

_DRAM, _SSD = Tier.DRAM, Tier.SSD


class WriteBack(NamedTuple):
    """An intent: copy `key` (in DRAM slot `slot`; None in an index without slot ids) to SSD."""

    tenant: Tenant
    key: BlockKey
    parent: BlockKey | None
    slot: int | None


def write_backs(
    index: PrefixIndex, tenant: Tenant, blocks: Sequence[Block],
    queued: Container[BlockKey] = (),
) -> list[WriteBack]:
    """The write-backs `blocks` (a chain, root first, e.g. a Lookup's prefix or a Commit's new
    blocks) call for now; `queued`: this tenant's keys already on their way to SSD (they count
    as on SSD for their children). [] without an SSD tier."""
    if index.capacity(_SSD) == 0:
        return []
    out: list[WriteBack] = []
    planned: set[BlockKey] = set()
    for b in blocks:
        if b.on_ssd or b.key in queued:
            continue
        p = b.parent
        if p is not None and not p.on_ssd and p.key not in queued and p.key not in planned:
            break
        if not b.in_dram or not index.admits(b):
            break
        out.append(WriteBack(tenant, b.key, None if p is None else p.key, b.dram_slot))
        planned.add(b.key)
    return out


def ssd_room(index: PrefixIndex, need: int) -> bool:
    """Evicts SSD victims until `need` more blocks fit the index's SSD bound; False (after
    evicting what it could) when they cannot."""
    free = index.free(_SSD)
    if free is None or free >= need:
        return True
    index.evict_count(_SSD, need - free)
    return (index.free(_SSD) or 0) >= need


def dram_room(index: PrefixIndex, n: int, free: int, pinned: int) -> int:
    """Evicts DRAM victims until `n` blocks fit; returns the free blocks then. `free`: free
    slots now; `pinned`: DRAM blocks that cannot leave (leased, being written). Evicts nothing
    when fewer than `n - free` blocks could ever leave."""
    if free >= n:
        return free
    evictable = index.blocks(_DRAM) - pinned
    if evictable <= 0 or evictable < n - free:
        return free
    while free < n:
        gone = index.evict_count(_DRAM, n - free)
        if not gone:
            break
        free += gone
    return free
