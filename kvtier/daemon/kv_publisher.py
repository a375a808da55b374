"""The node's KV-event stream for KV-aware routers: every tier change of every tenant, published
over ZMQ in vLLM's KVEventBatch format (`kvtier.core.kv_events`), with vLLM's replay endpoint.

    cache thread(s)                      publisher thread
    Applier -> EventLog.stored/removed -> offer -> pending (bounded deque) -> batch -> encode
                                                  -> XPUB send (NOBLOCK) -> replay ring
                                                  <- ROUTER replay requests

`offer` is what the daemon pays per event: an append to a bounded deque (a full one drops the
event, counted as `dropped_queue`); nothing wakes the publisher, whose thread owns both sockets
and drains the deque every `FLUSH_S` (a wake-up per event made every Commit hand the GIL to it,
which cost Lookups 15-20% on a loaded machine). One batch holds the events pending then (at most
`MAX_BATCH_EVENTS`; consecutive removals from one tier, which the applier reports one block at a
time, become one BlockRemoved); its sequence number counts batches from 0, as vLLM's publisher
does.

A slow subscriber never slows the daemon: the XPUB socket is set to XPUB_NODROP, so a subscriber
whose queue is at the high-water mark makes `send` fail at once instead of blocking; the batch is
then counted (its blocks as `dropped_hwm`) and kept in the replay ring like every other batch, so
a subscriber that sees a gap in the sequence numbers asks the replay endpoint for it.

Scope: this stream is node-wide (an admin's view: every tenant's blocks); ZMQ has no tokens, so who
may read it is decided by where it binds (default loopback). A tenant's own stream is WatchEvents
over the authenticated gRPC API.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from kvtier.core import kv_events as wire
from kvtier.core.errors import UsageError
from kvtier.daemon.cache.events import BlockEvent
from kvtier.daemon.metrics import DaemonMetrics

log = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1024
MAX_PENDING_EVENTS = 100_000
REPLAY_BATCHES = 10_000
FLUSH_S = 0.005


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or port (`*`), `::`, ipc:// or inproc:// binds; any other
    address is a subscriber's to connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Binds (or connects, by `binds`) `endpoint`, binds `replay` ("" = no replay), at once: a
    bad or busy address is a UsageError at start-up. `close()` publishes what is pending, then
    closes the sockets."""

    def __init__(self, endpoint: str, replay: str, topic: str, hwm: int,
                 metrics: DaemonMetrics | None = None) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)  # to a collector that binds (llm-d's indexer)
            if replay:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise UsageError(f"kv_events: cannot bind {endpoint}"
                             f"{' / ' + replay if replay else ''}: {exc}") from None
        self.endpoint = (self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if binds(endpoint)
                         else endpoint)
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else "")
        self._topic = topic.encode()
        self._pending: deque[BlockEvent] = deque()
        self._wake = threading.Event()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._seq = 0
        self._running = True
        self._metrics = metrics
        self.published_blocks = 0
        self.dropped_blocks = {"queue": 0, "hwm": 0}
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def offer(self, event: BlockEvent) -> None:
        """Queues one event (any thread; called under the event log's lock, so in node order)."""
        if len(self._pending) >= MAX_PENDING_EVENTS:
            self._count("queue", len(event.keys))
            return
        self._pending.append(event)

    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _count(self, where: str, blocks: int) -> None:
        if where == "published":
            self.published_blocks += blocks
        else:
            self.dropped_blocks[where] += blocks
        if self._metrics is not None:
            self._metrics.kv_events.labels(where if where == "published"
                                           else f"dropped_{where}").inc(blocks)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)  # subscription messages
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            running = self._running
            for sock, _ in poller.poll(0):
                if sock is self._replay:
                    self._serve_replay()
                else:
                    self._pub.recv(zmq.NOBLOCK)
            while self._pending:
                self._publish()
            if not running:
                return
            self._wake.wait(FLUSH_S)

    def _publish(self) -> None:
        pending = self._pending
        events: list[wire.Event] = []
        blocks = 0
        gone: list[wire.BlockHash] | None = None  # the open BlockRemoved's hashes
        gone_tier = -1
        while pending and len(events) < MAX_BATCH_EVENTS:
            e = pending.popleft()
            blocks += len(e.keys)
            if e.stored:
                gone = None
                events.append(wire.stored(e.tier, list(e.keys), e.parent or None,
                                          e.block_tokens))
            elif gone is not None and e.tier == gone_tier:  # one eviction run: one event
                gone.extend(e.keys)
            else:
                gone, gone_tier = list(e.keys), e.tier
                events.append(wire.removed(e.tier, gone))
        payload = wire.encode(wire.EventBatch(time.time(), events))
        seq = self._seq
        self._seq += 1
        self._ring.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     zmq.NOBLOCK)
        except zmq.Again:
            self._count("hwm", blocks)
            return
        self._count("published", blocks)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events replay: ignored a malformed request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._ring):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))
