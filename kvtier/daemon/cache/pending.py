"""Waiting for blocks another client is still writing: a decode engine's Lookup for the blocks
its prefill engine has allocated but not yet committed (prefill/decode hand-off).

    wait(lease_id)              a future for the WRITE lease that holds the key a Lookup stopped
                                at: True once the lease commits, False once it ends without
                                committing (Abort, TTL, its session closed, a rekeyed tenant)
    ended(lease_id, committed)  the lease left the lease table: resolves its waiters
    forget(lease_id, future)    a waiter that stopped waiting (its bound passed, it was cancelled)

Nothing here waits: `Cache.lookup_async` awaits the future on the event loop without the cache
lock, bounded by the request's `wait_pending_ms` (capped by the daemon's `max_pending_wait_s`),
and then looks up again (the commit may have dropped blocks, another lease may hold the next
key). A lease that already ended is never waited for: `wait` is called with the cache lock held
right after the key was found in its namespace's `pending`, and `ended` runs with the same lock
held as the lease leaves the table.

Threading: `wait` and `forget` on the event loop's thread with the cache lock held; `ended` with
the cache lock held on any thread (a Commit on the loop, an expiry, a closing session): it hands
each future's result to that future's loop (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio


class WriteWaits:
    def __init__(self) -> None:
        self._waiters: dict[str, list[asyncio.Future[bool]]] = {}

    def wait(self, lease_id: str) -> asyncio.Future[bool]:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(lease_id, []).append(fut)
        return fut

    def forget(self, lease_id: str, fut: asyncio.Future[bool]) -> None:
        waiting = self._waiters.get(lease_id)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._waiters[lease_id]

    def ended(self, lease_id: str, committed: bool) -> None:
        for fut in self._waiters.pop(lease_id, ()):
            fut.get_loop().call_soon_threadsafe(_resolve, fut, committed)

    def __len__(self) -> int:
        """Waiters registered now."""
        return sum(map(len, self._waiters.values()))


def _resolve(fut: asyncio.Future[bool], committed: bool) -> None:
    if not fut.done():
        fut.set_result(committed)
