"""Frozen configuration of the reference engine's model (no torch import here).

The weights are a pure function of the config (including `seed`), so two processes built from equal
configs compute bit-identical KV. `model_id()` names that function for kvtier's key namespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace

from kvtier.core.errors import UsageError

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Decoder-only transformer shape: GQA attention with RoPE, RMSNorm, SwiGLU MLP.

    `block_tokens` is both the KV pool's page size and the prefill chunk size (see runner.py for why
    they must be equal). `max_positions` bounds prompt + generated tokens of one sequence.
    """

    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128
    block_tokens: int = 16
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim",
                     "mlp_hidden", "block_tokens", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise UsageError(
                f"model config: heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise UsageError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise UsageError(f"model config: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise UsageError("model config: rope_theta and norm_eps must be positive")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers: 2 · layers · kv_heads · head_dim · dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self) -> int:
        return self.kv_bytes_per_token() * self.block_tokens

    def matmul_params(self) -> int:
        """Parameters touched per prefill token by matmuls (projections and MLPs; no embedding,
        no LM head: prefill applies it to the last token only) — the planner's P."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.mlp_hidden)

    def num_parameters(self) -> int:
        """Parameters excluding the embedding table (the lm_head is counted)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.mlp_hidden
        norms = 2 * self.hidden
        return self.layers * (attn + mlp + norms) + self.hidden + self.hidden * self.vocab_size

    def model_id(self) -> str:
        """Stable name of the weights: changes whenever any field (hence any weight) changes."""
        canon = ",".join(f"{k}={v!r}" for k, v in sorted(asdict(self).items()))
        return "kvtier-reference-" + hashlib.sha256(canon.encode()).hexdigest()[:16]

    def with_dtype(self, dtype: str) -> ModelConfig:
        return replace(self, dtype=dtype)


PRESETS: dict[str, ModelConfig] = {
    # Unit and end-to-end tests: a few ms per chunk on one core.
    "tiny": ModelConfig(),
    # `kvtier demo`: large enough that prefill time is visible, small enough to start at once.
    "demo": ModelConfig(
        vocab_size=2048, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32,
        mlp_hidden=768, block_tokens=16, max_positions=8192,
    ),
    # bench/e2e.py: CPU prefill of 8K tokens takes >= 1 s on dev-2c (~3 s on one core; the
    # bench measures and prints it). 2 KiB of KV per token, 32 KiB per block.
    "bench": ModelConfig(
        vocab_size=4096, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
        mlp_hidden=384, block_tokens=16, max_positions=16384,
    ),
}


def get_config(name: str) -> ModelConfig:
    """A reference model by name (any case, as `kvtier size --preset` reads its presets)."""
    try:
        return PRESETS[name.strip().lower()]
    except KeyError:
        pass
    from kvtier.core.presets import list_presets

    if name.strip().lower() in (p.lower() for p in list_presets()):
        raise UsageError(
            f"{name!r} is a model `kvtier size` and `kvtier simulate` size; the demo runs one of "
            f"its own small reference models on the CPU ({', '.join(sorted(PRESETS))}), with "
            "random weights (to measure a real model, run it in vLLM with the kvtier connector)"
        )
    raise UsageError(
        f"unknown engine model {name!r}; choose one of {', '.join(sorted(PRESETS))}"
    )
