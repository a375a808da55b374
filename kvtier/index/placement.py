"""The placement planner: where blocks go, decided once for the daemon and for `kvtier simulate`.

Functions over a `kvtier.index.prefix.PrefixIndex`; the daemon
(`kvtier.daemon.cache.residency`) and the simulator (`kvtier.sim.replay`) call the same ones at the
same points of a request, so the simulator's hits and SSD writes are the daemon's
(tests/test_sim_equals_daemon.py replays one trace through both):

    write_backs  which blocks of a looked-up or just committed chain go to SSD now: DRAM-only,
                 admitted by the index's rule (the k-th access), root first and only under a
                 parent that is on SSD or goes before it (SSD stays prefix-closed). Intents:
                 the caller checks quota and wear budget, copies, then records each SSD copy
                 with `add_tier`, stopping at the first it cannot write.
    ssd_room     evicts SSD victims (the index's order) until `need` more blocks fit. Acts,
                 atomically: all the victims needed, or none when fewer can leave (counted
                 first, leaf-first drops included) and it reports no room.
    dram_room    evicts DRAM victims (the index's order: demotion of blocks on SSD, else
                 leaf-first drops) until `n` blocks fit, and returns the free count reached.
                 Acts, best effort and not atomically: nothing when fewer unpinned DRAM blocks
                 than missing slots exist, but past that check it may evict some and still
                 fall short (a pinned block's DRAM-only ancestors cannot leave either); the
                 simulator stores the part of a chain that fits.
    room_hopeless whether no eviction can make room for `n` blocks (nothing to evict; or one
                 size class and fewer evictable blocks than missing slots), so none is made.
    over_quota   how many of its blocks a tenant must give up for more bytes to fit its DRAM
                 quota (the caller evicts them with `tenant_victims`, then asks again).
    tenant_victims  one tenant's evictable DRAM blocks, coldest first (quota, its region of an
                 isolated pool):
                 intents the caller drops; dropping a leaf exposes its parent, so the caller
                 asks again until it has dropped enough or none is left.
    class_victim with several size classes, a victim frees a slot only its own class can use:
                 evicts one DRAM victim (the caller tries to empty a page after each); with
                 one class `dram_room` is the rule.
    promotions   which blocks of an acquired prefix are promoted into DRAM: the SSD-only ones,
                 in chain order (the prefix ends before the first that gets no slot).
    remote_offers which blocks go to the remote tier: at Commit all new DRAM blocks when its
                 admission is the first access (k = 1), else, at a Lookup, those whose hits
                 reach k.
    remote_fetches how many keys after an acquired prefix are fetched from the remote tier,
                 each into a DRAM slot claimed for it (evicting for room): the keys the store
                 holds, by its existence check, and only after a whole local prefix — never a
                 slot for a key the store does not hold.

`ssd_room`, `dram_room` and `class_victim` evict; the others are pure: they decide and change
nothing (intents the caller applies). Evictions
change the index, which journals them (`PrefixIndex.take_changes`): the daemon's
applier frees their slots and deletes their SSD keys; the simulator only counts. The daemon's
pool has size classes of several block sizes; with one size (the simulator's, and a daemon whose
layouts share one block size) a DRAM victim frees one slot, and `dram_room` is the whole rule.

Threading: none; the daemon calls these under its cache lock.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Generic, NamedTuple

from kvtier.core.types import BlockKey, Tier
from kvtier.index.prefix import Block, NsT, PrefixIndex

_DRAM, _SSD = Tier.DRAM, Tier.SSD


class WriteBack(NamedTuple, Generic[NsT]):
    """An intent: copy `key` (in DRAM slot `slot`; None in an index without slot ids) to SSD."""

    ns: NsT
    key: BlockKey
    parent: BlockKey | None
    slot: int | None


def write_backs(
    index: PrefixIndex[NsT], ns: NsT, blocks: Sequence[Block[NsT]],
    queued: Container[BlockKey] = (),
) -> list[WriteBack[NsT]]:
    """The write-backs `blocks` (a chain, root first, e.g. a Lookup's prefix or a Commit's new
    blocks) call for now; `queued`: this namespace's keys already on their way to SSD (they count
    as on SSD for their children). [] without an SSD tier."""
    if index.capacity(_SSD) == 0:
        return []
    out: list[WriteBack[NsT]] = []
    planned: set[BlockKey] = set()
    for b in blocks:
        if b.on_ssd or b.key in queued:
            continue
        p = b.parent
        if p is not None and not p.on_ssd and p.key not in queued and p.key not in planned:
            break
        if not b.in_dram or not index.admits(b):
            break
        out.append(WriteBack(ns, b.key, None if p is None else p.key, b.dram_slot))
        planned.add(b.key)
    return out


def ssd_room(index: PrefixIndex[NsT], need: int) -> bool:
    """Evicts SSD victims until `need` more blocks fit the index's SSD bound; False, having
    evicted nothing, when fewer can leave (`_ssd_can_drop`)."""
    free = index.free(_SSD)
    if free is None or free >= need:
        return True
    if not _ssd_can_drop(index, need - free):
        return False
    index.evict_count(_SSD, need - free)
    return (index.free(_SSD) or 0) >= need


def _ssd_can_drop(index: PrefixIndex[NsT], n: int) -> bool:
    """Whether SSD eviction can drop `n` blocks: the SSD queue's (unpinned SSD-only leaves),
    then each SSD-only unpinned parent whose children all go before it, counted without
    changing anything. O(n) when the queue holds n; else O(queue + the parents it frees)."""
    leaves = index.victims(_SSD, n)
    if len(leaves) >= n:
        return True
    left: dict[Block[NsT], int] = {}  # a parent's children not yet counted as dropped
    going, count = leaves, 0
    while going:
        b = going.pop()
        count += 1
        if count >= n:
            return True
        p = b.parent
        if p is None or p.pins or p.in_dram or not p.on_ssd:
            continue
        left[p] = k = left.get(p, p.children) - 1
        if not k:
            going.append(p)
    return False


def dram_room(index: PrefixIndex[NsT], n: int, free: int, pinned: int) -> int:
    """Evicts DRAM victims until `n` blocks fit, best effort; returns the free blocks then
    (fewer than `n` when it fell short, having evicted what it could). `free`: free slots now;
    `pinned`: DRAM blocks that cannot leave (leased, being written). Evicts nothing when fewer
    than `n - free` DRAM blocks are unpinned."""
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


def room_hopeless(index: PrefixIndex[NsT], n: int, room: int, pinned: int, one_class: bool) -> bool:
    """Whether no eviction can make room for `n` blocks (`room` free slots of their class now,
    `pinned` DRAM blocks that cannot leave): nothing is evictable, or — one size class, where
    a victim frees one slot — fewer evictable blocks than the slots missing. With several
    classes a victim may empty a page of another: not judged here."""
    evictable = index.blocks(_DRAM) - pinned
    return evictable <= 0 or (one_class and evictable < n - room)


def over_quota(held: int, more: int, quota: int, stride: int) -> int:
    """Blocks of `stride` bytes a tenant holding `held` bytes must give up so `more` bytes fit
    its `quota` (0: they fit, or no quota)."""
    if not quota or held + more <= quota:
        return 0
    return -(-(held + more - quota) // stride)


def tenant_victims(index: PrefixIndex[NsT], owner: Callable[[NsT], str], tenant: str,
                   n: int) -> list[Block[NsT]]:
    """Up to `n` of `tenant`'s evictable DRAM blocks, coldest first (the index's order); the
    index's namespaces map to tenants by `owner`. O(evictable blocks)."""
    return [b for b in index.victims(_DRAM, 1 << 30) if owner(b.ns) == tenant][:n]


