"""vLLM's KV connector for kvtier: `kv_connector_module_path="kvtier.integrations.vllm"`,
`kv_connector="KvtierConnector"` (see `connector.py` and docs/vllm.md).

The connector class is imported on first access, so the pure modules here (settings, layout)
import without vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
