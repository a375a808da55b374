"""kvtier: a multi-tier (GPU HBM / host DRAM / SSD) KV cache service for LLM inference.

The public face, one place for each name a user needs:

    from kvtier import Client, LayoutDecl, block_keys

Names are loaded on first use, so `import kvtier` stays light (the daemon and the pure layers
never pull in the client's gRPC stack, nor a client the daemon's storage libraries). Everything
else lives in the layer folders (`kvtier.core`, `kvtier.index`, `kvtier.tiers`, `kvtier.daemon`,
`kvtier.client`, `kvtier.gpu`, ...), see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier._version import __version__

_EXPORTS: dict[str, str] = {
    # talking to a daemon
    "Client": "kvtier.client.sync_client",
    "AsyncClient": "kvtier.client.async_client",
    "Control": "kvtier.client.control",
    "LayoutDecl": "kvtier.client.decl",
    "ModelCost": "kvtier.client.decl",
    "Lookup": "kvtier.client.sync_client",
    "Loaded": "kvtier.client.sync_client",
    "Stored": "kvtier.client.sync_client",
    "KvtierRpcError": "kvtier.client.sync_client",
    "KvtierUnavailable": "kvtier.client.sync_client",
    # naming blocks
    "block_keys": "kvtier.core.keys",
    "span_keys": "kvtier.core.keys",
    "KeyScheme": "kvtier.core.keys",
    "Extras": "kvtier.core.keys",
    "MMItem": "kvtier.core.keys",
    "root_seed": "kvtier.core.keys",
    "layout_id": "kvtier.core.keys",
    # describing a model's KV
    "KVLayout": "kvtier.core.layout",
    "LayerSpec": "kvtier.core.layout",
    "DType": "kvtier.core.layout",
    "ModelSpec": "kvtier.core.presets",
    "get_preset": "kvtier.core.presets",
    # moving blocks between the DRAM slots and an engine's paged pool
    "TransferEngine": "kvtier.gpu.transfer",
    "KVPool": "kvtier.gpu.transfer",
    "TransferJob": "kvtier.gpu.transfer",
    # errors
    "KvtierError": "kvtier.core.errors",
    "UsageError": "kvtier.core.errors",
}

__all__ = [
    "AsyncClient",
    "Client",
    "Control",
    "DType",
    "Extras",
    "KVLayout",
    "KVPool",
    "KeyScheme",
    "KvtierError",
    "KvtierRpcError",
    "KvtierUnavailable",
    "LayerSpec",
    "LayoutDecl",
    "Loaded",
    "Lookup",
    "MMItem",
    "ModelCost",
    "ModelSpec",
    "Stored",
    "TransferEngine",
    "TransferJob",
    "UsageError",
    "__version__",
    "block_keys",
    "get_preset",
    "layout_id",
    "root_seed",
    "span_keys",
]

if TYPE_CHECKING:
    from kvtier.client.async_client import AsyncClient
    from kvtier.client.control import Control
    from kvtier.client.decl import LayoutDecl, ModelCost
    from kvtier.client.sync_client import (
        Client,
        KvtierRpcError,
        KvtierUnavailable,
        Loaded,
        Lookup,
        Stored,
    )
    from kvtier.core.errors import KvtierError, UsageError
    from kvtier.core.keys import (
        Extras,
        KeyScheme,
        MMItem,
        block_keys,
        layout_id,
        root_seed,
        span_keys,
    )
    from kvtier.core.layout import DType, KVLayout, LayerSpec
    from kvtier.core.presets import ModelSpec, get_preset
    from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
