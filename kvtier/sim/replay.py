"""Replay a trace through the real `kvtier.index.prefix.PrefixIndex`, tier by tier.

Per request, in arrival order (one tenant; trace id i is the 8-byte big-endian key of block i):

  1. lookup: `index.lookup` returns the longest cached prefix and each block's best tier; those
     blocks are the request's hits (by tier), and the lookup counts an access on each.
  2. lease: the hit blocks are pinned until the request ends, so nothing the request uses is
     evicted under it. (A simplification of the daemon, which holds the Acquire lease while the
     engine loads and then its Allocate slots until Commit.)
  3. admission: `index.admit` says how many of the missed blocks the policy stores (all, for
     LRU; a prefix of them for policies with DRAM admission, e.g. without a partial last block);
     the rest count as not stored.
  4. room: one `index.evict_count(DRAM, n, write_back=True)` makes room for the SSD hits and the
     missed blocks; the index demotes admitted victims (k-th access, counting accesses before an
     earlier drop while its admission history remembers them) to SSD, evicting SSD leaves for
     them, and drops the rest, leaf-first. All eviction for the request happens here, so the
     blocks committed next cannot be evicted before the request ends either.
  5. promote: SSD-only hits are copied into DRAM (`index.promote`; the SSD copy stays).
  6. commit: the admitted missed blocks are inserted into DRAM in chain order (`index.insert`).
     When DRAM has too few evictable blocks (the request is longer than DRAM), only the first
     missed blocks are stored: the rest is a suffix, so nothing is stranded.
  7. release: the pins are dropped.

Movement counters come from the index's own eviction counters; `stranded_blocks` is recounted on
the index after the replay, never assumed.

Model limits: requests are served one at a time in trace order (timestamps only order them; no
overlap between requests, no lease expiry, no HBM tier), and every missed block is committed at
once, as if its prefill had finished before the next request arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.core.types import Tier
from kvtier.index.prefix import Block, PrefixIndex
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


def replay(
    requests: Sequence[Request],
    config: TierConfig,
    progress: Callable[[int], None] | None = None,
    index: PrefixIndex | None = None,
) -> ReplayStats:
    """Replay `requests` (see the module docstring). `index`, if given, must be empty and is left
    in its final state for inspection; `progress(n)` is called every few hundred requests."""
    idx = new_index(config) if index is None else index
    if len(idx):
        raise ValueError("replay needs an empty index")
    dram, ssd = Tier.DRAM, Tier.SSD
    lookup, insert, promote, admit = idx.lookup, idx.insert, idx.promote, idx.admit
    pin, unpin, evict, free = idx.pin, idx.unpin, idx.evict_count, idx.free
    hits_dram = hits_ssd = promotions = inserted = not_stored = bypassed = refs = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for n, req in enumerate(requests, start=1):
        keys = [i.to_bytes(8, "big") for i in req.hash_ids]
        refs += len(keys)
        prefix = lookup(TENANT, keys)
        tiers = prefix.tiers
        h = len(tiers)
        on_ssd = tiers.count(ssd)
        hits_ssd += on_ssd
        hits_dram += h - on_ssd
        pinned = keys[:h]
        for k in pinned:
            pin(TENANT, k)
        missing = len(keys) - h
        admitted = admit(TENANT, keys, h,
                         partial_last=req.input_length < len(keys) * TRACE_BLOCK_TOKENS)
        bypassed += missing - admitted
        want = on_ssd + admitted
        room = free(dram)
        assert room is not None
        if want > room:
            evict(dram, want - room, write_back=True)
            room = free(dram) or 0
        if on_ssd:
            for b, t in zip(prefix.blocks, tiers, strict=True):
                if t is ssd and room:
                    promote(TENANT, b.key, dram)
                    promotions += 1
                    room -= 1
        stored = min(admitted, room)
        not_stored += missing - stored
        inserted += stored
        parent = keys[h - 1] if h else None
        for k in keys[h : h + stored]:
            insert(TENANT, k, parent)
            parent = k
        for k in pinned:
            unpin(TENANT, k)
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
