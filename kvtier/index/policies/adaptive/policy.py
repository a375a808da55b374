"""kvtier's own policy (`AdaptivePolicy`, ``kvtier``): LRU unless a better mode is resolved.

DRAM alone: the DRAM queue (`kvtier.index.policies.adaptive.queue.AdaptiveQueue`) runs in LRU
mode — the ``lru`` policy's one list, every missed block stored, no predictor: the same victims
in the same order as ``lru`` — until the miniature simulations on a sample of the keys
(`kvtier.index.policies.adaptive.minisim.MiniSims`) resolve that another mode hits more: the
probation (S3-FIFO-like) order with the reuse predictor, LRU behind the reuse filter, or LFU. It
goes back to LRU once that gain is no longer resolved. Per mode, `admit` stores: LRU and LFU,
every missed block; the filter, the chain up to its first key the `SeenTable` did not see before;
probation, every block, at the cold end of probation when the predictor's estimate p < `lo`, and
a partial last block not at all when p < `bypass`. Only in the probation mode is 1 block in
`SAMPLE` a control that trains the predictor (its label is reuse under that order). A block the
admission history remembers (reinserted with a count above 1, a ghost hit) is flagged for main.

In front of a larger SSD tier (most DRAM victims are demoted, not lost) DRAM is a recency buffer
(the queue's two-list recency order, no switch, no bypass; the predictor's cold placement and a
frequency sketch for "seen before") and the SSD tier's k-th-access admission is the filter; the
SSD tier evicts in recency order. Both were measured against the alternatives (docs/benchmarks.md).

Cost: O(1) per block, and almost nothing on the Lookup path. A lookup's hit blocks are scanned
once for the `SAMPLED` bit (set at insert) and only the sampled ones (1 in 8 or fewer; all of
them in a cache under 512 blocks) are kept for the mini simulations, which run them at the next
`admit`; past `DEFER_MAX` kept (lookups with no admit between them: full hits), each lookup runs
the oldest of them, as many as it kept, so a lookup's cost stays in proportion to its own chain
instead of one lookup in many paying for all the others; a miss costs nothing. Everything else
happens in `admit` (the daemon's Allocate): one fingerprint per missed key gives its seen-table
word (or sketch slot) and whether it is in the sample; then a bucket index and one dict operation
per stored block.
Memory: the seen table (4 B a word, one word per block of DRAM, at least 1 MB) or, in front of a
larger SSD, 4 B of sketch per block of the larger tier (>= 64 KiB); the admission history (4 B a
word per block of DRAM + SSD); at most `TRACKED_MAX` control blocks x ~50 B; the pending
placements of the requests in flight; 576 x 8 B per namespace; the mini simulations (~110 B per
block of DRAM up to 32K blocks, at most ~3.7 MB). `nbytes` counts them; bench.index and
bench.policies measure them.

Threading: none; the index's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xxhash import xxh3_64_intdigest

from kvtier.core.types import BlockKey
from kvtier.index.policies.adaptive.minisim import (
    COLD,
    FILTER,
    LFU,
    LRU,
    SKIP,
    MiniSims,
    SeenTable,
)
from kvtier.index.policies.adaptive.predictor import (
    SKETCH_MAX,
    SKETCH_MIN,
    SKETCH_SLOTS,
    FrequencySketch,
    ReusePredictor,
    _seed,
    fingerprints,
)
from kvtier.index.policies.adaptive.queue import AdaptiveQueue
from kvtier.index.policies.base import MARK, PROTECTED, EvictionQueue, Policy
from kvtier.index.types import HITS_MAX

if TYPE_CHECKING:
    from kvtier.index.types import Block, Ns

SAMPLE = 4
"""In the probation mode, 1 stored block in SAMPLE is a control (stored whatever the predictor
says, its reuse the label of its bucket)."""
_PENDING_MAX = 1 << 14
TRACKED_MAX = 1 << 14
"""Control blocks tracked at once (~0.8 MB): plenty of labels, bounded at any capacity."""
_PRIOR = 4.0
_TRACKER = 48
"""Approximate bytes of one tracked control block or pending placement (a dict slot)."""
_MINI_ENTRY = 100
"""Approximate bytes of one mini-simulation entry (an OrderedDict slot and its key)."""
SAMPLED = MARK
"""`Block.flags` bit (the policy's `MARK`): the key is in the mini simulations' sample."""
_P_COLD, _P_CONTROL, _P_SAMPLED = 1, 2, 4
"""Bits of a pending placement; the feature bucket is above them (``code >> 3``)."""
SHARES = (0.1, LRU, FILTER, LFU)
"""The modes `MiniSims` compares: probation share 0.1 (S3-FIFO-like, with the predictor's cold
placement and tail bypass), `LRU` (the mode unless another is resolved to hit more), `FILTER`
(LRU behind the reuse filter) and `LFU`."""
SEEN_MIN = 1 << 18
"""Keys the reuse filter's `SeenTable` remembers at least (vLLM's filter tracks 64,000)..."""
DEFER_MAX = 1 << 13
"""Sampled lookup hits held for the next `admit`; past this each lookup feeds the oldest ones."""
SEEN_PER_BLOCK = 1
"""...and this many per block of DRAM (4 bytes a block, the sketch's share, which only a DRAM in
front of a larger SSD allocates: index memory at 1M blocks stays under 300 B/block)."""


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
        self.sketch = FrequencySketch(
            min(SKETCH_MAX, max(SKETCH_SLOTS * cap, SKETCH_MIN)) if self._front else 64)
        self._seen_size = 1 if self._front else max(SEEN_MIN, SEEN_PER_BLOCK * (dram_blocks or 0))
        self.seen = SeenTable(self._seen_size)
        super().__init__(dram_blocks, ssd_blocks, admission_k)
        self.ssd = AdaptiveQueue(LRU)  # SSD: recency order (measured: S3-FIFO order lost hits)
        if self._front:  # DRAM in front of a larger SSD: a recency buffer (measured), no bypass
            self.bypass = -1.0
        self.predictor = ReusePredictor()
        self._pending: dict[tuple[Ns, BlockKey], int] = {}
        self._tracked: dict[Block[Any], int] = {}
        self._deferred: list[BlockKey] = []
        self._n = 0
        self.minisims = MiniSims(max(1, dram_blocks or 1 << 16), SHARES, LRU,
                                 seen=self._seen_size)

    def make_queue(self, capacity: int | None) -> EvictionQueue:
        """DRAM alone: LRU mode, the ``lru`` policy's one list, until the mini simulations
        resolve a better mode; in front of a larger SSD: the two-list recency buffer."""
        return AdaptiveQueue(LRU, lru_main=not self._front)

    def resize(self, dram_blocks: int) -> None:
        """New mini caches at a fraction of the new capacity (their sample starts again: the
        mode in use stays until the first epoch's end, LRU from then unless resolved again)."""
        self.minisims = MiniSims(max(1, dram_blocks), SHARES, self.minisims.best,
                                 seen=self._seen_size)
        self._deferred = []

    def looked_up(self, ns: Ns, keys: Sequence[BlockKey], blocks: list[Block[Any]]) -> None:
        if not blocks or self._front:
            return
        sampled = [b.key for b in blocks if b.flags & SAMPLED]
        if sampled:  # fed to the mini simulations at the next `admit`, off the Lookup path
            deferred = self._deferred
            deferred.extend(sampled)
            if len(deferred) > DEFER_MAX:
                n = len(deferred) - DEFER_MAX  # as many as it kept: one observation
                oldest = deferred[:n]
                del deferred[:n]
                self._feed(oldest, None, len(oldest))

    def _feed(self, sampled: list[BlockKey], placed: dict[BlockKey, int] | None,
              real_hits: int) -> None:
        ms = self.minisims
        ms.feed(sampled, placed, real_hits)
        q = self.dram
        assert isinstance(q, AdaptiveQueue)
        if ms.best != q.share:
            if q.share < LRU:  # the controls' labels would be the next mode's reuse
                self._tracked.clear()
            q.set_share(ms.best)

    def admit(self, ns: Ns, keys: Sequence[BlockKey], start: int, parent: Block[Any] | None,
              partial_last: bool) -> int:
        pending = self._pending
        if len(pending) > _PENDING_MAX:
            pending.clear()
        missed = keys[start:]
        fps = fingerprints(ns, missed)
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
            if share >= 1.0:  # LRU, the reuse filter or LFU: the predictor neither places nor
                lo = bypass = -1.0  # learns (its labels are reuse under the probation order)
                control = 0
                if share == FILTER and unseen:  # the reuse filter: up to the first key not seen
                    end = start + unseen[0]
        last = len(keys) - 1
        hit = 0 if parent is None else 1 if parent.stamp & HITS_MAX <= 2 else 2
        reused, stored, total = self.predictor.table(ns)
        prior = _PRIOR * total[0] / total[1]
        n = start
        # per block, its feature bucket b: depth (bit length of its position) x `tail` (0 inner,
        # 1 full last, 2 partial last) x `hit` (0 no prefix hit, 1 the parent hit for the first
        # time, 2 the parent reused before) x `since` (blocks since the hit boundary: 0, 1, 2-3,
        # 4+) x seen by the sketch before; and its reuse estimate p = (reused + prior) /
        # (stored + _PRIOR), the prior being the namespace's overall rate. Inline: per stored block.
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
            pending[(ns, keys[i])] = code
            n += 1
        if sampled:  # the mini simulations see the missed sampled keys after the decisions
            self._feed(sampled, placed, real_hits)
        return n - start

    def inserted(self, b: Block[Any]) -> None:
        code = self._pending.pop((b.ns, b.key), -1)
        if b.stamp & HITS_MAX > 1:  # the history remembered it: a ghost hit
            b.flags |= PROTECTED
        if code < 0:  # stored without asking `admit` (its parent was not cached yet)
            h = xxh3_64_intdigest(b.key, _seed(b.ns))
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

    def unlinked(self, b: Block[Any]) -> None:
        if self._tracked:
            bk = self._tracked.pop(b, None)
            if bk is not None:
                self.predictor.learn(b.ns, bk, b.stamp & HITS_MAX >= 2)

    def forget(self, blocks: list[Block[Any]]) -> None:
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
