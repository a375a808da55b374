"""kvtier's own policy: adaptive recency/frequency eviction, ghosts, and a learned reuse predictor.

Eviction (`AdaptiveQueue`, over the evictable blocks only — the index's leaf-first rule decides
membership): a *probation* list S (LRU order) where new blocks enter and a *main* list M
(`PROTECTED`, a CLOCK on a 2-bit hit counter). While S holds more than its share of the queue,
its oldest block leaves — or moves to M if it was hit twice since it was stored; else M's oldest
block with a count goes round again one lower and the first without one leaves. A ghost hit (the
admission history remembers the key of a block that left: it came back within about a cache's
worth of drops) enters M directly. With share 0.1 that is S3-FIFO-like (frequency first, scans
stay in S); with share 1.0 the queue is plain LRU (a hit moves a block to the hot end of its
list, M's too, and the older of the two cold ends leaves). The policy has four modes, its
*candidates*: share 0.1 with the predictor below placing blocks; plain LRU (every missed block
stored at the hot end, no predictor: the `lru` policy's order and admission); `FILTER`, LRU
behind the reuse filter (vLLM's store-after-two-lookups, the `vllm-reuse` peer: a missed block is
stored only if its key was seen before, in a `SeenTable` of the last ~`SEEN_MIN` or 2 x capacity
missed keys, and a chain's blocks only up to the first key not seen); and `LFU` (the `sglang-lfu`
order: the lowest access count leaves, the least recently used among equal counts; every missed
block stored; the counts are the index's, which the admission history resumes for a block that
comes back). Into LFU the queue moves its blocks to per-count lists (`LfuQueue`) in recency
order, out of it back to S and M, lowest count at the cold end — O(blocks) a switch, at most a few
an epoch; nothing is dropped (issue 29, seventh pass: the mode wins docqa at 1-5% and chat at 1%,
where the peer LFU was 3-5% ahead). Which one the workload
wants is measured online: `kvtier.index.policy_minisim` runs all four on a sample of the keys at
a fraction of the capacity and the queue follows the one with more hits, LRU unless another wins
by 5% — so the policy is bounded below by the better of its candidates LRU and the reuse filter,
up to the mini simulations' error (issue 29: the share-0.1 mode with the predictor alone fell
3-7% under LRU at 10-20% on shapes it was not tuned on, and under the reuse filter at 1-5%).
The share-0.1 copy sees what the predictor decided for its sampled missed keys (cold end, not
stored: `admit` hands them over) and its score is calibrated by the real cache's hits of the
sampled keys while the queue runs that mode (`MiniSims.factor`; issue 29, second pass: without
them the copy ranked the mode 30-40% under the real cache on long reuse distances, and the queue
left it for the filter or LRU there at 0.67-0.75x the best peer). The LFU copy is calibrated the
same way, and must win by 10% and 3 deviations; no switch is made on fewer than 50 hits (a few
requests' chains), and a clear win (4 deviations) switches at a quarter of an epoch.

`FrequencySketch`: one saturating byte per slot (4 slots per block of the larger tier, at least 64
KiB), indexed by the XXH3 fingerprint of (tenant, key); every key `admit` is asked about (the
missed suffix of a request, when it is about to be stored) adds 1 (up to 15) and every slot is
halved after 10 x slots increments, so it tells whether a key was referenced before over a window
~10x longer than the cache, without keeping any key. A collision only inflates a count: it can
change a decision, never the index's invariants.

Admission (`ReusePredictor`): every missed block gets a feature bucket from what a daemon sees
when it is stored —

    depth in the chain (log2, 8 classes) x tail (partial last / full last / inner block)
    x prefix hit of the request (none / parent hit for the first time / parent reused before)
    x blocks since the hit boundary (0, 1, 2-3, 4+) x key seen before (the seen table; the sketch
    in front of a larger SSD) = 576 buckets

(prompt length as a further x3 — under 16 / 64 / more blocks — was measured and dropped: no gain
on any workload, -5% on the sample trace at 5%), and per tenant (the daemon's tenant is the
namespace: tenant + model) a table of (reused, stored)
counts per bucket, with a prior from the tenant's overall rate and halving when a bucket's count
reaches 256 (so it follows drift). In the share-0.1 mode (and in front of a larger SSD) a block
with estimate p < `lo` enters S's cold end (evicted first); a partial last block with p < `bypass`
is not stored at all. In the LRU modes the predictor only learns (measured, issue 29: its cold
placement under LRU order cost up to 7% of LRU's hits at 20%). One block in `SAMPLE`
(while fewer than `TRACKED_MAX` are tracked) is a control: stored whatever p says and tracked
until it leaves the cache; whether it was hit meanwhile is the label its bucket learns, so
learning never starves a bucket and the labels do not depend on the predictions.

In front of a larger SSD tier (two-tier: most DRAM victims are demoted, not lost) DRAM is a
recency buffer: its queue stays in LRU mode and nothing is bypassed; the SSD tier's k-th-access
admission is the filter (measured on the bench's DRAM 2% + SSD 8% runs and at DRAM 9% + SSD 37%:
the adaptive DRAM queue and the tail bypass there cost up to 3% of LRU's hits).

SSD admission (wear): a DRAM victim goes to SSD on its k-th access (`KthAccess`, counts kept
across drops by the admission history), and the SSD tier evicts in recency order (the queue in
LRU mode). Measured alternatives, on the bench's DRAM 2% + SSD 8% runs: admitting keys the
sketch had seen k times wrote 1.3-3.1x the blocks for 0.96-1.01x the hits, and S3-FIFO order
on SSD lost up to 8% of the hits; so the rule stays the k-th access.

Cost: O(1) per block, and almost nothing on the Lookup path. A lookup's hit blocks are scanned
once for the `SAMPLED` bit (set at insert) and only the sampled ones (1 in 8 or fewer; all of
them in a cache under 512 blocks) are kept for the mini simulations, which run them at the next
`admit` (or once `DEFER_MAX` are kept); a miss costs nothing. Everything else happens in `admit`
(the daemon's Allocate): one fingerprint per missed key gives its sketch slot, its seen-table
word and whether it is in the mini simulations' sample; then a bucket index and one dict
operation per stored block (a control block or a pending placement). The sketch's halving is
O(slots) every 10 x slots references. Memory: the seen table (4 B a word, one word per block of
DRAM, at least 1 MB) or, in front of a larger SSD, 4 B of sketch per block of the larger tier
(>= 64 KiB) instead; the admission history (4 B a word, one word per block of DRAM + SSD: the
ghosts), at most `TRACKED_MAX` control blocks x ~50 B, the pending placements of the requests in
flight, 576 x 8 B per tenant, and the mini simulations (~110 B per block of DRAM up to 32K
blocks, at most ~3.7 MB, plus their seen table at 1/rate of the policy's) — `nbytes` counts the
predictor's part; bench.index and bench.policies measure them.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from xxhash import xxh3_64_intdigest

from kvtier.core.types import BlockKey
from kvtier.index.policies import (
    COUNT_BITS,
    COUNT_SHIFT,
    MARK,
    PROTECTED,
    BlockList,
    EvictionQueue,
    Policy,
)
from kvtier.index.policy_minisim import COLD, FILTER, LFU, SKIP, MiniSims, SeenTable
from kvtier.index.policy_peers import LfuQueue
from kvtier.index.types import HITS_BITS, HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block, Tenant

BUCKETS = 8 * 3 * 3 * 4 * 2
SAMPLE = 4
SKETCH_SLOTS = 4
"""Sketch bytes per block of the larger tier..."""
SKETCH_MIN = 1 << 16
"""...and at least this many (64 KiB: a small cache still remembers a long window of keys)."""
_PENDING_MAX = 1 << 14
TRACKED_MAX = 1 << 14
"""Control blocks tracked at once (~0.8 MB): plenty of labels, bounded at any capacity."""
_HALVE_AT = 256
_PRIOR = 4.0
_TRACKER = 48
"""Approximate bytes of one tracked control block or pending placement (a dict slot)."""
_MINI_ENTRY = 100
"""Approximate bytes of one mini-simulation entry (an OrderedDict slot and its key)."""
_MASK64 = (1 << 64) - 1
_COUNT_MAX = 15
_HALVE = bytes(i >> 1 for i in range(256))
HOT_HITS = 8
"""Accesses (index count, the commit included) from which a block enters a queue at the top
frequency; measured: 8 gains on docqa/chat at 1-2% (+6%/+2%) without the losses of 2-4 on the
sample trace at 10% (-5%/-2%)."""
SAMPLED = MARK
"""`Block.flags` bit (the policy's `MARK`): the key is in the mini simulations' sample."""
_P_COLD, _P_CONTROL, _P_SAMPLED = 1, 2, 4
"""Bits of a pending placement; the feature bucket is above them (``code >> 3``)."""
SHARES = (0.1, 1.0, FILTER, LFU)
"""Candidate modes, ranked by `MiniSims`: probation share 0.1 (S3-FIFO-like, with the predictor's
cold placement and tail bypass), 1.0 (plain LRU: every missed block stored at the hot end) and
`FILTER` (LRU behind the reuse filter: a missed block is stored only if its key was seen before)."""
SEEN_MIN = 1 << 18
"""Keys the reuse filter's `SeenTable` remembers at least (vLLM's filter tracks 64,000)..."""
DEFER_MAX = 1 << 13
"""Sampled lookup hits held for the next `admit` at most; past this the lookup feeds them."""
SEEN_PER_BLOCK = 1
"""...and this many per block of DRAM (4 bytes a block, the sketch's share, which only a DRAM in
front of a larger SSD allocates: index memory at 1M blocks stays under 300 B/block)."""


def _seed(tenant: Tenant) -> int:
    return (tenant if isinstance(tenant, int) else xxh3_64_intdigest(tenant.encode())) & _MASK64


def fingerprints(tenant: Tenant, keys: Sequence[BlockKey]) -> list[int]:
    """XXH3-64 of each key seeded by the tenant: the sketch slot (``h % size``) and the mini
    simulations' sample (``h >> 56``) both come from it, so a key is hashed once."""
    seed = _seed(tenant)
    return [xxh3_64_intdigest(k, seed) for k in keys]


