"""The backend's side of the daemon, SGLang-free: which pages kvtier has (with the planner's
cut), loading them out of mapped DRAM slots, storing them through Allocate/Commit.

    exists(keys, prefix)            leading pages of `keys` worth fetching
    load(keys, prefix, sink)        sink(i, slot view) for each leading cached page; their count
    save(keys, prefix, source)      source(i, slot view) fills each page kvtier lacks; stored?

Shadow verification (`verify_sample`): `exists` answers 0 for a sampled share of its hits and
remembers their keys (`VERIFY_MEMORY` at most); when SGLang then backs those pages up (`save`:
it computed them), each is compared with the bytes kvtier holds under its key
(`common/verify.py`, `regions`: the page's bytes as its dtype) before storing, the result
reported to the daemon (ReportVerification), which quarantines a page that differs with its
descendants; the computed page is then stored in its place. Pages SGLang does not back up
(its write policy) are not compared.

`prefix` is the keys of the pages before `keys` from the prompt's first (SGLang's
`prefix_keys`); None = not given: the chain memory's (`chains.ChainMemory`). When that is not
known either, `exists` and `load` try `keys` as a prompt's first pages (at worst a miss) and
`save` refuses (False, one warning): a page stored under a wrong parent could never be hit.

Failures (DESIGN invariant 7): the daemon down (`DaemonLink`: one warning per outage, a retry
after `retry_after_s`) or refusing makes `exists` and `load` answer 0 (a miss: SGLang
recomputes) and `save` answer False (SGLang logs that the backup failed); nothing raises but a
bug. A load whose lease ended before its Release (daemon restart, TTL) counts as 0 pages:
what it copied is not trusted. Threading: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.integrations.common.link import DaemonLink, unreachable
from kvtier.integrations.common.verify import Region, check_block, describe
from kvtier.integrations.sglang.chains import ChainMemory
from kvtier.integrations.sglang.pool import U8
from kvtier.integrations.sglang.settings import StorageSettings

log = logging.getLogger("kvtier.integrations.sglang")

MAX_SAMPLES = 1024
VERIFY_MEMORY = 65536
"""Keys of sampled hits remembered until SGLang backs their pages up (the oldest forgotten)."""


@dataclass(slots=True)
class StoreStats:
    """Totals since start, and per-call samples SGLang's metrics drain (`drain`)."""

    lookups: int = 0
    hit_pages: int = 0
    loaded_pages: int = 0
    stored_pages: int = 0
    skipped_pages: int = 0
    """Pages a save found already cached."""
    failures: int = 0
    unanchored: int = 0
    """Saves refused because the pages before them were not known."""
    verify_sampled: int = 0
    """`exists` calls whose hit was answered 0 for verification."""
    verified_pages: int = 0
    mismatched_pages: int = 0
    load_pages: list[int] = field(default_factory=list)
    load_gbps: list[float] = field(default_factory=list)
    save_pages: list[int] = field(default_factory=list)
    save_gbps: list[float] = field(default_factory=list)

    def sample(self, pages: list[int], rates: list[float], n: int, nbytes: int,
               seconds: float) -> None:
        if len(pages) < MAX_SAMPLES:
            pages.append(n)
            rates.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)


