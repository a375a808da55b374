"""Quantized KV: bytes per token with scales, by scale layout. Pure.

One rank, one layer with h KV heads of dimension d, e = bytes per quantized element (fp8 and
int8: 1), s = bytes per scale, B = tokens per block:

    layout              K + V bytes per token                       where the scales live
    per-tensor          2 x h x d x e                               2 per layer, outside the cache
    per-token           2 x h x (d x e + s)                         one per token, head and K/V
    per-channel         2 x h x d x e + 2 x h x d x s / B           one per channel and block
    k-channel-v-token   2 x h x d x e + h x d x s / B + h x s       keys per channel, values per
                                                                   token (KIVI's choice)

MLA latents (width r + rope, no heads) follow the same rows with h = 1 and one vector instead of
two. vLLM 0.32 ships per-tensor (`fp8`, scales k_scale/v_scale per layer) and per-token-head
(`int8_per_token_head`, `fp8_per_token_head`: an fp32 scale inline after each head's K and V,
`v1/attention/backends/triton_attn.py`), so s = 4 there; per-channel keys are not in vLLM.

Per-channel bookkeeping: a channel's scale is set over a block's tokens, so a block is quantized
only once it is full. Until then the sequence keeps its partly filled block unquantized: up to
(B - 1) x h x d x 2 B per layer and per-channel side (keys; values too under per-channel) (bf16)
per sequence. A full block's scales are frozen
(prefix caching shares it; appending never touches it); a partly filled shared block must be
copied before a sample appends to it, as its scales would change under the other readers.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from kvtier.core.errors import UsageError
from kvtier.core.layout import AttentionKind, KVLayout

RESIDUAL_BYTES = 2
"""bf16: the unquantized keys of a partly filled block under per-channel scales."""


class ScaleLayout(enum.Enum):
    PER_TENSOR = "per-tensor"
    PER_TOKEN = "per-token"
    PER_CHANNEL = "per-channel"
    K_CHANNEL_V_TOKEN = "k-channel-v-token"

    @classmethod
    def parse(cls, text: str) -> ScaleLayout:
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(x.value for x in cls)
            raise UsageError(f"unknown scale layout {text!r} (choose from {names})") from None


class QuantBytes(NamedTuple):
    """Per token on one rank, summed over the attention layers (recurrent state excluded)."""

    data_bytes: float
    scale_bytes: float
    bf16_bytes: int
    residual_bytes_per_sequence: int
    formula: str

    @property
    def total_bytes(self) -> float:
        return self.data_bytes + self.scale_bytes

    @property
    def ratio(self) -> float:
        return self.total_bytes / self.bf16_bytes if self.bf16_bytes else 0.0


def quantized_bytes(
    layout: KVLayout, scales: ScaleLayout, elem_bytes: int = 1, scale_bytes: int = 4
) -> QuantBytes:
    if elem_bytes < 1 or scale_bytes < 1:
        raise UsageError("element and scale sizes must be >= 1 byte")
    b = layout.block_tokens
    data = scale = 0.0
    bf16 = residual = 0
    parts = []
    for spec, n in layout.kinds().items():
        if spec.kind is AttentionKind.RECURRENT:
            continue
        if spec.kind is AttentionKind.MLA:
            h, d, vectors = 1, spec.kv_lora_rank + spec.rope_dim, 1
        else:
            h, d, vectors = layout.kv_heads_per_rank, layout.head_dim, 2
        data += n * vectors * h * d * elem_bytes
        bf16 += n * vectors * h * d * 2
        per_token = {
            ScaleLayout.PER_TENSOR: 0.0,
            ScaleLayout.PER_TOKEN: vectors * h * scale_bytes,
            ScaleLayout.PER_CHANNEL: vectors * h * d * scale_bytes / b,
            ScaleLayout.K_CHANNEL_V_TOKEN: h * d * scale_bytes / b
            + (vectors - 1) * h * scale_bytes,
        }[scales]
        scale += n * per_token
        if scales is ScaleLayout.PER_CHANNEL:
            residual += n * vectors * (b - 1) * h * d * RESIDUAL_BYTES
        elif scales is ScaleLayout.K_CHANNEL_V_TOKEN:
            residual += n * (b - 1) * h * d * RESIDUAL_BYTES
        rows = {
            ScaleLayout.PER_TENSOR: f"{vectors} x {h} x {d} x {elem_bytes} B",
            ScaleLayout.PER_TOKEN: f"{vectors} x {h} x ({d} x {elem_bytes} + {scale_bytes}) B",
            ScaleLayout.PER_CHANNEL: f"{vectors} x {h} x {d} x ({elem_bytes} + {scale_bytes} / "
            f"{b}) B",
            ScaleLayout.K_CHANNEL_V_TOKEN: f"{vectors} x {h} x {d} x {elem_bytes} + {h} x {d} x "
            f"{scale_bytes} / {b} + {vectors - 1} x {h} x {scale_bytes} B",
        }
        parts.append(f"{n} {spec.describe()} layers x ({rows[scales]})")
    return QuantBytes(data, scale, bf16, residual, " + ".join(parts) or "0")
