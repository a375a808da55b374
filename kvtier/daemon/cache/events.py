"""Block events (stored / removed, per tier) with sequence numbers, for WatchEvents subscribers.

`EventLog.stored` / `EventLog.removed` are called by the applier (`kvtier.daemon.cache.applier`, the
one producer) from any thread; it appends to a bounded ring (for replay
after a reconnect, `since`) and wakes subscribers. A subscriber is an asyncio queue bound to its
event loop; a subscriber that falls `max_queue` events behind is dropped (its stream ends with a
gap it can detect from the sequence numbers) rather than slowing the cache down. `sink`, when
set, also gets every event, in node order, under the log's lock (the ZMQ KV-event publisher,
`kvtier.daemon.kv_publisher`: it must only queue). The log's lock is taken with the cache lock
held (the applier emits) and takes no other lock (the sink appends to a deque).

Sequence numbers are per tenant (a tenant's stream counts only its own events, so it has no gaps
made by anyone else's); each event also carries a node-wide number, which the streams of admin
tokens (node-wide subscribers: every tenant's events) use instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.types import Tier


@dataclass(frozen=True, slots=True)
class BlockEvent:
    sequence: int  # the tenant's
    node_sequence: int
    timestamp: float
    tenant: str
    layout: bytes
    stored: bool  # False = removed
    tier: Tier
    keys: tuple[bytes, ...]
    parent: bytes  # stored only; b"" = no parent
    block_tokens: int


class Subscription:
    """One WatchEvents stream's queue. `None` in the queue ends the stream."""

    def __init__(self, tenant: str | None, loop: asyncio.AbstractEventLoop,
                 max_queue: int) -> None:
        self.tenant = tenant  # None: every tenant's events, node-wide sequence numbers
        self.loop = loop
        self.queue: asyncio.Queue[BlockEvent | None] = asyncio.Queue()
        self.max_queue = max_queue
        self.dropped = False


class EventLog:
    """Thread-safe producer side; subscribers consume on their own event loops."""

    def __init__(self, keep: int = 10_000, max_queue: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._ring: deque[BlockEvent] = deque(maxlen=keep)
        self._subs: list[Subscription] = []
        self._seq = 0
        self._tenant_seq: dict[str, int] = {}
        self._max_queue = max_queue
        self.sink: Callable[[BlockEvent], None] | None = None

    @property
    def sequence(self) -> int:
        return self._seq

    def tenant_sequence(self, tenant: str) -> int:
        with self._lock:
            return self._tenant_seq.get(tenant, 0)

    def stored(
        self, tenant: str, layout: bytes, tier: Tier, keys: list[bytes], parent: bytes = b"",
        block_tokens: int = 0,
    ) -> None:
        """One BlockStored event: `keys`, consecutive blocks of one chain (the first one's
        parent `parent`, b"" = none), now have a copy in `tier`. No keys: no event."""
        self._emit(tenant, layout, True, tier, keys, parent, block_tokens)

    def removed(self, tenant: str, layout: bytes, tier: Tier, keys: list[bytes]) -> None:
        """One BlockRemoved event: `keys` no longer have a copy in `tier`. No keys: no event."""
        self._emit(tenant, layout, False, tier, keys, b"", 0)

    def _emit(
        self, tenant: str, layout: bytes, stored: bool, tier: Tier, keys: list[bytes],
        parent: bytes, block_tokens: int,
    ) -> None:
        if not keys:
            return
        with self._lock:
            self._seq += 1
            seq = self._tenant_seq[tenant] = self._tenant_seq.get(tenant, 0) + 1
            event = BlockEvent(
                seq, self._seq, time.time(), tenant, layout, stored, tier, tuple(keys), parent,
                block_tokens,
            )
            self._ring.append(event)
            if self.sink is not None:
                self.sink(event)
            subs = [s for s in self._subs if s.tenant in (tenant, None)]
        for sub in subs:
            self._deliver(sub, event)

    def _deliver(self, sub: Subscription, event: BlockEvent | None) -> None:
        if sub.dropped:
            return
        if event is not None and sub.queue.qsize() >= sub.max_queue:
            sub.dropped = True
            event = None
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)
        except RuntimeError:  # the subscriber's loop is closed
            sub.dropped = True

    def subscribe(self, tenant: str | None, since: int = 0) -> Subscription:
        """A queue of this tenant's events after its sequence `since` (buffered ones first), on
        this loop; `tenant=None`: every tenant's, after node sequence `since`."""
        sub = Subscription(tenant, asyncio.get_running_loop(), self._max_queue)
        with self._lock:
            backlog = [e for e in self._ring
                       if (e.node_sequence > since if tenant is None
                           else e.tenant == tenant and e.sequence > since)]
            self._subs.append(sub)
        for event in backlog if since else ():
            sub.queue.put_nowait(event)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        """Ends every subscriber's stream."""
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            self._deliver(sub, None)