class FrequencySketch:
    """Saturating per-slot reference counts with periodic halving (module docstring)."""

    __slots__ = ("_adds", "_counts", "_period", "size")

    def __init__(self, size: int) -> None:
        self.size = max(64, size)
        self._counts = bytearray(self.size)
        self._period = 10 * self.size
        self._adds = 0

    def add(self, tenant: Tenant, keys: Sequence[BlockKey]) -> list[int]:
        """Count one reference of each key; returns each key's count, this one included."""
        return self.add_hashed(fingerprints(tenant, keys))

    def add_hashed(self, fps: Sequence[int]) -> list[int]:
        """`add` for keys already fingerprinted (`fingerprints`)."""
        counts, size = self._counts, self.size
        out = []
        for h in fps:
            i = h % size
            c = counts[i]
            if c < _COUNT_MAX:
                counts[i] = c = c + 1
            out.append(c)
        self._adds += len(fps)
        if self._adds >= self._period:
            self._adds = 0
            self._counts = bytearray(counts.translate(_HALVE))
        return out

    def count(self, tenant: Tenant, key: BlockKey) -> int:
        return self._counts[xxh3_64_intdigest(key, _seed(tenant)) % self.size]

    def nbytes(self) -> int:
        return self.size


class ReusePredictor:
    """Per-tenant (reused, stored) counts per bucket; see the module docstring."""

    __slots__ = ("_tables",)

    def __init__(self) -> None:
        self._tables: dict[Tenant, tuple[array[int], array[int], list[int]]] = {}

    def table(self, tenant: Tenant) -> tuple[array[int], array[int], list[int]]:
        """(reused, stored, [reused, stored] overall) of a tenant, created on first use."""
        t = self._tables.get(tenant)
        if t is None:
            t = self._tables[tenant] = (array("I", bytes(4 * BUCKETS)),
                                        array("I", bytes(4 * BUCKETS)), [1, 2])
        return t

    def learn(self, tenant: Tenant, b: int, was_reused: bool) -> None:
        reused, stored, total = self.table(tenant)
        stored[b] += 1
        total[1] += 1
        if was_reused:
            reused[b] += 1
            total[0] += 1
        if stored[b] >= _HALVE_AT:
            stored[b] >>= 1
            reused[b] >>= 1
        if total[1] >= _HALVE_AT * 16:
            total[0] = (total[0] >> 1) + 1
            total[1] = (total[1] >> 1) + 2

    def nbytes(self) -> int:
        return len(self._tables) * (8 * BUCKETS + 64)


