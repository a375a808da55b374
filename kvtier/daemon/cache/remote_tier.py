"""The daemon's side of the remote tier: Lookup's check, Acquire's fetch, the write-through queue.

    Lookup   local prefix ends before the chain does ─▶ `present(ns, rest)`: one pipelined EXISTS
             round trip → how many more blocks the store holds (reported as Tier.REMOTE)
    Acquire  `present` again (before the Acquire claims anything) ─▶ a DRAM slot claimed for
             each key it holds, none for the rest ─▶ `fetch_into(ns, keys, slots)`: one
             pipelined GET round trip, each value verified and copied into its slot → the cache
             inserts the good prefix into the index as DRAM blocks under the Acquire's lease
             (`kvtier.daemon.cache.acquire`)
    Evict    an operator's evict ─▶ `delete`: every key of whole namespaces (SCAN + UNLINK), or
             given keys (UNLINK), off the cache lock
    Commit   admitted blocks ─▶ `offer(RemoteWrite)`: never blocks; a queue bounded in bytes of
             pinned slots and a byte-rate token bucket decide, else the write is dropped and
             counted; a writer thread (`kvtier.tiers.writeq`, shared with the SSD mover) sends
             batches (pipelined SET) and hands them back through
             `on_written` with the ones the store took (the cache unpins the index there
             and publishes them as BlockStored in Tier.REMOTE)

Hand-offs (a prefill's blocks for a decode engine, `AllocateRequest.handoff`):

    Allocate  `mark(ns, keys)`: each key marked pending in the store (one pipelined SET with a
              TTL) before the producer's Allocate returns, so a consumer's daemon that looks
              them up sees they are coming
    Commit    every new block offered at once as an urgent write (ahead of the background
              writes, outside the write rate, `SlotWriteQueue`); the writer deletes each marker
              in the pipeline that SETs its block; a write given up (dropped, failed, the lease
              aborted or expired) deletes its markers off the caller's thread (`unmark_later`)
    Lookup    a consumer's wait (`wait_written`): while the first block the store lacks is
              marked, poll (1 ms doubling to 20 ms) until it is written (then count on), its
              marker goes (given up: end at once) or the wait's bound passes

Faults. Every request has a bounded wait (`RemoteSpec.timeout_s` per socket operation). A failed
request (down, slow, refusing) marks the store down: one warning, `kvtier_remote_up` 0, and every
check/fetch/write is skipped (a local miss, i.e. recompute; writes dropped and counted) until the
backoff interval (0.5 s doubling to 30 s, `kvtier.tiers.backoff`) lets one request probe it
again; the first success logs one recovery line. A damaged value is a miss and a counter, never
served (`kvtier.tiers.remote`). Nothing here can fail a request: the load path degrades to the
local tiers.

The store's eviction (`maxmemory`) is invisible here: a key evicted between Lookup's check and
Acquire's fetch is a miss at fetch time, and the Acquire's prefix ends before it.

Rates: each fetch is a `Link.REMOTE_READ` sample (bytes, whole-request seconds) and each check a
latency sample, so the planner prices remote blocks with the link as measured.

Threading: `present`, `fetch_into` and `offer` may be called from any thread; call `present`
and `fetch_into` without the cache lock (they wait on the network). `on_written` runs on the
writer thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.core.wear import TokenBucket
from kvtier.daemon.cache.namespaces import Namespace
from kvtier.daemon.cache.spec import RemoteTierSpec
from kvtier.daemon.rates.book import Link, RateBook
from kvtier.tiers.backoff import Backoff
from kvtier.tiers.dram import DramPool
from kvtier.tiers.remote import RemoteStore, RemoteUnavailable
from kvtier.tiers.writeq import Offered, QueueSpec, SlotWriteQueue

log = logging.getLogger(__name__)

DROP_REASONS = ("queue_full", "budget", "down", "error", "refused")


class RemoteWrite(NamedTuple):
    ns: Namespace
    key: bytes
    slot: int
    nbytes: int
    handoff: bool = False
    """A prefill's hand-off: urgent, its marker deleted with the write."""


POLL_FIRST_S, POLL_MAX_S = 0.001, 0.02
"""A consumer's poll of a marked block: first interval, doubling up to the second."""


