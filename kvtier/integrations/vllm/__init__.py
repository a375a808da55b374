"""vLLM's KV connector for kvtier: `kv_connector_module_path="kvtier.integrations.vllm"`,
`kv_connector="KvtierConnector"` (see `connector.py` and README "Using kvtier with vLLM")."""

from kvtier.integrations.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]
