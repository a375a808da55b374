"""The kvtier layout of a vLLM engine's KV: one kvtier block = one vLLM block of every attention
layer, the layers' pages back to back in `layer_names` order.

    slot: | layer 0 page (page_bytes) | layer 1 page | ... | layer L-1 page |

A page is one block of one layer in vLLM's standardized per-layer view `kv[block]` ([B, H, N, C],
blocks at dim 0), in its logical element order whatever the physical layout (LBHNC, ...): the
fingerprint names everything that shapes those bytes (dtype, block size, heads on this rank,
head size, page bytes, the platform — cpu, cuda — whose backends define [H, N, C], the TP
shard), so engines whose pages differ never share blocks.

Tensor parallel: with `kv_heads` KV heads over TP size t, rank r holds heads of shard
r * min(t, kv_heads) // t of min(t, kv_heads) shards; beyond kv_heads ranks (and for MLA, whose
latent cache every rank holds whole) shards are replicated, so the blocks of a shard are stored
once, by its first rank (`saves`), and loaded by all of its ranks. Pure; no vLLM import.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.client.decl import LayoutDecl, ModelCost

FORMAT = "kvtier-vllm-v1"


class Shard(NamedTuple):
    number: int
    of: int
    saves: bool
    """This rank is the first of its shard: it stores the shard's blocks."""


def kv_shard(tp_size: int, rank: int, total_kv_heads: int, replicated: bool = False) -> Shard:
    """Which copy of the KV rank `rank` of `tp_size` holds (see the module docstring)."""
    if tp_size < 1 or not 0 <= rank < tp_size or total_kv_heads < 1:
        raise ValueError(f"bad TP rank {rank} of {tp_size} with {total_kv_heads} KV heads")
    shards = 1 if replicated else min(tp_size, total_kv_heads)
    index = rank * shards // tp_size
    first = -(-index * tp_size // shards)  # the lowest rank r with r * shards // tp == index
    return Shard(index, shards, rank == first)


@dataclass(frozen=True, slots=True)
class EngineKV:
    """What shapes one vLLM block's bytes on one rank."""

    model_id: str
    dtype: str
    block_tokens: int
    layer_names: tuple[str, ...]
    page_bytes: int
    kv_heads: int
    """KV heads on this rank (vLLM's spec)."""
    head_size: int
    backend: str
    """The platform whose attention backends define the page's [H, N, C] view ("cpu", "cuda";
    "mla-" prefixed for MLA), part of the fingerprint."""
    shard: Shard
    cost: ModelCost | None = None
    key_width: int = 32
    """Bytes of vLLM's block hashes: 32 (sha256, sha256_cbor) or 16 (xxhash, xxhash_cbor)."""

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * len(self.layer_names)

    def layer_offset(self, i: int) -> int:
        return i * self.page_bytes

    def describe(self) -> str:
        """Everything the fingerprint covers, readable (the layer names by digest)."""
        layers = hashlib.sha256("\0".join(self.layer_names).encode()).hexdigest()[:16]
        return (f"{FORMAT}/{self.dtype}/bt{self.block_tokens}/L{len(self.layer_names)}:{layers}"
                f"/kvh{self.kv_heads}/hd{self.head_size}/page{self.page_bytes}/{self.backend}"
                f"/shard{self.shard.number}of{self.shard.of}/key{self.key_width}")

    def fingerprint(self) -> bytes:
        """The daemon's layout fingerprint (8..64 bytes): a digest of `describe()`."""
        return f"{FORMAT}:".encode() + hashlib.sha256(self.describe().encode()).digest()[:24]

    def decl(self) -> LayoutDecl:
        return LayoutDecl(self.fingerprint(), self.block_bytes, self.block_tokens,
                          self.key_width, model=self.cost, model_id=self.model_id)

    def for_shard(self, shard: Shard) -> EngineKV:
        return EngineKV(self.model_id, self.dtype, self.block_tokens, self.layer_names,
                        self.page_bytes, self.kv_heads, self.head_size, self.backend, shard,
                        self.cost, self.key_width)


class Unsupported(ValueError):
    """The engine's KV cannot be kept by kvtier (the connector then runs as a no-op)."""


def default_model_id(model_config: Any, load_config: Any, seed: Any) -> str:
    """Whose KV the engine computes, following its weights (`identity.default_model_id`)."""
    from kvtier.integrations.vllm import identity

    return identity.default_model_id(model_config, load_config, seed)


def model_cost(hf_config: Any) -> ModelCost | None:
    """The planner's cost parameters from the model's Hugging Face config, if it parses."""
    from kvtier.core.hfconfig import spec_from_config

    try:
        spec = spec_from_config(hf_config.to_dict())
    except Exception:
        return None
    return ModelCost(active_params=float(spec.active_params), num_layers=spec.num_layers,
                     attn_dim=spec.d_attn)


def engine_kv(vllm_config: Any, kv_cache_config: Any, rank: int, model_id: str) -> EngineKV:
    """The layout of this engine's KV on TP rank `rank`, from vLLM's KV cache config (the same
    on the scheduler and on every worker). Raises `Unsupported` for what kvtier cannot hold:
    several KV cache groups (hybrid models), non-attention layers, unequal pages."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise Unsupported(f"{len(groups)} KV cache groups (hybrid attention) are not supported")
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if not hasattr(spec, attr):
            raise Unsupported(f"KV cache spec {type(spec).__name__} has no {attr}")
    if getattr(spec, "sliding_window", None):
        raise Unsupported("sliding-window attention is not supported")
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    is_mla = bool(getattr(mc, "use_mla", False))
    total_heads = int(mc.get_total_num_kv_heads())
    shard = kv_shard(int(pc.tensor_parallel_size), rank, max(total_heads, 1), replicated=is_mla)
    from vllm.platforms import current_platform

    return EngineKV(
        model_id=model_id,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_tokens=int(spec.block_size),
        layer_names=tuple(groups[0].layer_names),
        page_bytes=int(spec.page_size_bytes),
        kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        backend=("mla-" if is_mla else "") + str(current_platform.device_type),
        shard=shard,
        cost=model_cost(mc.hf_config),
        key_width=hash_width(str(vllm_config.cache_config.prefix_caching_hash_algo)),
    )


def hash_width(algo: str) -> int:
    """Digest bytes of vLLM's prefix-caching hash `algo`."""
    return 16 if algo.startswith("xxhash") else 32
