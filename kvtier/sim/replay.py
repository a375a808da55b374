"""Replay a trace through the real `kvtier.index.prefix.PrefixIndex` and the daemon's placement
planner (`kvtier.index.placement`), step by step as the daemon serves a request.

Per request, in arrival order (one namespace; trace id i is the 8-byte big-endian key of block i):

  1. Lookup: `index.lookup` returns the longest cached prefix and each block's best tier; those
     blocks are the request's hits (by tier), and the lookup counts an access on each. Then the
     write-backs the planner calls for (`placement.write_backs`: DRAM-only blocks that reached
     the k-th access, under a parent on SSD), each after SSD room (`placement.ssd_room`) and
     the SSD write budget; a write-back the budget refuses ends the chain's write-backs
     (counted in `ssd_writes_refused`).
  2. Acquire: the prefix is pinned until the request ends; each block the planner promotes
     (`placement.promotions`: the SSD-only ones) is promoted into DRAM (`index.promote`; the
     SSD copy stays) after `placement.dram_room` made a slot; the prefix ends before a block
     that gets none.
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

With a shared remote tier (a fleet, `kvtier.sim.fleet`; `Node`'s docstring): Acquire asks it
for the blocks after the local prefix and fetches those it holds into DRAM after a whole local
prefix (`placement.remote_fetches`: a slot each, claimed for those only), and Commit writes the
committed blocks to it (`placement.remote_offers` with the daemon's k = 1).

`Node` holds one node's state and serves one request (`Node.serve`); `replay` is one node
serving the whole trace. This is the daemon's order and its rules
(tests/test_sim_equals_daemon.py replays one trace through both and compares hits and SSD
writes exactly). The write budget is the daemon's token
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
from typing import NamedTuple, Protocol

from kvtier.core.types import Tier
from kvtier.core.wear import TokenBucket, WriteBudget
from kvtier.index import placement
from kvtier.index.prefix import Block, Ns, PrefixIndex
from kvtier.sim.config import ReplayStats, TierConfig
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request

NS = 0
_PROGRESS_EVERY = 256


class RemoteLike(Protocol):
    """The shared remote tier as a `Node` uses it (`kvtier.sim.fleet.RemoteStore`)."""

    def present(self, keys: Sequence[bytes], start: int) -> int:
        """How many of `keys[start:]`, from the first, it holds (an existence check)."""

    def fetch(self, key: bytes) -> None:
        """One block read from it (an access)."""

    def store(self, key: bytes) -> None:
        """One block written to it."""


def key_of(block_id: int) -> bytes:
    """The index key standing for trace block id `block_id`."""
    return block_id.to_bytes(8, "big")


def new_index(config: TierConfig, journal: bool = False) -> PrefixIndex[Ns]:
    """An empty index at `config`'s capacities; `journal`: keep its residency changes (the
    events a fleet's router learns node contents from, `kvtier.sim.fleet`)."""
    return PrefixIndex(
        dram_blocks=config.dram_blocks,
        ssd_blocks=config.ssd_blocks,
        policy=config.policy,
        admission_k=config.ssd_admit_k,
        admission_history=config.admission_history,
        journal=journal,
    )


class _Writer:
    """Applies the planner's write-back intents at once, under the SSD write budget."""

    def __init__(self, idx: PrefixIndex[Ns], config: TierConfig, now: list[float],
                 ns: Ns) -> None:
        self.idx = idx
        self.ns = ns
        self.cost = config.ssd_block_bytes
        self.budget = None if config.ssd_write_bytes_per_day is None else WriteBudget(
            config.ssd_write_bytes_per_day, config.ssd_write_burst_bytes,
            clock=lambda: now[0] / 1000.0)
        self.refused = 0

    def write(self, blocks: list[Block[Ns]]) -> bool:
        """Writes back what the planner calls for, as the daemon does: each write-back is
        pinned while it waits (room is made for it and those before it), then all are
        recorded on SSD in order, each unpinned first (`queue`, then `done`). True if SSD
        victims were evicted for room (they may have been blocks of `blocks`' own chain)."""
        queued, evicted = self.queue(blocks)
        self.done(queued)
        return evicted

    def queue(self, blocks: list[Block[Ns]]) -> tuple[list[bytes], bool]:
        """`write`'s first half: the write-backs pinned as the daemon queues them, and whether
        SSD victims were evicted for room."""
        idx, ns, evicted = self.idx, self.ns, False
        queued: list[bytes] = []
        for w in placement.write_backs(idx, ns, blocks):
            need = 1 + len(queued)
            free = idx.free(Tier.SSD)
            evicted = evicted or (free is not None and free < need)
            if not placement.ssd_room(idx, need):
                break
            if self.budget is not None and not self.budget.try_spend(self.cost):
                self.refused += 1
                break
            idx.pin(ns, w.key)
            queued.append(w.key)
        return queued, evicted

    def done(self, queued: list[bytes]) -> None:
        """`write`'s second half: the queued write-backs are on SSD (the daemon's writer
        reports them in order, each unpinned first)."""
        idx, ns = self.idx, self.ns
        for key in queued:
            idx.unpin(ns, key)
            idx.add_tier(ns, key, Tier.SSD)


