"""The KV cache layout of one model on one tensor-parallel rank: a pure, frozen spec.

A `KVLayout` says what one engine rank stores per token and per block, layer by layer:

    kind        stored per token and layer (one rank)                  kept
    FULL        K and V: 2 · kv_heads_on_rank · head_dim · elem (+scales)  every token
    SLIDING     same as FULL                                           the last `window` tokens
    MLA         one latent: (kv_lora_rank + rope_dim) · elem (+scale)  every token, on every rank
    RECURRENT   nothing per token                                      `state_bytes` per sequence

Tensor parallelism splits KV heads across ranks: a rank holds kv_heads / min(tp, kv_heads) heads;
when tp exceeds the KV head count every head is replicated tp / kv_heads times. That needs
kv_heads % tp == 0 (tp <= kv_heads) or tp % kv_heads == 0 (tp > kv_heads); anything else is a
`UsageError`. MLA latents are not split (vLLM keeps the full latent on every rank).

Contracts for consumers:
- `bytes_per_token_stored()` / `block_bytes_stored()` are what kvtier's host tiers hold for
  the whole TP group: one copy of each distinct shard (replicas are stored once).
- `bytes_per_token()` / `block_bytes()` are per rank and cover every attention layer, windowed ones
  included (a kvtier block carries the block's tokens for all layers); recurrent state is
  per sequence (`state_bytes_per_sequence()`) and is never part of a block.
- `fingerprint()` is 32 bytes, a SHA-256 over a canonical encoding with `FORMAT_VERSION`; it is
  equal across processes, machines and Python versions for equal layouts and differs whenever a
  stored byte would be laid out differently (dtype, scales, block tokens, any layer, heads on
  this rank, head dim, TP size or rank). Every block key's root seed includes it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.errors import UsageError

FORMAT_VERSION = 1
"""Bump when the fingerprint encoding or the meaning of a field changes."""


class AttentionKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    RECURRENT = "recurrent"


class DType(enum.Enum):
    """KV element type; `.itemsize` is bytes per element. FP8 is e4m3 (vLLM's "fp8"); INT8 is
    vLLM's int8 KV (`int8_per_token_head`)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"

    @property
    def quantized(self) -> bool:
        """One byte per element with scales (fp8, int8)."""
        return self in (DType.FP8, DType.INT8)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, text: str) -> DType:
        key = text.strip().lower()
        key = _DTYPE_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(d.value for d in cls)
            raise UsageError(f"unknown dtype {text!r} (choose from {names})") from None