def class_victim(index: PrefixIndex[NsT]) -> bool:
    """Evicts one DRAM victim (the index's order); False when none can go."""
    return bool(index.evict_count(_DRAM, 1))


def promotions(blocks: Sequence[Block[NsT]]) -> list[int]:
    """Positions of the blocks of an acquired prefix (pinned, root first) to promote into
    DRAM: those not in DRAM (SSD-only), in order. The caller gives each a slot (`dram_room`
    or the daemon's claim) and cuts the prefix before the first that gets none."""
    return [i for i, b in enumerate(blocks) if not b.in_dram]


def remote_offers(blocks: Sequence[Block[NsT]], committed: bool, k: int) -> list[Block[NsT]]:
    """The blocks of a chain to offer to the remote tier, whose admission is the `k`-th access:
    at Commit (`committed`) every new DRAM block when k is 1, none otherwise; at a Lookup the
    DRAM blocks whose hits reach k just now."""
    if committed and k > 1:
        return []
    return [b for b in blocks if b.in_dram and (committed or b.hits == k)]


def remote_fetches(acquired: int, checked: int, held: int) -> int:
    """How many keys after an Acquire's pinned prefix (`acquired` blocks, after promotions) get a
    DRAM slot each and are fetched from the remote tier. The store's existence check found `held`
    keys of the chain after its first `checked` (the local prefix when it was asked): those
    still after the prefix. None when the prefix ends before `checked` (a block got no slot, or
    left meanwhile): the chain then goes on with a block the store was not asked about. A claim
    evicts for room, so a slot claimed for a key the store does not hold would evict a useful
    block for nothing."""
    if acquired < checked:
        return 0
    return max(0, checked + held - acquired)