class Served(NamedTuple):
    """What one request got on a node: the tier each hit block came from (the local prefix, then
    `Tier.REMOTE` for each block fetched from the shared remote tier), and the missed blocks the
    node committed (the `Node.remote` writes, one per block, in chain order)."""

    tiers: list[Tier]
    committed: list[bytes]


class Node:
    """One node's tiers: the real index and the daemon's placement planner, serving requests one
    at a time (`serve`, the steps of the module docstring). `replay` is one node serving a whole
    trace; `kvtier.sim.fleet` routes a trace over several.

    `remote`: the shared remote tier (`kvtier.sim.fleet.RemoteStore`, or anything with its
    `present`/`fetch`/`store`), as the daemon uses it with `remote_admit_after` 1: Acquire asks
    it for the blocks after the local prefix (no access) and fetches those it holds into DRAM
    after a whole local prefix (`placement.remote_fetches`; each claims a DRAM slot as a
    promotion does; the prefix ends before a block that gets none) as new DRAM blocks pinned
    for the request, and Commit writes each committed block to it. Fetched blocks are not
    written back to SSD at fetch (the daemon's `settle_remote` does not either).
    `remote_budget`: the node's remote write-through rate (`remote_write_bytes_per_s`) and the
    bytes of one block write, a token bucket on the trace's clock (seconds) with a burst of one
    second's (at least one block); a write it refuses is dropped with the rest of that commit's
    blocks (which would sit behind a hole in the store's chain), as the daemon drops them
    (`remote_writes_dropped`)."""

    def __init__(self, config: TierConfig, index: PrefixIndex[Ns] | None = None, *,
                 ns: Ns = NS, key_bytes: int = 8, remote: RemoteLike | None = None,
                 remote_budget: tuple[float, int] | None = None) -> None:
        idx = new_index(config) if index is None else index
        if len(idx):
            raise ValueError("replay needs an empty index")
        self.index, self.config, self.ns, self.key_bytes = idx, config, ns, key_bytes
        self.remote = remote
        self._now = [0.0]
        self._remote_budget = None if remote_budget is None else (TokenBucket(
            remote_budget[0], max(remote_budget[0], remote_budget[1]),
            clock=lambda: self._now[0] / 1000.0), remote_budget[1])
        self.remote_writes_dropped = 0
        self._writer = _Writer(idx, config, self._now, ns)
        self._write = self._writer.write if config.ssd_blocks else None
        self.requests = self.refs = 0
        self.hits_dram = self.hits_ssd = self.hits_remote = 0
        self.promotions = self.inserted = self.not_stored = self.bypassed = 0
        self.seconds = self.cpu_seconds = 0.0

    def serve(self, req: Request) -> Served:
        """Lookup, Acquire, Allocate + Commit and Release of one request (module docstring)."""
        idx, ns, remote, write = self.index, self.ns, self.remote, self._write
        dram, ssd = Tier.DRAM, Tier.SSD
        pin, unpin, free, dram_room = idx.pin, idx.unpin, idx.free, placement.dram_room
        self._now[0] = req.timestamp
        width = self.key_bytes
        keys = [i.to_bytes(width, "big") for i in req.hash_ids]
        self.requests += 1
        self.refs += len(keys)
        # Lookup
        prefix = idx.lookup(ns, keys)
        tiers = prefix.tiers
        h = len(tiers)
        on_ssd = tiers.count(ssd)
        self.hits_ssd += on_ssd
        self.hits_dram += h - on_ssd
        held = prefix.blocks
        if write is not None and h and write(held):
            held = idx.lookup(ns, keys, touch=False).blocks  # as Acquire looks again
        start = len(held)
        # the daemon's Acquire asks the store after the local prefix it finds (`Cache`)
        there = remote.present(keys, start) if remote is not None and start < len(keys) else 0
        # Acquire: as the daemon's `begin`, a DRAM slot is claimed (room made for it past the
        # claims before) for each block promoted, the prefix ending before one that gets none,
        # then, after a whole local prefix, for each key the remote store holds; then, as its
        # `end`, the claims are filled in that order
        for b in held:
            pin(ns, b.key)
        claims = promoted = 0
        if on_ssd:
            pinned = sum(b.in_dram for b in held)
            for i in placement.promotions(held):
                if dram_room(idx, 1, (free(dram) or 0) - claims, pinned) < 1:
                    for rest in held[i:]:
                        unpin(ns, rest.key)
                    del held[i:]
                    break
                claims += 1
        fetch = placement.remote_fetches(len(held), start, there)
        if fetch and remote is not None:
            pinned = sum(b.in_dram for b in held)
            for _ in range(fetch):
                if dram_room(idx, 1, (free(dram) or 0) - claims, pinned) < 1:
                    break
                claims += 1
        for i in placement.promotions(held):
            idx.promote(ns, held[i].key, dram)
            promoted += 1
        self.promotions += promoted
        got: list[Tier] = list(tiers)
        fetched = claims - promoted
        if fetched and remote is not None:
            parent = keys[start - 1] if start else None
            for k in keys[start : start + fetched]:
                remote.fetch(k)
                held.append(idx.insert(ns, k, parent))
                pin(ns, k)
                parent = k
            self.hits_remote += fetched
            start += fetched
            got += [Tier.REMOTE] * fetched
        # Allocate + Commit
        missing = len(keys) - start
        committed: list[bytes] = []
        if missing:
            admitted = idx.admit(ns, keys, start,
                                 partial_last=req.input_length < len(keys) * TRACE_BLOCK_TOKENS)
            self.bypassed += missing - admitted
            stored = 0
            if admitted:
                room = free(dram) or 0
                fit = min(admitted, room + idx.blocks(dram) - len(held))
                stored = min(fit, dram_room(idx, fit, room, len(held)))
            if stored:
                parent = keys[start - 1] if start else None
                new: list[Block[Ns]] = []
                insert = idx.insert
                for k in keys[start : start + stored]:
                    new.append(insert(ns, k, parent))
                    parent = k
                committed = keys[start : start + stored]
                # the daemon's Commit queues the write-backs, then the remote writes (each
                # block pinned while queued); the SSD writer's report comes first here
                queued = self._writer.queue(new)[0] if write is not None else []
                sent: list[bytes] = []
                if remote is not None:
                    offers = placement.remote_offers(new, committed=True, k=1)
                    sent = self._write_remote(remote, [b.key for b in offers])
                self._writer.done(queued)
                for k in sent:
                    unpin(ns, k)
            self.not_stored += missing - stored
            self.inserted += stored
        # Release
        for b in held:
            unpin(ns, b.key)
        return Served(got, committed)

    def _write_remote(self, remote: RemoteLike, keys: list[bytes]) -> list[bytes]:
        """Writes `keys` to the remote store as the daemon queues them: each pinned while its
        write waits (the caller unpins the ones returned once written); a write the budget
        refuses is unpinned at once and drops the rest."""
        budget, idx, ns = self._remote_budget, self.index, self.ns
        sent: list[bytes] = []
        for i, k in enumerate(keys):
            idx.pin(ns, k)
            if budget is not None and not budget[0].take(budget[1]):
                idx.unpin(ns, k)
                self.remote_writes_dropped += len(keys) - i
                break
            remote.store(k)
            sent.append(k)
        return sent

    def stats(self) -> ReplayStats:
        """The counters so far (`stranded_blocks` recounted on the index now)."""
        idx = self.index
        st = idx.stats()
        ev = st.evictions
        return ReplayStats(
            requests=self.requests,
            block_refs=self.refs,
            hits_dram=self.hits_dram,
            hits_ssd=self.hits_ssd,
            promotions=self.promotions,
            demotions=ev["dram_written_back"] + ev["dram_demoted"],
            ssd_blocks_written=st.ssd_writes,
            dropped_dram=ev["dram_dropped"],
            evicted_ssd=ev["ssd_dropped"] + ev["ssd_copy_dropped"],
            inserted=self.inserted,
            not_stored=self.not_stored,
            stranded_blocks=count_stranded(idx),
            dram_blocks_end=idx.blocks(Tier.DRAM),
            ssd_blocks_end=idx.blocks(Tier.SSD),
            seconds=self.seconds,
            cpu_seconds=self.cpu_seconds,
            history_size=st.history_size,
            history_recalled=st.history_recalled,
            bypassed=self.bypassed,
            ssd_writes_refused=self._writer.refused,
            hits_remote=self.hits_remote,
        )