_ITEMSIZE = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2, DType.FP8: 1, DType.INT8: 1}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8",
}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's cache kind. Build with the class methods; fields unused by a kind stay 0.

    `state_bytes` (RECURRENT) is the whole layer's state for one sequence, all ranks together;
    it is split across ranks like KV heads over `state_heads` heads.
    """

    kind: AttentionKind
    window: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    state_bytes: int = 0
    state_heads: int = 1

    @classmethod
    def full(cls) -> LayerSpec:
        return cls(AttentionKind.FULL)

    @classmethod
    def sliding(cls, window: int) -> LayerSpec:
        return cls(AttentionKind.SLIDING, window=window)

    @classmethod
    def mla(cls, kv_lora_rank: int, rope_dim: int) -> LayerSpec:
        return cls(AttentionKind.MLA, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)

    @classmethod
    def recurrent(cls, state_bytes: int, state_heads: int = 1) -> LayerSpec:
        return cls(AttentionKind.RECURRENT, state_bytes=state_bytes, state_heads=state_heads)

    def __post_init__(self) -> None:
        _positive_or_zero("window", self.window)
        _positive_or_zero("kv_lora_rank", self.kv_lora_rank)
        _positive_or_zero("rope_dim", self.rope_dim)
        _positive_or_zero("state_bytes", self.state_bytes)
        _positive("state_heads", self.state_heads)
        k = self.kind
        if k is AttentionKind.SLIDING and self.window < 1:
            raise UsageError("a sliding-window layer needs a window of at least 1 token")
        if k is not AttentionKind.SLIDING and self.window:
            raise UsageError(f"only sliding-window layers have a window ({k.value} has one)")
        if k is AttentionKind.MLA and self.kv_lora_rank < 1:
            raise UsageError("an MLA layer needs kv_lora_rank >= 1")
        if k is not AttentionKind.MLA and (self.kv_lora_rank or self.rope_dim):
            raise UsageError(f"kv_lora_rank/rope_dim are MLA fields ({k.value} layer has them)")
        if k is AttentionKind.RECURRENT:
            if self.state_bytes < 1:
                raise UsageError("a recurrent layer needs state_bytes >= 1")
            if self.state_bytes % self.state_heads:
                raise UsageError(
                    f"recurrent state_bytes {self.state_bytes} is not divisible by "
                    f"state_heads {self.state_heads}"
                )
        elif self.state_bytes or self.state_heads != 1:
            raise UsageError(f"state_bytes/state_heads are recurrent fields ({k.value} layer)")

    def describe(self) -> str:
        if self.kind is AttentionKind.SLIDING:
            return f"sliding(window={self.window})"
        if self.kind is AttentionKind.MLA:
            return f"mla(kv_lora_rank={self.kv_lora_rank}, rope={self.rope_dim})"
        if self.kind is AttentionKind.RECURRENT:
            return f"recurrent(state={self.state_bytes} B/seq)"
        return "full"

    def _canonical(self) -> list[object]:
        return [
            self.kind.value,
            self.window,
            self.kv_lora_rank,
            self.rope_dim,
            self.state_bytes,
            self.state_heads,
        ]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def _positive_or_zero(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{name} must be a non-negative integer, got {value!r}")


def shards(count: int, tp_size: int, what: str) -> int:
    """How many distinct shards `count` heads split into under `tp_size`; checks divisibility.

    tp <= count: each rank holds count / tp heads (count % tp must be 0).
    tp >  count: each rank holds one head, replicated tp / count times (tp % count must be 0).
    """
    if tp_size <= count:
        if count % tp_size:
            raise UsageError(f"TP size {tp_size} does not divide the {count} {what}")
        return tp_size
    if tp_size % count:
        raise UsageError(
            f"TP size {tp_size} exceeds the {count} {what} but is not a multiple of it "
            f"(heads cannot be replicated evenly)"
        )
    return count


@dataclass(frozen=True, slots=True)
class KVLayout:
    """KV cache layout of one TP rank. Construct, then query; all methods are pure.

    `num_kv_heads` is the model's total; `kv_heads_per_rank` is what this rank stores.
    `fp8_scale_bytes` is the scale stored with each K or V vector (per token, layer and KV head;
    per token and layer for MLA) when dtype is fp8; 0 means per-tensor scales kept outside the
    cache (vLLM's default). It must be 0 for other dtypes.
    """

    layers: tuple[LayerSpec, ...]
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    block_tokens: int = 16
    tp_size: int = 1
    tp_rank: int = 0
    fp8_scale_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise UsageError("a layout needs at least one layer")
        if not all(isinstance(x, LayerSpec) for x in self.layers):
            raise UsageError("layers must be LayerSpec values")
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        _positive("block_tokens", self.block_tokens)
        _positive("tp_size", self.tp_size)
        _positive_or_zero("tp_rank", self.tp_rank)
        _positive_or_zero("fp8_scale_bytes", self.fp8_scale_bytes)
        if not isinstance(self.dtype, DType):
            raise UsageError(f"dtype must be a DType, got {self.dtype!r}")
        if self.tp_rank >= self.tp_size:
            raise UsageError(f"TP rank {self.tp_rank} is out of range for TP size {self.tp_size}")
        if self.fp8_scale_bytes and not self.dtype.quantized:
            raise UsageError("scale bytes are only meaningful with dtype fp8 or int8")
        if self.has_head_layers:
            shards(self.num_kv_heads, self.tp_size, "KV heads")
        for layer in self.layers:
            if layer.kind is AttentionKind.RECURRENT:
                shards(layer.state_heads, self.tp_size, "recurrent state heads")

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: DType = DType.BF16,
        block_tokens: int = 16,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> KVLayout:
        """A model whose every layer is full attention (MHA/GQA/MQA)."""
        _positive("layers", num_layers)
        layers = (LayerSpec.full(),) * num_layers
        return cls(layers, num_kv_heads, head_dim, dtype, block_tokens, tp_size, tp_rank)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def has_head_layers(self) -> bool:
        return any(x.kind in (AttentionKind.FULL, AttentionKind.SLIDING) for x in self.layers)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this rank stores (0 when no layer has heads, e.g. pure MLA)."""
        if not self.has_head_layers:
            return 0
        return self.num_kv_heads // shards(self.num_kv_heads, self.tp_size, "KV heads")

    @property
    def kv_replication(self) -> int:
        """How many ranks hold each KV head (1 unless TP exceeds the KV head count).

        MLA latents and unsplit state are held by every rank: replication = tp_size.
        """
        if not self.has_head_layers:
            return self.tp_size
        return self.tp_size // shards(self.num_kv_heads, self.tp_size, "KV heads")

    @property
    def kv_copies(self) -> int:
        """Distinct copies of the KV across the TP group: tp_size / kv_replication (1 for MLA).

        A replicated shard is the same bytes on every rank that holds it, so kvtier keeps one
        copy of it (vLLM's connector: only the shard's first rank stores,
        `kvtier.integrations.vllm.layout.kv_shard`); host tiers hold `kv_copies` blocks per
        block of tokens, not `tp_size`.
        """
        return self.tp_size // self.kv_replication

    def layer_token_bytes(self, layer: LayerSpec) -> int:
        """Bytes one token occupies in `layer` on this rank (0 for recurrent layers)."""
        elem = self.dtype.itemsize
        if layer.kind is AttentionKind.MLA:
            return (layer.kv_lora_rank + layer.rope_dim) * elem + self.fp8_scale_bytes
        if layer.kind is AttentionKind.RECURRENT:
            return 0
        return 2 * self.kv_heads_per_rank * (self.head_dim * elem + self.fp8_scale_bytes)

    def layer_state_bytes(self, layer: LayerSpec) -> int:
        """Per-sequence state `layer` keeps on this rank (0 unless recurrent)."""
        if layer.kind is not AttentionKind.RECURRENT:
            return 0
        n = shards(layer.state_heads, self.tp_size, "recurrent state heads")
        return layer.state_bytes // n

    def bytes_per_token(self) -> int:
        """KV bytes one token adds on this rank, summed over all attention layers."""
        return sum(self.layer_token_bytes(x) for x in self.layers)

    def bytes_per_token_total(self) -> int:
        """KV bytes one token occupies across all `tp_size` ranks, replicas included.

        Every rank holds the same amount (heads split evenly), so this is tp_size × per rank.
        """
        return self.tp_size * self.bytes_per_token()

    def bytes_per_token_stored(self) -> int:
        """KV bytes one token occupies in kvtier's host tiers for the whole TP group: one copy
        of each distinct shard (`kv_copies` x per rank; replicas are stored once)."""
        return self.kv_copies * self.bytes_per_token()

    def block_bytes(self) -> int:
        """Bytes of one block (`block_tokens` tokens, all attention layers) on this rank."""
        return self.block_tokens * self.bytes_per_token()

    def block_bytes_total(self) -> int:
        return self.tp_size * self.block_bytes()

    def block_bytes_stored(self) -> int:
        """One block's bytes in kvtier's host tiers for the whole TP group (replicas once)."""
        return self.kv_copies * self.block_bytes()

    def state_bytes_per_sequence(self) -> int:
        """Recurrent state one sequence keeps on this rank, whatever its length."""
        return sum(self.layer_state_bytes(x) for x in self.layers)

    def kinds(self) -> dict[LayerSpec, int]:
        """Distinct layer specs and how many layers have each, in first-seen order."""
        out: dict[LayerSpec, int] = {}
        for layer in self.layers:
            out[layer] = out.get(layer, 0) + 1
        return out

    def canonical(self) -> bytes:
        """The canonical encoding hashed by `fingerprint` (compact JSON, fixed key order)."""
        doc = {
            "format": FORMAT_VERSION,
            "dtype": self.dtype.value,
            "elem_bytes": self.dtype.itemsize,
            "fp8_scale_bytes": self.fp8_scale_bytes,
            "block_tokens": self.block_tokens,
            "num_kv_heads": self.num_kv_heads,
            "kv_heads_on_rank": self.kv_heads_per_rank,
            "head_dim": self.head_dim,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "layers": [x._canonical() for x in self.layers],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")

    def fingerprint(self) -> bytes:
        """32-byte SHA-256 of `canonical()` under a domain tag; stable across processes."""
        return hashlib.sha256(b"kvtier-layout\x00" + self.canonical()).digest()

    def describe(self) -> str:
        """One line such as '32 layers [32 full], 8 KV heads (8 on rank) x 128, bf16, ...'."""
        parts = ", ".join(f"{n} {spec.describe()}" for spec, n in self.kinds().items())
        heads = (
            f"{self.num_kv_heads} KV heads ({self.kv_heads_per_rank} on rank) x {self.head_dim}, "
            if self.has_head_layers
            else ""
        )
        return (
            f"{self.num_layers} layers [{parts}], {heads}{self.dtype.value}, "
            f"{self.block_tokens}-token blocks, TP rank {self.tp_rank} of {self.tp_size}"
        )


def alternating(pattern: Sequence[LayerSpec], num_layers: int) -> tuple[LayerSpec, ...]:
    """`num_layers` layers repeating `pattern` (e.g. [sliding, full] for gpt-oss)."""
    _positive("layers", num_layers)
    if not pattern:
        raise UsageError("a layer pattern needs at least one layer")
    return tuple(pattern[i % len(pattern)] for i in range(num_layers))