class RemoteMetrics:
    """`kvtier_remote_*` on the daemon's registry (labels bounded: op, result, reason)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("kvtier_remote_requests", "Remote store requests",
                                ["op", "result"], registry=r)
        for op in ("check", "fetch", "store", "delete", "mark"):
            for result in ("ok", "error", "skipped"):
                self.requests.labels(op, result)
        self.blocks = Counter("kvtier_remote_blocks", "Fetched remote blocks by outcome",
                              ["result"], registry=r)
        for result in ("hit", "miss", "corrupt"):
            self.blocks.labels(result)
        self.bytes = Counter("kvtier_remote_bytes", "Bytes moved to/from the remote store",
                             ["direction"], registry=r)
        for d in ("read", "write"):
            self.bytes.labels(d)
        self.written = Counter("kvtier_remote_blocks_written", "Blocks stored remotely",
                               registry=r)
        self.dropped = Counter("kvtier_remote_writes_dropped", "Remote writes not made",
                               ["reason"], registry=r)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self.deleted = Counter("kvtier_remote_blocks_deleted",
                               "Remote blocks deleted by operators' evicts", registry=r)
        self.outages = Counter("kvtier_remote_outages",
                               "Times the remote store was marked down", registry=r)


class _Gauges(Collector):
    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvtier_remote_up", "1 while the remote store answers",
                                value=1.0 if self._tier.backoff.up else 0.0)
        yield GaugeMetricFamily("kvtier_remote_queue_bytes",
                                "DRAM slot bytes held by queued remote writes",
                                value=self._tier.held_bytes)


OnWritten = Callable[[list[RemoteWrite], list[RemoteWrite]], None]  # (batch, stored)


class RemoteTier:
    def __init__(
        self, store: RemoteStore, pool: DramPool, rates: RateBook, registry: CollectorRegistry,
        spec: RemoteTierSpec, on_written: OnWritten,
    ) -> None:
        self.store = store
        self.pool = pool
        self.rates = rates
        self.spec = spec
        self.on_written = on_written
        self.metrics = RemoteMetrics(registry)
        self.backoff = Backoff(spec.backoff_first_s, spec.backoff_max_s)
        self._bucket = TokenBucket(spec.write_bytes_per_s, spec.burst_bytes)
        self._q: SlotWriteQueue[RemoteWrite, list[RemoteWrite]] = SlotWriteQueue(
            pool, QueueSpec(spec.queue_bytes, spec.batch_blocks), self._write, self._written,
            "remote")
        self._unmarker: ThreadPoolExecutor | None = None
        registry.register(_Gauges(self))

    def retune_writes(self, bytes_per_s: float, burst_bytes: int) -> None:
        """A new write-through rate and burst from now on (SIGHUP)."""
        self._bucket.retune(bytes_per_s, burst_bytes)

    def replace_store(self, store: RemoteStore) -> None:
        """Points the tier at another store (address, credentials, TLS, timeout or prefix changed
        by a SIGHUP reload) from now on, and closes the old one: a call under way on it ends as
        an outage would (a bounded wait, counted, a miss), never with wrong data."""
        old, self.store = self.store, store
        old.close()

    @property
    def held_bytes(self) -> int:
        """DRAM slot bytes held by queued or in-flight remote writes."""
        return self._q.held_bytes()

    # -- faults -------------------------------------------------------------------------------

    def _ok(self) -> None:
        if self.backoff.succeeded():
            log.warning("remote store %s is back", self.store.where())

    def _failed(self, op: str, exc: Exception) -> None:
        self.metrics.requests.labels(op, "error").inc()
        if self.backoff.failed():
            self.metrics.outages.inc()
            log.warning("remote store unavailable (%s); local tiers only, retrying with "
                        "backoff: %s", op, exc)
        else:
            log.debug("remote store still unavailable (%s): %s", op, exc)

    def ready(self) -> bool:
        """Whether a request would be tried now (up, or due for a reconnect probe)."""
        return self.backoff.ready()

    # -- load path ----------------------------------------------------------------------------

    def present(self, ns: str, keys: Sequence[bytes]) -> int:
        """Leading blocks of `keys` the store holds (0 when down, slow or erroring)."""
        if not keys:
            return 0
        if not self.backoff.ready():
            self.metrics.requests.labels("check", "skipped").inc()
            return 0
        started = time.perf_counter()
        try:
            n = self.store.present(ns, keys)
        except RemoteUnavailable as exc:
            self._failed("check", exc)
            return 0
        self.rates.observe_latency(Link.REMOTE_READ, time.perf_counter() - started)
        self.metrics.requests.labels("check", "ok").inc()
        self._ok()
        return n

    def fetch_into(self, ns: str, keys: Sequence[bytes], slots: Sequence[int],
                   nbytes: int) -> list[int | None]:
        """Fetches and verifies `keys` into the claimed, unpublished `slots` (`nbytes` each):
        payload bytes per key, None from the first block not served (absent, damaged, down)."""
        if not keys:
            return []
        if not self.backoff.ready():
            self.metrics.requests.labels("fetch", "skipped").inc()
            return [None] * len(keys)
        views = [memoryview(self.pool.view(s, nbytes)) for s in slots]  # type: ignore[arg-type]
        started = time.perf_counter()
        try:
            got = self.store.get_into(ns, keys, views)
        except RemoteUnavailable as exc:
            self._failed("fetch", exc)
            return [None] * len(keys)
        finally:
            del views
        seconds = time.perf_counter() - started
        self.metrics.requests.labels("fetch", "ok").inc()
        self._ok()
        hits = sum(1 for s in got.sizes if s is not None)
        m = self.metrics
        m.blocks.labels("hit").inc(hits)
        if got.corrupt:
            m.blocks.labels("corrupt").inc(len(got.corrupt))
            log.warning("remote store: %d damaged block(s) rejected (%s); recomputing",
                        len(got.corrupt), ", ".join(c.value for c in got.corrupt))
        if hits < len(keys) and not got.corrupt:
            m.blocks.labels("miss").inc()
        if got.nbytes:
            m.bytes.labels("read").inc(got.nbytes)
            self.rates.observe_transfer(Link.REMOTE_READ, got.nbytes, seconds,
                                        includes_latency=True)
        return got.sizes

    def delete_quarantined(self, ns: str, keys: Sequence[bytes]) -> int:
        """Deletes the stored copies of `keys` (a quarantine), tried even in an outage's backoff
        (it must not be skipped); how many existed, or -1 when the store could not be asked."""
        try:
            n = len(self.store.delete(ns, keys))
        except RemoteUnavailable as exc:
            self._failed("delete", exc)
            return -1
        self.metrics.requests.labels("delete", "ok").inc()
        self._ok()
        return n

    # -- write-through ------------------------------------------------------------------------

    def offer(self, w: RemoteWrite) -> str:
        """Queues a remote write without blocking: "" when queued (the slot is pinned until
        written and `on_written` reports it), else why it was dropped (one of DROP_REASONS,
        counted; the slot stays the caller's)."""
        if not self.backoff.ready():
            why = "down"
        else:
            got = self._q.offer(w, lambda: self._bucket.take(w.nbytes), urgent=w.handoff)
            if got is Offered.QUEUED:
                return ""
            why = {Offered.FULL: "queue_full", Offered.REFUSED: "budget"}.get(got, "down")
        self.metrics.dropped.labels(why).inc()
        return why

    def dropped(self, why: str, n: int) -> None:
        """Counts `n` writes not offered (the rest of a chain after a drop)."""
        if n > 0:
            self.metrics.dropped.labels(why).inc(n)

    def _write(self, batch: list[RemoteWrite]) -> list[RemoteWrite]:
        """Sends one batch (on the writer thread); the writes the store took ([] when nothing
        was sent)."""
        m = self.metrics
        if not self.backoff.ready():
            m.dropped.labels("down").inc(len(batch))
            return []
        items = [(w.ns, w.key, memoryview(self.pool.view(w.slot, w.nbytes)))  # type: ignore[arg-type]
                 for w in batch]
        started = time.perf_counter()
        try:
            took, sent = self.store.put_many(items, [w.handoff for w in batch])
        except RemoteUnavailable as exc:
            self._failed("store", exc)
            m.dropped.labels("error").inc(len(batch))
            self.unmark_writes(batch)
            return []
        finally:
            del items
        self._ok()
        m.requests.labels("store", "ok").inc()
        stored = [w for w, ok in zip(batch, took, strict=True) if ok]
        m.written.inc(len(stored))
        m.bytes.labels("write").inc(sent)
        if len(stored) < len(batch):
            m.dropped.labels("refused").inc(len(batch) - len(stored))
            self.unmark_writes([w for w, ok in zip(batch, took, strict=True) if not ok])
        self.rates.observe_transfer(Link.REMOTE_WRITE, sent, time.perf_counter() - started,
                                    includes_latency=True)
        return stored

    def _written(self, batch: list[RemoteWrite], stored: list[RemoteWrite] | None) -> None:
        """The batch's slots are unpinned: hand them back to the cache, with what was stored."""
        if stored is None:  # a bug in the writer, or the tier closed before the batch went out
            self.metrics.dropped.labels("error").inc(len(batch))
        self.on_written(batch, stored or [])

    # -- an operator's evict -------------------------------------------------------------------

    def delete(self, whole: Sequence[Namespace], keys: Sequence[tuple[Namespace, list[bytes]]]
               ) -> tuple[list[tuple[Namespace, list[bytes]]], str]:
        """Deletes every key of the `whole` namespaces and the given keys of the others (no
        cache lock: network); the keys deleted per namespace, and why it stopped early ("" when
        it did not: a store that is down or fails stops it, counted as an outage)."""
        out: list[tuple[Namespace, list[bytes]]] = []
        if not self.backoff.ready():
            self.metrics.requests.labels("delete", "skipped").inc()
            return out, f"remote store {self.store.where()} is down; its copies stay"
        try:
            for ns in whole:
                out.append((ns, self.store.delete_namespace(ns)))
            for ns, some in keys:
                out.append((ns, self.store.delete(ns, some)))
        except RemoteUnavailable as exc:
            self._failed("delete", exc)
            return out, str(exc)
        self.metrics.requests.labels("delete", "ok").inc()
        self._ok()
        self.metrics.deleted.inc(sum(len(k) for _, k in out))
        return out, ""

    def flush(self, timeout: float) -> bool:
        """Waits until every queued write is sent (or dropped); False on timeout."""
        return self._q.flush(timeout)

    # -- hand-offs ----------------------------------------------------------------------------

    def mark(self, ns: str, keys: Sequence[bytes], ttl_s: float) -> bool:
        """Marks a hand-off's keys pending in the store (blocking: call without the cache
        lock); False when the store is down or failed (the consumer then finds nothing to wait
        for, and recomputes what is not written yet)."""
        if not keys:
            return True
        if not self.backoff.ready():
            self.metrics.requests.labels("mark", "skipped").inc()
            return False
        try:
            self.store.mark(ns, keys, ttl_s)
        except RemoteUnavailable as exc:
            self._failed("mark", exc)
            return False
        self.metrics.requests.labels("mark", "ok").inc()
        self._ok()
        return True

    def lacking(self, ns: str, keys: Sequence[bytes]) -> list[bytes]:
        """The `keys` the store does not hold (blocking; [] when it is down: nothing to
        re-send then)."""
        if not keys or not self.backoff.ready():
            return []
        try:
            held = self.store.held_each(ns, keys)
        except RemoteUnavailable as exc:
            self._failed("check", exc)
            return []
        self._ok()
        return [k for k, h in zip(keys, held, strict=True) if not h]

    def unmark_writes(self, writes: Sequence[RemoteWrite]) -> None:
        """Drops the markers of hand-off writes that will not be made."""
        by_ns: dict[str, list[bytes]] = {}
        for w in writes:
            if w.handoff:
                by_ns.setdefault(w.ns, []).append(w.key)
        for ns, keys in by_ns.items():
            self.unmark_later(ns, keys)

    def unmark_later(self, ns: str, keys: Sequence[bytes]) -> None:
        """Deletes hand-off markers on a helper thread (never blocks: callers hold the cache
        lock); one that fails stays until its TTL."""
        if not keys:
            return
        if self._unmarker is None:
            self._unmarker = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-unmark")
        with contextlib.suppress(RuntimeError):  # closing: the markers expire by their TTL
            self._unmarker.submit(self._unmark, ns, list(keys))

    def _unmark(self, ns: str, keys: list[bytes]) -> None:
        try:
            self.store.unmark(ns, keys)
        except RemoteUnavailable as exc:
            self._failed("mark", exc)

    def wait_written(self, ns: str, keys: Sequence[bytes], timeout: float) -> tuple[int, str]:
        """A Lookup's wait for a hand-off another daemon is writing (blocking: call without the
        cache lock): (leading `keys` the store holds at the end, how the wait ended: "" when the
        first key it lacks was not marked, else "committed" (what was marked came), "aborted"
        (a marker went without its block) or "timeout")."""
        deadline = time.monotonic() + timeout
        held = self.present(ns, keys)
        outcome, poll = "", POLL_FIRST_S
        while held < len(keys) and self.backoff.ready():
            try:
                marked = self.store.marked(ns, keys[held])
                more = self.store.present(ns, keys[held:])
            except RemoteUnavailable as exc:
                self._failed("check", exc)
                break
            if more:
                held += more
                outcome, poll = "committed", POLL_FIRST_S
                continue
            if not marked:
                return held, "aborted" if outcome == "waiting" else outcome
            left = deadline - time.monotonic()
            if left <= 0:
                return held, "timeout"
            outcome = "waiting"
            time.sleep(min(poll, left))
            poll = min(poll * 2, POLL_MAX_S)
        return held, "timeout" if outcome == "waiting" else outcome

    def close(self, timeout: float) -> None:
        """Sends what is queued (up to `timeout`), stops the writer, closes the connection."""
        self._q.close(timeout)
        if self._unmarker is not None:
            self._unmarker.shutdown(wait=True)
        self.store.close()
