"""Lookups off the engine scheduler's thread, for a scheduler that asks again at its next step
when told "not known yet" (vLLM's `get_num_new_matched_tokens` answering None).

    fetch_blocks(rid, keys, prompt_tokens)   the blocks of `keys` worth fetching (the daemon's
                                             plan), or None while that Lookup is still running;
                                             `prefetch=True` (a request's hint): a Prefetch of
                                             the keys first, on the same thread
    forget(rid)                              drop the request's answer (or its Lookup in flight)
    submit(job)                              any other call off the scheduler's thread, in
                                             order with the Lookups (a request's `pin`)

With `ends` (one key per key: the block a hit ending at that block ends on instead, e.g. a
recurrent-state block, `vllm/layout.py`), the answer is the largest c within the fetch such that
keys[:c - 1] + [ends[c - 1]] is held: a hit may only end where such an end block is.

The scheduler asks for a waiting request at every step until it schedules it. So the first ask
queues a Lookup for one background thread and answers None; later asks answer None until the
thread has the result, then the result (every time: asking twice is side-effect free). The
answer is kept until the engine allocates the request (`forget`); a preempted request is looked
up again. Without `background` (vLLM's setting `async_lookup: false`) the Lookup runs within
the ask, on the caller's thread. One Lookup per link (a layout: one per TP shard); the answer is
the least of them.

With `wait_s` (a decode engine's: vLLM's `kv_consumer`), each Lookup first waits up to that
long for blocks after the cached prefix that another client is still writing (the daemon's
`wait_pending_ms`); such Lookups run on `threads` background threads, so one that waits does
not hold up the others (with more than one thread, a submitted job is no longer in order with
the Lookups).

A daemon marked down (`DaemonLink.down`) answers 0 at once: no Lookup, no step lost. A failed
Lookup answers 0 (the request is computed). Threading: `fetch_blocks` and `forget` on the
scheduler's thread, the Lookups on the "kvtier-lookup" threads (the links and their clients
are thread-safe), or on the caller's without `background`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from kvtier.integrations.common.link import DaemonLink

log = logging.getLogger("kvtier.integrations.common")

_Ask = tuple[str, list[bytes], int, list[bytes] | None, bool]
"""A queued Lookup: (request id, keys, prompt tokens, end keys, prefetch first)."""
_Job = Callable[[], None]


class Lookups:
    def __init__(self, links: Sequence[DaemonLink], use_plan: bool, background: bool,
                 wait_s: float = 0.0, threads: int = 1) -> None:
        self.links = list(links)
        self.wait_s = wait_s
        self.use_plan = use_plan
        self.background = background
        self._lock = threading.Lock()
        self._done: dict[str, tuple[int, int]] = {}
        """rid -> (number of keys asked, blocks to fetch)"""
        self._running: set[str] = set()
        self._queue: queue.SimpleQueue[_Ask | _Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        if background:
            self._threads = [threading.Thread(target=self._loop, name="kvtier-lookup",
                                              daemon=True) for _ in range(max(1, threads))]
            for t in self._threads:
                t.start()

    def fetch_blocks(self, rid: str, keys: list[bytes], prompt_tokens: int,
                     ends: list[bytes] | None = None, prefetch: bool = False) -> int | None:
        """`prefetch`: bring the keys' cached prefix into DRAM first (a request's hint)."""
        if any(link.down() for link in self.links):
            return 0
        if not self.background:
            if prefetch:
                self.prefetch(keys)
            return self.lookup(keys, prompt_tokens, ends)
        with self._lock:
            done = self._done.get(rid)
            if done is not None and done[0] == len(keys):
                return done[1]
            if rid in self._running:
                return None
            self._running.add(rid)
        self._queue.put((rid, keys, prompt_tokens, ends, prefetch))
        return None

    def submit(self, job: _Job) -> None:
        """Runs `job` on the lookup thread (in order with the Lookups), or here without one: a
        call to the daemon that vLLM's thread must not wait for (a request's pin)."""
        if self.background:
            self._queue.put(job)
        else:
            job()

    def prefetch(self, keys: list[bytes]) -> None:
        """Prefetch on every layout (TP shard); a failure is the link's warning."""
        for link in self.links:
            client = link.client()
            if client is None:
                return
            try:
                client.prefetch(keys, hint=True)
            except Exception as exc:
                link.failed(exc, "Prefetch")

    def pin(self, keys: list[bytes], pin_s: float) -> None:
        """Pins the cached prefix of `keys` on every layout (TP shard) for `pin_s`; a failure
        (a refusal over the tenant's quota, say) is the link's warning."""
        for link in self.links:
            client = link.client()
            if client is None:
                return
            try:
                client.pin(keys, pin_s, hint=True)
            except Exception as exc:
                link.failed(exc, "Pin")

    def forget(self, rid: str) -> None:
        with self._lock:
            self._done.pop(rid, None)
            self._running.discard(rid)

    def lookup(self, keys: list[bytes], prompt_tokens: int, ends: list[bytes] | None = None
               ) -> int:
        """One Lookup per layout (TP shard): the blocks all of them have and plan to fetch;
        with `ends`, cut down to the last block with its end block held (see the module)."""
        hit, fetch = self._lookup(keys, prompt_tokens, True, self.wait_s)
        if ends is None:
            return fetch
        # an end block needs only the blocks before its own: one past the hit when the plan
        # did not cut it (its chain block may be gone, the end block not)
        top = min(hit + 1, len(keys)) if fetch >= hit else fetch
        for c in range(top, 0, -1):
            if self._lookup([*keys[:c - 1], ends[c - 1]], prompt_tokens, False)[0] >= c:
                return c
        return 0

    def _lookup(self, keys: list[bytes], prompt_tokens: int, plan: bool, wait_s: float = 0.0
                ) -> tuple[int, int]:
        """(blocks all layouts hold, blocks all of them plan to fetch)."""
        hit = fetch = len(keys)
        for link in self.links:
            client = link.client()
            if client is None:
                return 0, 0
            try:
                found = client.lookup(keys, prompt_tokens=prompt_tokens,
                                      plan=plan and self.use_plan, wait_pending_s=wait_s)
            except Exception as exc:
                link.failed(exc, "Lookup")
                return 0, 0
            hit, fetch = min(hit, found.hit_blocks), min(fetch, found.fetch_blocks)
        return hit, fetch

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if callable(item):
                try:
                    item()
                except Exception:  # a bug must not kill the thread
                    log.exception("kvtier: a call to the daemon failed")
                continue
            rid, keys, prompt_tokens, ends, prefetch = item
            with self._lock:
                if rid not in self._running:
                    continue  # forgotten (finished, aborted) while queued
            try:
                if prefetch:
                    self.prefetch(keys)
                fetch = self.lookup(keys, prompt_tokens, ends)
            except Exception:  # a bug must not kill the thread: that request computes
                log.exception("kvtier: Lookup failed")
                fetch = 0
            with self._lock:
                if rid in self._running:
                    self._running.discard(rid)
                    self._done[rid] = (len(keys), fetch)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5 + self.wait_s)
