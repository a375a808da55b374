"""kvtier's tiers in vLLM's own KV-event stream (`--kv-events-config`), for KV-aware routers.

The scheduler side's `take_events` (vLLM calls it every step and publishes what it yields beside
its GPU pool's events, in one KVEventBatch) hands out what `TierEvents` has seen since the last
step. `TierEvents` follows the daemon's WatchEvents stream of this engine's tenant on its own
thread and connection, keeps the events of this engine's layout (one KV shard's: every shard
holds the same blocks), and turns them into vLLM's events:

    daemon stored   in DRAM / SSD / remote   ->  BlockStored, medium "CPU" / "STORAGE" / "REMOTE"
    daemon removed  from the block's last tier on this node  ->  BlockRemoved (that tier's medium)

(the remote store is not on this node: a copy there does not keep a BlockRemoved back, and its
own evictions are never published, by the daemon either)

Hashes are the daemon's keys, which are vLLM's block hashes (`kvtier.core.keys.block_keys`), in
the form vLLM's own events give them (`maybe_convert_block_hash`: the low 64 bits as an int unless
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), so a router joins the GPU and tier streams as they are.
A removal from one tier while another still holds the block is not published (the block is still
here); the router learns of the copy from its BlockStored. A dropped connection resumes from
the last sequence seen (the daemon replays its buffered events); events that overflow the
bounded queue between two steps are dropped and counted (`dropped`; the scheduler side reports
them with the connector's stats, `vllm:kvtier_dropped_tier_events_total`).

Threading: the watch thread fills a deque; vLLM's scheduler thread drains it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.client.sync_client import TIER_FROM_PB, Client, LayoutDecl
from kvtier.core import kv_events as wire
from kvtier.core.types import Tier
from kvtier.integrations.common.link import DaemonLink

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent

    from kvtier._proto import kvtier_pb2 as pb

log = logging.getLogger(__name__)

MAX_QUEUED = 100_000
RETRY_S = 1.0


class TierEvents:
    def __init__(self, connect: Callable[[], Client], decl: LayoutDecl) -> None:
        self._connect = connect
        self._decl = decl
        self._queue: deque[KVCacheEvent] = deque()
        self._tiers: dict[bytes, set[int]] = {}  # key -> tiers holding it here
        self._since = 0
        self._client: Client | None = None
        self._closed = threading.Event()
        self.dropped = 0  # events not queued (the queue was full); only the watch thread adds
        self._reported = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-events",
                                        daemon=True)
        self._thread.start()

    def take(self) -> list[KVCacheEvent]:
        """vLLM's KVCacheEvents since the last call (vLLM's scheduler thread)."""
        out = []
        q = self._queue
        while q:
            out.append(q.popleft())
        return out

    def take_dropped(self) -> int:
        """Events dropped since the last call (vLLM's scheduler thread)."""
        dropped = self.dropped
        delta, self._reported = dropped - self._reported, dropped
        return delta

    def close(self) -> None:
        self._closed.set()
        client = self._client
        if client is not None:
            client.close()  # ends the watch stream
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                client = self._client = self._connect()
                layout = client.layout.layout_id
                for ev in client.watch(since=self._since):
                    self._since = ev.sequence
                    self._on(ev, layout)
            except Exception as exc:  # daemon down, restarting, or closed by close()
                if self._closed.is_set():
                    return
                log.info("kvtier tier events: %s; again in %.0f s", exc, RETRY_S)
            finally:
                if self._client is not None:
                    self._client.close()
                    self._client = None
            self._closed.wait(RETRY_S)

    def _on(self, ev: pb.KvEvent, layout: bytes) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        def vllm_hash(key: bytes) -> bytes | int:
            return maybe_convert_block_hash(BlockHash(key))

        if ev.HasField("stored"):
            s = ev.stored
            if s.layout != layout:
                return
            tier = TIER_FROM_PB[s.medium]
            if tier is not Tier.REMOTE:  # the shared store is not on this node
                for h in s.block_hashes:
                    self._tiers.setdefault(h, set()).add(tier)
            parent = s.parent_block_hash
            self._put(BlockStored(
                block_hashes=[vllm_hash(h) for h in s.block_hashes],
                parent_block_hash=vllm_hash(parent) if parent else None,
                token_ids=[], block_size=s.block_size, lora_id=None,
                medium=wire.MEDIUM[tier], lora_name=None, locality=wire.LOCALITY[tier],
                ownership=wire.OWNERSHIP))
        elif ev.HasField("removed"):
            r = ev.removed
            if r.layout != layout:
                return
            tier = TIER_FROM_PB[r.medium]
            gone: list[bytes | int] = []
            for h in r.block_hashes:
                held = self._tiers.get(h)
                if held is None:
                    continue  # stored before this engine watched: not published by it
                held.discard(tier)
                if not held:
                    del self._tiers[h]
                    gone.append(vllm_hash(h))
            if gone:
                self._put(BlockRemoved(block_hashes=gone, medium=wire.MEDIUM[tier],
                                       locality=wire.LOCALITY[tier], ownership=wire.OWNERSHIP))

    def _put(self, event: KVCacheEvent) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append(event)



def tier_events(vllm_config: VllmConfig, link: DaemonLink) -> TierEvents | None:
    """A `TierEvents` on `link`'s daemon and layout when vLLM publishes KV events (its
    `--kv-events-config` enables them), else None."""
    kec = vllm_config.kv_events_config
    if kec is None or not kec.enable_kv_cache_events:
        return None
    s = link.settings

    def connect() -> Client:
        return Client(link.socket, layout=link.decl, token=s.token or None, timeout=s.timeout_s)

    return TierEvents(connect, link.decl)
