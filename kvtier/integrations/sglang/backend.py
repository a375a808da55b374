"""kvtier as SGLang's HiCache L3 storage backend (`HiCacheStorage`), loaded by SGLang's dynamic
backend factory: `module_path` "kvtier.integrations.sglang.backend", `class_name`
"KvtierStorage" (docs/sglang.md). Each TP rank builds one; it is a client
of the local daemon (`store.PageStore`), never a second cache.

Paths: with `"interface_v1": 1` SGLang calls `batch_get_v1` / `batch_set_v1` with host pool
slots, and pages are copied between mapped DRAM slots and the host pool's pages with no
buffer between. Without it, the generic `get`/`set`/`batch_get`/`batch_set` carry flat page
tensors. Both store the same bytes under the same keys. `batch_exists` answers the leading
pages worth fetching (the daemon planner's cut). The hybrid `*_v2` calls are not implemented
(SGLang's base class raises NotImplementedError): models with extra pools (Mamba, SWA, DSA
sidecars) are not supported.

The v1 methods always return a list (a None would end SGLang's prefetch thread); a daemon
that is down or refuses makes them all-False, with one warning per outage.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.integrations.sglang.chains import page_key, page_keys
from kvtier.integrations.sglang.layout import declare, default_model_id, model_cost
from kvtier.integrations.sglang.pool import U8, HostPages, page_regions
from kvtier.integrations.sglang.settings import StorageSettings
from kvtier.integrations.sglang.store import PageStore

log = logging.getLogger("kvtier.integrations.sglang")


def _bytes(t: torch.Tensor) -> U8:
    """A contiguous CPU tensor's bytes (a view)."""
    flat = t.reshape(-1)
    out: U8 = (flat.view(torch.uint8) if flat.element_size() != 1 else flat).numpy()
    return out


class KvtierStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = storage_config
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        args = _server_args()
        self.model_path = str(args["model_path"]) if args else storage_config.model_name
        self.model_id = self.settings.model_id or default_model_id(args,
                                                                   storage_config.model_name)
        self.writer = bool(storage_config.is_storage_writer)
        self.pages: HostPages | None = None
        self._store: PageStore | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        decl = declare(pages.geometry, self.config, mem_pool_host, self.model_id,
                       model_cost(self.model_path))
        if self._store is not None:
            self._store.close()
        self.pages, self._store = pages, PageStore(self.settings, decl,
                                                   page_regions(pages.geometry))
        log.info("kvtier backend: rank %d/%d, %s pages of %d tokens, %d bytes, model %s",
                 self.config.tp_rank, self.config.tp_size, pages.geometry.layout,
                 pages.page_size, decl.block_bytes, self.model_id)

    @property
    def store(self) -> PageStore:
        if self._store is None:
            raise RuntimeError("kvtier backend: register_mem_pool_host was not called")
        return self._store

    def _pages(self) -> HostPages:
        if self.pages is None:
            raise RuntimeError("kvtier backend: register_mem_pool_host was not called")
        return self.pages

    # -- zero-copy path (interface_v1) -----------------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.store.exists(page_keys(keys), _prefix(extra_info))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._pages()
        firsts = pages.firsts(host_indices, len(keys))
        n = self.store.load(page_keys(keys), _prefix(extra_info),
                            lambda i, view: pages.copy_in(firsts[i], view))
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._pages()
        firsts = pages.firsts(host_indices, len(keys))
        if not (self.settings.store and self.writer):
            return [True] * len(keys)
        ok = self.store.save(page_keys(keys), _prefix(extra_info),
                             lambda i, view: pages.copy_out(firsts[i], view))
        return [ok] * len(keys)

    # -- generic path ------------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Flat pages into `target_locations` (SGLang's dummy flat pages), or new tensors of the
        pool's dtype; None from the first page kvtier lacks on."""
        pool = self._pages().pool
        out: list[torch.Tensor | None] = [None] * len(keys)

        def sink(i: int, view: U8) -> None:
            dst = (target_locations[i] if target_locations is not None
                   else pool.get_dummy_flat_data_page())
            np.copyto(_bytes(dst), view, casting="no")
            out[i] = dst

        self.store.load(page_keys(keys), None, sink)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvtier: batch_set needs one value per key")
        if not (self.settings.store and self.writer):
            return True

        def source(i: int, view: U8) -> None:
            np.copyto(view, _bytes(values[i].contiguous()), casting="no")

        return self.store.save(page_keys(keys), None, source)

    def exists(self, key: str) -> bool:
        return self.store.exists([page_key(key)], None) == 1

    # -- the rest ----------------------------------------------------------------------------

    def clear(self) -> None:
        """kvtier's pages are shared with other instances and survive this one: nothing is
        dropped (`kvtier` has no per-client clear)."""

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        load_pages, load_gbps, save_pages, save_gbps = self.store.drain()
        m = StorageMetrics()
        m.prefetch_pgs.extend(load_pages)
        m.prefetch_bandwidth.extend(load_gbps)
        m.backup_pgs.extend(save_pages)
        m.backup_bandwidth.extend(save_gbps)
        return m

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _server_args() -> dict[str, Any] | None:
    """SGLang's resolved launch arguments, published in the scheduler process that builds the
    backend; None where they were not (a backend built outside a server)."""
    try:
        from sglang.srt.runtime_context import get_context

        args: dict[str, Any] = get_context().resolved_server_args_dict()
    except (ImportError, ValueError):
        return None
    return args


def _prefix(extra_info: HiCacheStorageExtraInfo | None) -> list[bytes] | None:
    if extra_info is None or extra_info.prefix_keys is None:
        return None
    return page_keys(extra_info.prefix_keys)