class PageStore:
    def __init__(self, settings: StorageSettings, decl: LayoutDecl,
                 regions: Sequence[Region] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the time source of the outage window (`DaemonLink`)."""
        self.settings = settings
        self.decl = decl
        self.regions = list(regions) or [Region(0, "full", 0, decl.block_bytes, "uint8")]
        self.link = DaemonLink(settings, decl, "sglang backend", clock)
        self.stats = StoreStats()
        self._chains = ChainMemory(settings.chain_memory)
        self._verify: OrderedDict[bytes, None] = OrderedDict()
        self._rng = random.Random()
        self._lock = threading.Lock()

    def _chain(self, keys: list[bytes], prefix: list[bytes] | None) -> list[bytes] | None:
        """The pages before `keys` (None: not known), learning the chain."""
        with self._lock:
            if prefix is None:
                prefix = self._chains.prefix(keys[0])
            parent = None if prefix is None else prefix[-1] if prefix else b""
            self._chains.remember(keys, parent)
            return prefix

    def exists(self, keys: list[bytes], prefix: list[bytes] | None) -> int:
        if not keys:
            return 0
        before = self._chain(keys, prefix) or []
        client = self.link.client()
        if client is None:
            return 0
        chain = before + keys
        try:
            found = client.lookup(chain, prompt_tokens=len(chain) * self.decl.block_tokens,
                                  plan=self.settings.use_plan)
        except Exception as exc:
            self._failed(exc, "Lookup")
            return 0
        n = max(0, min(found.hit_blocks, found.fetch_blocks) - len(before))
        with self._lock:
            self.stats.lookups += 1
            self.stats.hit_pages += n
            rate = self.settings.verify_sample
            if n and rate > 0 and self._rng.random() < rate:
                self.stats.verify_sampled += 1
                for k in keys[:n]:
                    self._verify[k] = None
                while len(self._verify) > VERIFY_MEMORY:
                    self._verify.popitem(last=False)
                return 0
        return n

    def load(self, keys: list[bytes], prefix: list[bytes] | None,
             sink: Callable[[int, U8], None]) -> int:
        if not keys:
            return 0
        before = self._chain(keys, prefix) or []
        client = self.link.client()
        if client is None:
            return 0
        started = time.perf_counter()
        n = 0
        try:
            with client.load(before + keys) as got:
                n = max(0, got.blocks - len(before))
                for i in range(n):
                    sink(i, got.views[len(before) + i])
        except Exception as exc:
            self._failed(exc, "load")
            return 0
        with self._lock:
            self.stats.loaded_pages += n
            self.stats.sample(self.stats.load_pages, self.stats.load_gbps, n,
                              n * self.decl.block_bytes, time.perf_counter() - started)
        return n

    def save(self, keys: list[bytes], prefix: list[bytes] | None,
             source: Callable[[int, U8], None]) -> bool:
        if not keys:
            return True
        before = self._chain(keys, prefix)
        if before is None:
            with self._lock:
                self.stats.unanchored += 1
                first = self.stats.unanchored == 1
            if first:
                log.warning("kvtier sglang backend: refused to store pages whose preceding "
                            "pages are unknown (launch SGLang with "
                            "\"hicache_storage_pass_prefix_keys\": true in "
                            "--hicache-storage-backend-extra-config); warned once")
            return False
        client = self.link.client()
        if client is None:
            return False
        with self._lock:
            check = [i for i, k in enumerate(keys) if k in self._verify]
            for i in check:
                del self._verify[keys[i]]
        started = time.perf_counter()
        try:
            if check:
                self._compare(client, before, keys, check, source)
            with client.store_into(keys, parent=before[-1] if before else b"") as tx:
                for i, view in tx.slots:
                    source(i, view)
        except Exception as exc:
            self._failed(exc, "store")
            return False
        with self._lock:
            self.stats.stored_pages += tx.committed
            self.stats.skipped_pages += len(keys) - len(tx.slots)
            self.stats.sample(self.stats.save_pages, self.stats.save_gbps, len(tx.slots),
                              len(tx.slots) * self.decl.block_bytes,
                              time.perf_counter() - started)
        return True

    def _compare(self, client: Client, before: list[bytes], keys: list[bytes],
                 check: list[int], source: Callable[[int, U8], None]) -> None:
        """Shadow verification of pages `check` of a save (see the module docstring); raises
        only when the daemon is unreachable."""
        computed = np.empty(self.decl.block_bytes, np.uint8)
        compared: list[bytes] = []
        bad = None
        try:
            with client.load(before + keys) as got:  # released before the report
                held = got.blocks - len(before)
                for i in check:
                    if i >= held:
                        break
                    source(i, computed)
                    stored = torch.from_numpy(np.array(got.views[len(before) + i]))
                    result = check_block(torch.from_numpy(computed), stored, self.regions)
                    compared.append(keys[i])
                    if not result.ok:
                        bad = result.first_bad
                        break
            if not compared:
                return
            matched = len(compared) - (bad is not None)
            detail = "" if bad is None else f"page {len(before) + check[matched]}: {describe(bad)}"
            reply = client.report_verification(compared, matched, bad is not None, detail)
        except Exception as exc:
            if unreachable(exc):
                raise
            log.debug("kvtier sglang backend: verification failed: %s", exc)
            return
        with self._lock:
            self.stats.verified_pages += len(compared)
            self.stats.mismatched_pages += bad is not None
        if bad is not None:
            log.warning("kvtier verify: MISMATCH, model %r, %s; the daemon quarantined it and "
                        "its descendants (%d DRAM, %d SSD, %d remote copies%s); storing the "
                        "recomputed page", self.decl.model_id, detail, reply.quarantined_dram,
                        reply.quarantined_ssd, reply.quarantined_remote,
                        ", the rest once unpinned" if reply.deferred else "")

    def drain(self) -> tuple[list[int], list[float], list[int], list[float]]:
        """The per-call samples since the last drain: (load pages, load GB/s, save pages,
        save GB/s)."""
        with self._lock:
            s = self.stats
            out = (s.load_pages, s.load_gbps, s.save_pages, s.save_gbps)
            s.load_pages, s.load_gbps, s.save_pages, s.save_gbps = [], [], [], []
            return out

    def _failed(self, exc: BaseException, what: str) -> None:
        with self._lock:
            self.stats.failures += 1
        self.link.failed(exc, what)

    def close(self) -> None:
        self.link.close()