def replay(
    requests: Sequence[Request],
    config: TierConfig,
    progress: Callable[[int], None] | None = None,
    index: PrefixIndex[Ns] | None = None,
    *,
    ns: Ns = NS,
    key_bytes: int = 8,
) -> ReplayStats:
    """Replay `requests` (see the module docstring) on one `Node`. `index`, if given, must be
    empty and is left in its final state for inspection; `progress(n)` is called every few
    hundred requests. `ns` and `key_bytes` (trace id i is the big-endian key of that width)
    name the blocks in the index; a daemon's own names make its admission history and policy
    hashes the same (the equality test)."""
    node = Node(config, index, ns=ns, key_bytes=key_bytes)
    serve = node.serve
    t0, c0 = time.perf_counter(), time.process_time()
    for n, req in enumerate(requests, start=1):
        serve(req)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    node.seconds, node.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    if progress is not None and len(requests) % _PROGRESS_EVERY:
        progress(len(requests) % _PROGRESS_EVERY)
    return node.stats()


def count_stranded(idx: PrefixIndex[Ns]) -> int:
    """Cached blocks whose parent is not cached in any tier (DESIGN invariant 2 says none).

    Walks every entry (`iter_blocks`): each must be stored in DRAM or on SSD, and its parent must
    be the entry the index returns for the parent key, itself stored somewhere.
    """
    get = idx.get

    def stored(b: Block[Ns]) -> bool:
        return b.in_dram or b.on_ssd

    def parent_ok(b: Block[Ns]) -> bool:
        p = b.parent
        return p is None or (get(b.ns, p.key) is p and stored(p))

    return sum(1 for b in idx.iter_blocks() if not (stored(b) and parent_ok(b)))
