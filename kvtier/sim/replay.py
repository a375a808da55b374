"""Replay a trace through the real `kvtier.index.prefix.PrefixIndex` and the daemon's placement
planner (`kvtier.index.placement`), step by step as the daemon serves a request.

Per request, in arrival order (one tenant; trace id i is the 8-byte big-endian key of block i):

  1. Lookup: `index.lookup` returns the longest cached prefix and each block's best tier; those
     blocks are the request's hits (by tier), and the lookup counts an access on each. Then the
     write-backs the planner calls for (`placement.write_backs`: DRAM-only blocks that reached
     the k-th access, under a parent on SSD), each after SSD room (`placement.ssd_room`) and
     the SSD write budget; a write-back the budget refuses ends the chain's write-backs
     (counted in `ssd_writes_refused`).
  2. Acquire: the prefix is pinned until the request ends; each SSD-only block is promoted
     into DRAM (`index.promote`; the SSD copy stays) after `placement.dram_room` made a slot;
     the prefix ends before a block that gets none.
  3. Allocate: `index.admit` says how many of the missed blocks the policy stores (all, for
     LRU; a prefix of them for policies with DRAM admission, e.g. without a partial last
     block); `placement.dram_room` makes room for them. A request longer than what DRAM can
     give it stores the first blocks that fit (the rest is a suffix: nothing is stranded): what
     an engine that saves chunk by chunk gets, where the daemon refuses a single Allocate of
     the whole run — the one place the simulator is not the daemon.
  4. Commit: the admitted missed blocks are inserted into DRAM in chain order (`index.insert`),
     then the planner's write-backs of the new blocks (k = 1, or a count the admission history
     gave back), as in 1.
  5. Release: the pins are dropped.

This is the daemon's order and its rules (tests/test_sim_equals_daemon.py replays one trace
through both and compares hits and SSD writes exactly). The write budget is the daemon's token
bucket (`kvtier.core.wear.WriteBudget`) on the trace's clock (its timestamps, ms).

Movement counters come from the index's own eviction counters; `stranded_blocks` is recounted on
the index after the replay, never assumed.

Model limits: requests are served one at a time in trace order (timestamps order them and drive
the budget's clock; no overlap between requests, no lease expiry, no HBM tier); every missed
block is committed at once, as if its prefill had finished before the next request arrives; a
write-back is on SSD at once (the daemon's queue is drained between requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.core.types import Tier
from kvtier.core.wear import WriteBudget
from kvtier.index import placement
from kvtier.index.prefix import Block, PrefixIndex, Tenant
from kvtier.sim.config import ReplayStats, TierConfig
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request

TENANT = 0
_PROGRESS_EVERY = 256


def key_of(block_id: int) -> bytes:
    """The index key standing for trace block id `block_id`."""
    return block_id.to_bytes(8, "big")


def new_index(config: TierConfig) -> PrefixIndex:
    return PrefixIndex(
        dram_blocks=config.dram_blocks,
        ssd_blocks=config.ssd_blocks,
        policy=config.policy,
        admission_k=config.ssd_admit_k,
        admission_history=config.admission_history,
    )


class _Writer:
    """Applies the planner's write-back intents at once, under the SSD write budget."""

    def __init__(self, idx: PrefixIndex, config: TierConfig, now: list[float],
                 tenant: Tenant) -> None:
        self.idx = idx
        self.tenant = tenant
        self.cost = config.ssd_block_bytes
        self.budget = None if config.ssd_write_bytes_per_day is None else WriteBudget(
            config.ssd_write_bytes_per_day, config.ssd_write_burst_bytes,
            clock=lambda: now[0] / 1000.0)
        self.refused = 0

    def write(self, blocks: list[Block]) -> bool:
        """Writes back what the planner calls for, as the daemon does: each write-back is
        pinned while it waits (room is made for it and those before it), then all are
        recorded on SSD in order, each unpinned first. True if SSD victims were evicted for
        room (they may have been blocks of `blocks`' own chain)."""
        idx, tenant, evicted = self.idx, self.tenant, False
        queued: list[bytes] = []
        for w in placement.write_backs(idx, tenant, blocks):
            need = 1 + len(queued)
            free = idx.free(Tier.SSD)
            evicted = evicted or (free is not None and free < need)
            if not placement.ssd_room(idx, need):
                break
            if self.budget is not None and not self.budget.try_spend(self.cost):
                self.refused += 1
                break
            idx.pin(tenant, w.key)
            queued.append(w.key)
        for key in queued:
            idx.unpin(tenant, key)
            idx.add_tier(tenant, key, Tier.SSD)
        return evicted


