"""`kvtier size --dtype fp8|int8 --scale-layout ...`: quantized KV bytes with their scales.
The arithmetic is `kvtier.core.kvquant`."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.commands.flags import whole
from kvtier.core.errors import UsageError
from kvtier.core.kvquant import ScaleLayout, quantized_bytes
from kvtier.core.layout import KVLayout

QUANTIZED = ("fp8", "int8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    q = p.add_argument_group("quantized KV (--dtype fp8 or int8)")
    q.add_argument(
        "--scale-layout",
        metavar="LAYOUT",
        help="where the scales live: per-tensor (vLLM's fp8), per-token (vLLM's "
        "*_per_token_head), per-channel, or k-channel-v-token (keys per channel, values per "
        "token) (default: per-tensor)",
    )
    q.add_argument(
        "--scale-bytes",
        metavar="N",
        default="4",
        help="bytes per scale (4 = fp32, as vLLM stores them) (4)",
    )


def compute(layout: KVLayout, a: argparse.Namespace) -> dict[str, Any] | None:
    dtype = str(a.dtype).strip().lower()
    if a.scale_layout is None and dtype not in QUANTIZED:
        return None
    if dtype not in QUANTIZED and dtype != "fp8_e4m3":
        raise UsageError(f"--scale-layout needs --dtype fp8 or int8, not {a.dtype}")
    scales = ScaleLayout.parse(a.scale_layout or "per-tensor")
    sb = whole(a.scale_bytes, "--scale-bytes", 1)
    q = quantized_bytes(layout, scales, 1, sb)
    return {
        "dtype": "int8" if dtype == "int8" else "fp8",
        "scale_layout": scales.value,
        "scale_bytes": sb,
        "data_bytes_per_token": q.data_bytes,
        "scale_bytes_per_token": q.scale_bytes,
        "bytes_per_token": q.total_bytes,
        "bf16_bytes_per_token": q.bf16_bytes,
        "ratio_to_bf16": round(q.ratio, 6),
        "formula": q.formula,
        "residual_bytes_per_sequence": q.residual_bytes_per_sequence,
        "in_pages": scales in (ScaleLayout.PER_TENSOR, ScaleLayout.PER_TOKEN),
    }


def render(q: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"quantized KV ({q['dtype']}, {q['scale_layout']} scales of {q['scale_bytes']} B, "
        "one rank)",
        f"  per token   {q['bytes_per_token']:,.2f} B = {q['data_bytes_per_token']:,.0f} B data "
        f"+ {q['scale_bytes_per_token']:,.2f} B scales = {q['formula']}",
        f"              {q['ratio_to_bf16']:.1%} of bf16's {q['bf16_bytes_per_token']:,} B",
    ]
    if q["scale_layout"] == "per-tensor":
        lines.append("  scales      2 per layer (k_scale, v_scale), outside the cache")
    if not q["in_pages"]:
        lines += [
            f"  bookkeeping a channel's scale covers a block: keys are quantized when their "
            f"block fills; until then each sequence keeps its partly filled block unquantized, "
            f"up to {q['residual_bytes_per_sequence']:,} B (bf16); full blocks' scales are "
            "frozen (shared by prefix caching, never re-scaled by an append); a shared partly "
            "filled block is copied before a sample appends to it",
            "  (per-channel scales are not in vLLM 0.32 and not in the page figures above)",
        ]
    return lines
