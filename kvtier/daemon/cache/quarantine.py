"""Quarantine: a block an engine found wrong (shadow verification, `Cache.report_verification`)
leaves every tier this node holds, with every block after it in its chain, and is never served
again.

    begin(ns, key)   (cache lock)  `key` joins the cut set: from now on every Lookup and Acquire
                                   of a chain through it stops before it (`cut`), on every tier
                                   and the remote store alike. Then the index removes it and its
                                   subtree (`PrefixIndex.remove_subtree`; the applier frees the
                                   DRAM slots, deletes the SSD copies, publishes BlockRemoved and
                                   counts the evictions under "quarantine"). A subtree with a
                                   pinned block (a read lease, a queued write-back or remote
                                   write) stays pending: retried at every `apply` after a pin
                                   goes (`retry`), cut meanwhile.
    remote deletes   (no lock)     the remote copies of the removed keys (those this node's
                                   index knew, or the key itself) are deleted from the store;
                                   then BlockRemoved for Tier.REMOTE
    settle(ns, key)  (cache lock)  the key leaves the cut set once it left every tier: a block
                                   stored under it afterwards (the engine's recomputed KV) is
                                   served again. A remote delete that failed keeps the key cut
                                   until the daemon restarts (never the stale remote copy).

Only a chain through `key` reaches its descendants (prefix hits start at the first block), so
cutting `key` alone keeps the whole subtree from being served. Remote copies of descendants this
node's index no longer knew are left in the store: unreachable while `key` is absent there.

Threading: `begin`, `retry`, `settle` and `cut` with the cache lock held; the remote deletes of
a pending subtree run on a short-lived thread (`RemoteDeletes`), which takes the lock to settle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

from kvtier.core.types import Tier
from kvtier.daemon.cache.namespaces import Namespace
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.index.prefix import IndexStateError, PrefixIndex

log = logging.getLogger(__name__)


class Removed(NamedTuple):
    """What one quarantine took from the local tiers, and the keys whose remote copies go."""

    dram: int
    ssd: int
    keys: list[bytes]


class Quarantine:
    def __init__(self, index: PrefixIndex[Namespace], apply: Callable[[str], None],
                 metrics: DaemonMetrics) -> None:
        self.index = index
        self._apply = apply
        self.metrics = metrics
        self._cut: dict[Namespace, set[bytes]] = {}
        self.pending: set[tuple[Namespace, bytes]] = set()
        self.on_removed: Callable[[Namespace, bytes, Removed], None] | None = None
        """Called (lock held) when a pending subtree finally left the local tiers."""

    def cut(self, ns: Namespace, chain: list[bytes]) -> list[bytes]:
        """`chain` up to (not including) its first quarantined key."""
        if not self._cut:
            return chain
        keys = self._cut.get(ns)
        if not keys:
            return chain
        for i, k in enumerate(chain):
            if k in keys:
                return chain[:i]
        return chain

    def begin(self, ns: Namespace, key: bytes) -> Removed | None:
        """Cuts `key` and removes it with its subtree from the local tiers; None when a block of
        the subtree is pinned (pending: `retry` removes it later)."""
        self._cut.setdefault(ns, set()).add(key)
        got = self._remove(ns, key)
        if got is None:
            self.pending.add((ns, key))
        return got

    def _remove(self, ns: Namespace, key: bytes) -> Removed | None:
        if self.index.get(ns, key) is None:
            return Removed(0, 0, [key])  # no local copy; the remote one may exist
        try:
            evicted = self.index.remove_subtree(ns, key)
        except IndexStateError:
            return None
        self._apply("quarantine")
        dram = sum(1 for e in evicted if e.tier is Tier.DRAM)
        ssd = sum(1 for e in evicted if e.tier is Tier.SSD)
        self.metrics.verify_quarantined.labels("dram").inc(dram)
        self.metrics.verify_quarantined.labels("ssd").inc(ssd)
        return Removed(dram, ssd, list(dict.fromkeys(e.key for e in evicted)))

    def retry(self) -> None:
        """Removes the pending subtrees no pin holds any more (after a release)."""
        for ns, key in list(self.pending):
            got = self._remove(ns, key)
            if got is None:
                continue
            self.pending.discard((ns, key))
            log.warning("quarantined block %s of %s left the local tiers after its pins went: "
                        "%d DRAM, %d SSD copies", key.hex(), ns, got.dram, got.ssd)
            if self.on_removed is not None:
                self.on_removed(ns, key, got)

    def settle(self, ns: Namespace, key: bytes) -> None:
        """`key` left every tier: it is served again once stored again."""
        if (ns, key) in self.pending:
            return
        keys = self._cut.get(ns)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._cut[ns]

    def quarantined(self, ns: Namespace) -> int:
        """Keys of `ns` lookups stop before now."""
        return len(self._cut.get(ns, ()))


class RemoteDeletes:
    """Deletes a pending subtree's remote copies off the cache lock (a thread per subtree: rare),
    then settles it under the lock. `delete(ns, keys)`: the remote tier's delete (-1 when the
    store could not be reached); `done(ns, key, keys, deleted)`: under the lock."""

    def __init__(self, lock: threading.RLock,
                 delete: Callable[[Namespace, list[bytes]], int],
                 done: Callable[[Namespace, bytes, list[bytes], int], None]) -> None:
        self._lock = lock
        self._delete = delete
        self._done = done
        self.threads: list[threading.Thread] = []

    def start(self, ns: Namespace, key: bytes, keys: list[bytes]) -> None:
        t = threading.Thread(target=self._run, args=(ns, key, keys), name="kvtier-quarantine",
                             daemon=True)
        self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()

    def _run(self, ns: Namespace, key: bytes, keys: list[bytes]) -> None:
        deleted = self._delete(ns, keys)
        with self._lock:
            self._done(ns, key, keys, deleted)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