def replay(
    requests: Sequence[Request],
    config: TierConfig,
    progress: Callable[[int], None] | None = None,
    index: PrefixIndex | None = None,
    *,
    tenant: Tenant = TENANT,
    key_bytes: int = 8,
) -> ReplayStats:
    """Replay `requests` (see the module docstring). `index`, if given, must be empty and is left
    in its final state for inspection; `progress(n)` is called every few hundred requests.
    `tenant` and `key_bytes` (trace id i is the big-endian key of that width) name the blocks
    in the index; a daemon's own names make its admission history and policy hashes the same
    (the equality test)."""
    idx = new_index(config) if index is None else index
    if len(idx):
        raise ValueError("replay needs an empty index")
    dram, ssd = Tier.DRAM, Tier.SSD
    lookup, insert, promote, admit = idx.lookup, idx.insert, idx.promote, idx.admit
    pin, unpin, free = idx.pin, idx.unpin, idx.free
    dram_room = placement.dram_room
    now = [0.0]
    writer = _Writer(idx, config, now, tenant)
    write = writer.write if config.ssd_blocks else None
    hits_dram = hits_ssd = promotions = inserted = not_stored = bypassed = refs = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for n, req in enumerate(requests, start=1):
        now[0] = req.timestamp
        keys = [i.to_bytes(key_bytes, "big") for i in req.hash_ids]
        refs += len(keys)
        # Lookup
        prefix = lookup(tenant, keys)
        tiers = prefix.tiers
        h = len(tiers)
        on_ssd = tiers.count(ssd)
        hits_ssd += on_ssd
        hits_dram += h - on_ssd
        held = prefix.blocks
        if write is not None and h and write(held):
            held = lookup(tenant, keys, touch=False).blocks  # as Acquire looks again
        start = len(held)
        # Acquire
        for b in held:
            pin(tenant, b.key)
        promoted = 0
        if on_ssd:
            for i, b in enumerate(held):
                if b.in_dram:
                    continue
                # the daemon's pool counts claimed slots as pinned only from the lease's grant
                if dram_room(idx, 1, free(dram) or 0, promoted) < 1:
                    for rest in held[i:]:
                        unpin(tenant, rest.key)
                    del held[i:]
                    break
                promote(tenant, b.key, dram)
                promoted += 1
            promotions += promoted
        # Allocate + Commit
        missing = len(keys) - start
        if missing:
            admitted = admit(tenant, keys, start,
                             partial_last=req.input_length < len(keys) * TRACE_BLOCK_TOKENS)
            bypassed += missing - admitted
            stored = 0
            if admitted:
                room = free(dram) or 0
                fit = min(admitted, room + idx.blocks(dram) - len(held))
                stored = min(fit, dram_room(idx, fit, room, len(held)))
            if stored:
                parent = keys[start - 1] if start else None
                new: list[Block] = []
                for k in keys[start : start + stored]:
                    new.append(insert(tenant, k, parent))
                    parent = k
                if write is not None:
                    write(new)
            not_stored += missing - stored
            inserted += stored
        # Release
        for b in held:
            unpin(tenant, b.key)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if progress is not None and len(requests) % _PROGRESS_EVERY:
        progress(len(requests) % _PROGRESS_EVERY)
    st = idx.stats()
    ev = st.evictions
    return ReplayStats(
        requests=len(requests),
        block_refs=refs,
        hits_dram=hits_dram,
        hits_ssd=hits_ssd,
        promotions=promotions,
        demotions=ev["dram_written_back"] + ev["dram_demoted"],
        ssd_blocks_written=st.ssd_writes,
        dropped_dram=ev["dram_dropped"],
        evicted_ssd=ev["ssd_dropped"] + ev["ssd_copy_dropped"],
        inserted=inserted,
        not_stored=not_stored,
        stranded_blocks=count_stranded(idx),
        dram_blocks_end=idx.blocks(dram),
        ssd_blocks_end=idx.blocks(ssd),
        seconds=seconds,
        cpu_seconds=cpu,
        history_size=st.history_size,
        history_recalled=st.history_recalled,
        bypassed=bypassed,
        ssd_writes_refused=writer.refused,
    )


def count_stranded(idx: PrefixIndex) -> int:
    """Cached blocks whose parent is not cached in any tier (DESIGN invariant 2 says none).

    Walks every entry (`iter_blocks`): each must be stored in DRAM or on SSD, and its parent must
    be the entry the index returns for the parent key, itself stored somewhere.
    """
    get = idx.get

    def stored(b: Block) -> bool:
        return b.in_dram or b.on_ssd

    def parent_ok(b: Block) -> bool:
        p = b.parent
        return p is None or (get(b.tenant, p.key) is p and stored(p))

    return sum(1 for b in idx.iter_blocks() if not (stored(b) and parent_ok(b)))
