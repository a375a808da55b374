"""Lookups off the engine scheduler's thread, for a scheduler that asks again at its next step
when told "not known yet" (vLLM's `get_num_new_matched_tokens` answering None).

    fetch_blocks(rid, keys, prompt_tokens)   the blocks of `keys` worth fetching (the daemon's
                                             plan), or None while that Lookup is still running
    forget(rid)                              drop the request's answer (or its Lookup in flight)

The scheduler asks for a waiting request at every step until it schedules it. So the first ask
queues a Lookup for one background thread and answers None; later asks answer None until the
thread has the result, then the result (every time: asking twice is side-effect free). The
answer is kept until the engine allocates the request (`forget`); a preempted request is looked
up again. Without `background` (vLLM's setting `async_lookup: false`) the Lookup runs within
the ask, on the caller's thread. One Lookup per link (a layout: one per TP shard); the answer is
the least of them.

A daemon marked down (`DaemonLink.down`) answers 0 at once: no Lookup, no step lost. A failed
Lookup answers 0 (the request is computed). Threading: `fetch_blocks` and `forget` on the
scheduler's thread, the Lookups on the "kvtier-lookup" thread; the links are used by one of
them only (the thread, or the caller without `background`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from kvtier.integrations.common.link import DaemonLink

log = logging.getLogger("kvtier.integrations.common")

_STOP: tuple[str, list[bytes], int] = ("", [], 0)


class Lookups:
    def __init__(self, links: Sequence[DaemonLink], use_plan: bool, background: bool) -> None:
        self.links = list(links)
        self.use_plan = use_plan
        self.background = background
        self._lock = threading.Lock()
        self._done: dict[str, tuple[int, int]] = {}
        """rid -> (number of keys asked, blocks to fetch)"""
        self._running: set[str] = set()
        self._queue: queue.SimpleQueue[tuple[str, list[bytes], int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvtier-lookup",
                                            daemon=True)
            self._thread.start()

    def fetch_blocks(self, rid: str, keys: list[bytes], prompt_tokens: int) -> int | None:
        if any(link.down() for link in self.links):
            return 0
        if not self.background:
            return self.lookup(keys, prompt_tokens)
        with self._lock:
            done = self._done.get(rid)
            if done is not None and done[0] == len(keys):
                return done[1]
            if rid in self._running:
                return None
            self._running.add(rid)
        self._queue.put((rid, keys, prompt_tokens))
        return None

    def forget(self, rid: str) -> None:
        with self._lock:
            self._done.pop(rid, None)
            self._running.discard(rid)

    def lookup(self, keys: list[bytes], prompt_tokens: int) -> int:
        """One Lookup per layout (TP shard): the blocks all of them have and plan to fetch."""
        fetch = len(keys)
        for link in self.links:
            client = link.client()
            if client is None:
                return 0
            try:
                found = client.lookup(keys, prompt_tokens=prompt_tokens, plan=self.use_plan)
            except Exception as exc:
                link.failed(exc, "Lookup")
                return 0
            fetch = min(fetch, found.fetch_blocks)
        return fetch

    def _loop(self) -> None:
        while True:
            rid, keys, prompt_tokens = self._queue.get()
            if not rid:
                return
            with self._lock:
                if rid not in self._running:
                    continue  # forgotten (finished, aborted) while queued
            try:
                fetch = self.lookup(keys, prompt_tokens)
            except Exception:  # a bug must not kill the thread: that request computes
                log.exception("kvtier: Lookup failed")
                fetch = 0
            with self._lock:
                if rid in self._running:
                    self._running.discard(rid)
                    self._done[rid] = (len(keys), fetch)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5)