class AdaptiveQueue(EvictionQueue):
    """Probation S (LRU order) and main M (`PROTECTED`, a CLOCK on the 2-bit frequency at
    `COUNT_SHIFT`), S's share of the evictable blocks set by the policy (`share`; >= 1: S alone,
    plain LRU). S's oldest moves to M when hit more than once (its frequency > 1), M's oldest
    with a frequency goes round again one lower. A block entering with `HOT_HITS` accesses or
    more starts at the top frequency: an inner block of a chain is in no queue, so its hits
    reached no counter (the index counts them in `Block.stamp`). The block named by `cold_next`
    (set by the policy just before the index queues a new block) enters S's cold end."""

    __slots__ = ("_f", "_m", "_s", "cold_next", "lru_main", "share")
    name = "adaptive"

    def __init__(self, share: float, lru_main: bool = False) -> None:
        self._s = BlockList()
        self._m = BlockList()
        self._f: LfuQueue | None = None
        """In `LFU` mode the blocks are in this queue instead of S and M (`set_share`)."""
        self.share = share
        self.lru_main = lru_main
        """In LRU order a hit moves a main block to main's hot end too, so the older of the two
        cold ends is the least recently used block (the DRAM queue of a policy whose modes
        include plain LRU; the SSD queue and a DRAM recency buffer keep main in CLOCK order, as
        measured before issue 29)."""
        self.cold_next: Block | None = None

    def set_share(self, share: float) -> None:
        """Change the mode. Into `LFU`: every block moves to the frequency lists, least recently
        used first (so recency orders equal counts); out of it: every block goes back to S or M
        (by its `PROTECTED` flag), the lowest count at the cold end. O(blocks) per change of
        mode, at most once an epoch of the mini simulations; nothing is dropped."""
        if (share == LFU) != (self._f is not None):
            s, m = self._s, self._m
            if self._f is None:
                f = self._f = LfuQueue()
                for b in sorted([*s, *m], key=lambda b: b.stamp >> HITS_BITS):
                    f.push(b)
                self._s, self._m = BlockList(), BlockList()
            else:
                blocks, self._f = list(self._f), None
                for b in blocks:
                    (m if b.flags & PROTECTED else s).append(b)
        self.share = share

    def push(self, b: Block, cold: bool = False) -> None:
        if b.stamp & HITS_MAX >= HOT_HITS:  # hit while out of the queue (an inner block)
            b.flags |= COUNT_BITS
        if self._f is not None:
            self._f.push(b, cold)
            return
        if b.flags & PROTECTED:
            lst = self._m
        else:
            lst = self._s
            if b is self.cold_next:
                cold = True
                self.cold_next = None
        if cold:
            lst.appendleft(b)
        else:
            lst.append(b)

    def discard(self, b: Block) -> None:
        if self._f is not None:
            self._f.discard(b)
        else:
            (self._m if b.flags & PROTECTED else self._s).unlink(b)

    def touch(self, b: Block) -> None:
        if self._f is not None:
            self._f.touch(b)
            return
        f = b.flags
        if f & COUNT_BITS != COUNT_BITS:
            b.flags = f = f + (1 << COUNT_SHIFT)
        if not f & PROTECTED:
            self._s.move_to_end(b)
        elif self.lru_main and self.share >= 1.0:  # LRU order: main by recency too
            self._m.move_to_end(b)

    def first(self) -> Block | None:
        if self._f is not None:
            return self._f.first()
        s, m = self._s, self._m
        lru = self.share >= 1.0
        if lru:  # the older of the two cold ends: recency only
            a, b = s.head, m.head
            if a is None or b is None:
                return a or b
            return a if a.stamp >> HITS_BITS <= b.stamp >> HITS_BITS else b
        while True:
            head = s.head
            if head is not None and (m.head is None or s.size > self.share * (s.size + m.size)):
                if (head.flags & COUNT_BITS) >> COUNT_SHIFT > 1:
                    s.unlink(head)
                    head.flags |= PROTECTED
                    m.append(head)
                    continue
                return head
            head = m.head
            if head is None:
                return None
            if head.flags & COUNT_BITS:
                m.unlink(head)
                head.flags -= 1 << COUNT_SHIFT
                m.append(head)
                continue
            return head

    def __iter__(self) -> Iterator[Block]:
        if self._f is not None:
            yield from self._f
        yield from self._s
        yield from self._m

    def __len__(self) -> int:
        return self._s.size + self._m.size + (len(self._f) if self._f is not None else 0)


