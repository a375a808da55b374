"""Test-only patches for SGLang on a CPU (see tests/sglang_shims/README.md), applied when the
patched module is first imported, so a process that never imports SGLang pays nothing."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _unpinned_host_pool(mod: ModuleType) -> None:
    init = mod.HostKVCache.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False  # cudaHostRegister needs a CUDA driver
        init(self, *args, **kwargs)

    mod.HostKVCache.__init__ = __init__
    # SGLang keeps 10 GiB of host RAM free beside any host pool; a shared test machine may not
    # have that much available at all (the tests' pools are a few MiB)
    mod.HICACHE_HOST_MEMORY_RESERVE_BYTES = 256 << 20


def _torch_direct_copy(mod: ModuleType) -> None:
    def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any],
                           src_indices: Any, dst_indices: Any, page_size: int) -> None:
        src, dst = src_indices.long(), dst_indices.long()
        for s, d in zip(src_layers, dst_layers, strict=True):
            d[dst] = s[src]

    mod.transfer_kv_direct = transfer_kv_direct


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _unpinned_host_pool,
    "sglang.srt.mem_cache.pool_host.mha": _torch_direct_copy,
}


class _Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, PATCHES[name]
        run = loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
        return spec


sys.meta_path.insert(0, _Patcher())
