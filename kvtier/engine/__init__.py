"""The reference engine: a small decoder-only transformer (GQA, RoPE, RMSNorm, SwiGLU) with random
weights from a seed, a paged KV pool, chunked prefill from a cached prefix, and decode.

Requires torch (the `torch` extra). `kvtier.engine.kvtier_adapter` connects it to a kvtier daemon.
"""

from kvtier.engine.config import PRESETS, ModelConfig, get_config
from kvtier.engine.kvpool import KVPool, PoolExhausted
from kvtier.engine.model import Transformer
from kvtier.engine.runner import Engine, PrefillResult, Sequence

__all__ = [
    "PRESETS",
    "Engine",
    "KVPool",
    "ModelConfig",
    "PoolExhausted",
    "PrefillResult",
    "Sequence",
    "Transformer",
    "get_config",
]