class AdaptivePolicy(Policy):
    """kvtier's policy (module docstring). Thresholds on the predicted reuse probability:
    `lo` -> cold end of probation, `bypass` -> a partial last block is not stored."""

    name = "kvtier"
    hooks = True
    ghosts = True
    lo = 0.1
    bypass = 0.03
    sample_shift = 56
    """The mini simulations' key sample is ``(fingerprint >> sample_shift) & 255 < threshold``:
    the top byte by default; another byte draws another sample of the same size (bench.policy_sweep
    ``--trace-samples`` measures how much of a cell's figure is the luck of the sample)."""

    def __init__(self, dram_blocks: int | None, ssd_blocks: int | None, admission_k: int) -> None:
        cap = max(dram_blocks or 0, ssd_blocks or 0)
        self._front = (ssd_blocks or 0) > (dram_blocks or 0)
        # "seen before": the sketch in front of a larger SSD, else the seen table (one of them
        # is allocated: the other stays at its minimum, 64 B / 4 B)
        self.sketch = FrequencySketch(max(SKETCH_SLOTS * cap, SKETCH_MIN) if self._front else 64)
        self._seen_size = 1 if self._front else max(SEEN_MIN, SEEN_PER_BLOCK * (dram_blocks or 0))
        self.seen = SeenTable(self._seen_size)
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        self.ssd = AdaptiveQueue(1.0)  # SSD: recency order (measured: S3-FIFO order lost hits)
        if self._front:  # DRAM in front of a larger SSD: a recency buffer (measured)
            q = self.dram
            assert isinstance(q, AdaptiveQueue)
            q.share = 1.0
            q.lru_main = False
            self.bypass = -1.0
        self.predictor = ReusePredictor()
        self._pending: dict[tuple[Tenant, BlockKey], int] = {}
        self._tracked: dict[Block, int] = {}
        self._deferred: list[BlockKey] = []
        self._n = 0
        self.minisims = MiniSims(max(1, dram_blocks or 1 << 16), SHARES, SHARES[0],
                                 seen=self._seen_size)

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        return AdaptiveQueue(SHARES[0], lru_main=True)

    def resize(self, dram_blocks: int) -> None:
        """New mini caches at a fraction of the new capacity (their sample starts again; the
        share in use stays until they pick one)."""
        self.minisims = MiniSims(max(1, dram_blocks), SHARES, self.minisims.best,
                                 seen=self._seen_size)
        self._deferred = []

    def looked_up(self, tenant: Tenant, keys: Sequence[BlockKey], blocks: list[Block]) -> None:
        if not blocks or self._front:
            return
        sampled = [b.key for b in blocks if b.flags & SAMPLED]
        if sampled:  # fed to the mini simulations at the next `admit`, off the Lookup path
            deferred = self._deferred
            deferred.extend(sampled)
            if len(deferred) > DEFER_MAX:
                self._deferred = []
                self._feed(deferred, None, len(deferred))

    def _feed(self, sampled: list[BlockKey], placed: dict[BlockKey, int] | None,
              real_hits: int) -> None:
        ms = self.minisims
        ms.feed(sampled, placed, real_hits)
        q = self.dram
        assert isinstance(q, AdaptiveQueue)
        q.set_share(ms.best)

    def admit(self, tenant: Tenant, keys: Sequence[BlockKey], start: int, parent: Block | None,
              partial_last: bool) -> int:
        pending = self._pending
        if len(pending) > _PENDING_MAX:
            pending.clear()
        missed = keys[start:]
        fps = fingerprints(tenant, missed)
        th, sh = self.minisims.threshold, self.sample_shift
        end = len(keys)
        lo, bypass = s3_lo, s3_bypass = self.lo, self.bypass
        control = SAMPLE
        placed: dict[BlockKey, int] = {}
        sampled: list[BlockKey] = []
        real_hits = 0
        if self._front:
            seen = self.sketch.add_hashed(fps)
            s3_lo = -1.0
        else:
            sampled = [k for k, h in zip(missed, fps, strict=True) if h >> sh & 255 < th]
            if self._deferred:
                real_hits = len(self._deferred)
                sampled = self._deferred + sampled
                self._deferred = []
            check = self.seen.check
            seen = [2 if check(h) else 0 for h in fps]  # the predictor's "seen before" too
            unseen = [j for j, x in enumerate(seen) if not x]
            q = self.dram
            assert isinstance(q, AdaptiveQueue)
            share = q.share
            if share >= 1.0:  # LRU, the reuse filter or LFU: no predictor placement
                lo = bypass = -1.0
                if share == FILTER:  # the reuse filter: up to the first key not seen before
                    control = 0
                    if unseen:
                        end = start + unseen[0]
        last = len(keys) - 1
        hit = 0 if parent is None else 1 if parent.stamp & HITS_MAX <= 2 else 2
        reused, stored, total = self.predictor.table(tenant)
        prior = _PRIOR * total[0] / total[1]
        n = start
        # per block, its feature bucket b: depth (bit length of its position) x `tail` (0 inner,
        # 1 full last, 2 partial last) x `hit` (0 no prefix hit, 1 the parent hit for the first
        # time, 2 the parent reused before) x `since` (blocks since the hit boundary: 0, 1, 2-3,
        # 4+) x seen by the sketch before; and its reuse estimate p = (reused + prior) /
        # (stored + _PRIOR), the prior being the tenant's overall rate. Inline: per stored block.
        for i in range(start, end):
            tail = 0 if i < last else 2 if partial_last else 1
            since = i - start
            b = (((min(i.bit_length(), 7) * 3 + tail) * 3 + hit) * 4
                 + (since if since < 2 else 2 if since < 4 else 3)) * 2 + (seen[since] >= 2)
            code = b << 3 | (_P_SAMPLED if fps[since] >> sh & 255 < th else 0)
            self._n = r = (self._n * 1103515245 + 12345) & 0x7FFFFFFF
            if control and (r >> 16) % control == 0 and len(self._tracked) < TRACKED_MAX:
                code |= _P_CONTROL
            else:
                p = (reused[b] + prior) / (stored[b] + _PRIOR)
                if p < s3_lo and code & _P_SAMPLED:  # what the probation mode would do
                    placed[keys[i]] = SKIP if tail == 2 and p < s3_bypass else COLD
                if tail == 2 and p < bypass:
                    break
                if p < lo:
                    code |= _P_COLD
            pending[(tenant, keys[i])] = code
            n += 1
        if sampled:  # the mini simulations see the missed sampled keys after the decisions
            self._feed(sampled, placed, real_hits)
        return n - start

    def inserted(self, b: Block) -> None:
        code = self._pending.pop((b.tenant, b.key), -1)
        if b.stamp & HITS_MAX > 1:  # the history remembered it: a ghost hit
            b.flags |= PROTECTED
        if code < 0:  # stored without asking `admit` (its parent was not cached yet)
            h = xxh3_64_intdigest(b.key, _seed(b.tenant))
            if h >> self.sample_shift & 255 < self.minisims.threshold:
                b.flags |= SAMPLED
            return
        if code & _P_SAMPLED:
            b.flags |= SAMPLED
        if code & _P_CONTROL:
            self._tracked[b] = code >> 3
        elif code & _P_COLD:
            q = self.dram
            assert isinstance(q, AdaptiveQueue)
            q.cold_next = b

    def unlinked(self, b: Block) -> None:
        if self._tracked:
            bk = self._tracked.pop(b, None)
            if bk is not None:
                self.predictor.learn(b.tenant, bk, b.stamp & HITS_MAX >= 2)

    def forget(self, blocks: list[Block]) -> None:
        if self._tracked:
            for b in blocks:
                self._tracked.pop(b, None)

    def nbytes(self) -> int:
        """Bytes of the policy's state besides the index's history: sketch, predictor tables,
        tracker, pending placements, mini simulations (dict slots at estimated sizes)."""
        return (self.sketch.nbytes() + self.predictor.nbytes() + self.seen.nbytes()
                + self.minisims.nbytes_fixed()
                + _TRACKER * (len(self._tracked) + len(self._pending)) + 8 * len(self._deferred)
                + _MINI_ENTRY * self.minisims.entries())
