"""`kvtier size`, hybrid models: per KV cache group what vLLM 0.32's hybrid KV cache manager
allocates (KV per token, state per request and per checkpoint), the block size vLLM picks for a
model with recurrent layers, and what a sliding window actually saves at a long context.

The arithmetic is `kvtier.core.sizing` (`kv_groups`, `hybrid_block_tokens`, `window_saving`);
this module reads the options and renders the section, in text and in `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import ConfigReading
from kvtier.core.layout import AttentionKind, KVLayout
from kvtier.core.sizing import (
    KERNEL_BLOCK_ALIGNMENT,
    cdiv,
    group_pages,
    hybrid_block_tokens,
    kv_groups,
    page_bytes,
    window_saving,
)
from kvtier.core.units import format_bytes

DEFAULT_CONTEXT = 131_072


def add_arguments(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("hybrid models (vLLM's hybrid KV cache manager)")
    h.add_argument(
        "--context",
        metavar="TOKENS",
        default=str(DEFAULT_CONTEXT),
        help=f"sequence length for 'what the window saves' ({DEFAULT_CONTEXT} = 128K)",
    )
    h.add_argument(
        "--mamba-cache-mode",
        choices=("align", "none"),
        default="align",
        help="vLLM's mamba_cache_mode: align (its default with prefix caching: the running "
        "state plus a block-boundary checkpoint, 2 pages per group) or none (1 page) (align)",
    )


def align_block(layout: KVLayout) -> tuple[KVLayout, str | None]:
    """The layout at the block size vLLM runs it with, and a line saying why when it differs."""
    tokens = hybrid_block_tokens(layout)
    if tokens == layout.block_tokens:
        return layout, None
    state = max(layout.layer_state_bytes(x) for x in layout.layers)
    attn = max(layout.layer_token_bytes(x) for x in layout.layers)
    a = max(KERNEL_BLOCK_ALIGNMENT, layout.block_tokens)
    note = (
        f"block size {layout.block_tokens} -> {tokens} tokens: vLLM makes an attention page "
        f"hold a state page, {a} x ceil({state:,} B / ({a} x {attn:,} B per token and layer)) "
        f"(platforms/interface.py _align_hybrid_block_size; kernel block {KERNEL_BLOCK_ALIGNMENT}"
        f", FlashAttention's); the state page is padded to {tokens * attn:,} B"
    )
    return dataclasses.replace(layout, block_tokens=tokens), note


def _context(a: argparse.Namespace) -> int:
    try:
        n = int(str(a.context).strip())
    except ValueError:
        raise UsageError(f"--context must be an integer, got {a.context!r}") from None
    if n < 1:
        raise UsageError(f"--context must be >= 1, got {n}")
    return n


def compute(
    layout: KVLayout, reading: ConfigReading | None, a: argparse.Namespace, block_note: str | None
) -> dict[str, Any]:
    """The `hybrid` object of `--json`: per-group figures and the window saving."""
    context = _context(a)
    state_pages = 2 if a.mamba_cache_mode == "align" else 1
    page = page_bytes(layout)
    groups = []
    for g in kv_groups(layout):
        recurrent = g.spec.kind is AttentionKind.RECURRENT
        groups.append(
            {
                "kind": g.spec.kind.value,
                "layer": g.spec.describe(),
                "layers": g.layers,
                "padding_layers": g.group_size - g.layers,
                "kv_bytes_per_token": g.layers * layout.layer_token_bytes(g.spec),
                "page_bytes": page,
                "pages_at_context": group_pages(layout, g.spec, context, 1, state_pages),
                "state_content_bytes": g.layers * layout.layer_state_bytes(g.spec),
                "state_bytes_per_checkpoint": page if recurrent else 0,
                "state_bytes_per_request": state_pages * page if recurrent else 0,
            }
        )
    saving = window_saving(layout, context)
    chunked = _chunked_saving(layout, reading, context) if reading else None
    return {
        "chunked_if_enabled": chunked,
        "config_rules": list(reading.rules) if reading else [],
        "chunked_layers": reading.chunked_layers if reading else 0,
        "chunk_size": reading.chunk_size if reading else 0,
        "block_note": block_note,
        "mamba_cache_mode": a.mamba_cache_mode,
        "groups": groups,
        "state_bytes_per_request": sum(g["state_bytes_per_request"] for g in groups),
        "state_bytes_per_checkpoint": sum(g["state_bytes_per_checkpoint"] for g in groups),
        "window": {
            "context_tokens": context,
            "all_full_bytes": saving.all_full_bytes,
            "hybrid_bytes": saving.hybrid_bytes,
            "hybrid_saving": round(saving.hybrid_saving, 6),
            "hybrid_off_bytes": saving.hybrid_off_bytes,
            "hybrid_off_saving": (
                None if saving.hybrid_off_saving is None else round(saving.hybrid_off_saving, 6)
            ),
            "layer_ratio": round(saving.layer_ratio, 6),
        },
    }


def _chunked_saving(
    layout: KVLayout, reading: ConfigReading, context: int
) -> dict[str, Any] | None:
    """Llama 4 with the hybrid manager allowed on (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_
    CACHE=1): a chunked-local layer holds at most ceil((chunk + 1) / B) pages in decode
    (`ChunkedLocalAttentionSpec.max_admission_blocks_per_request`), grouped like any other kind."""
    n, chunk = reading.chunked_layers, reading.chunk_size
    if not n or not chunk:
        return None
    full = layout.num_layers - n
    b = layout.block_tokens
    per_layer = layout.layer_token_bytes(layout.layers[0])
    counts = [c for c in (n, full) if c]
    small, large = min(counts), max(counts)
    size = large if large < small * 1.5 else small
    need = cdiv(context, b)
    held = min(need, cdiv(chunk + 1, b))
    groups_chunk, groups_full = cdiv(n, size), cdiv(full, size) if full else 0
    page = b * size * per_layer
    hybrid = (groups_full * need + groups_chunk * held) * page
    all_full = need * b * layout.num_layers * per_layer
    return {
        "pages_per_chunked_group": held,
        "chunked_groups": groups_chunk,
        "full_groups": groups_full,
        "hybrid_bytes": hybrid,
        "all_full_bytes": all_full,
        "saving": round(1 - hybrid / all_full, 6) if all_full else 0.0,
    }


def _b(n: int) -> str:
    return f"{n:,} B ({format_bytes(n)})"


def render(h: dict[str, Any], block_tokens: int) -> list[str]:
    """The text section for `compute`'s result (empty for a one-group model with no rule)."""
    lines: list[str] = []
    if h["config_rules"]:
        lines += ["", "config read as vLLM 0.32 does"]
        lines += [f"  {rule}" for rule in h["config_rules"]]
    if h["block_note"]:
        lines += ["", h["block_note"]]
    groups = h["groups"]
    w = h["window"]
    plain = not groups[0]["state_bytes_per_request"] and not w["layer_ratio"]
    if len(groups) == 1 and plain and not h["chunked_layers"]:
        return lines
    ctx = w["context_tokens"]
    lines += [
        "",
        f"KV cache groups (vLLM hybrid KV cache manager; page {_b(groups[0]['page_bytes'])}, "
        f"one group's layers x {block_tokens} tokens)",
    ]
    for g in groups:
        pad = f" + {g['padding_layers']} padding" if g["padding_layers"] else ""
        head = f"  {g['layer']:<30} {g['layers']:>3} layers{pad}"
        if g["kind"] == "recurrent":
            lines.append(
                f"{head}: state {_b(g['state_content_bytes'])}, per checkpoint (1 page) "
                f"{_b(g['state_bytes_per_checkpoint'])}, per request "
                f"({h['mamba_cache_mode']}) {_b(g['state_bytes_per_request'])}"
            )
        else:
            lines.append(
                f"{head}: KV {g['kv_bytes_per_token']:,} B/token, "
                f"{g['pages_at_context']:,} pages at {ctx:,} tokens"
            )
    if h["state_bytes_per_request"]:
        lines.append(
            f"  state per request {_b(h['state_bytes_per_request'])}, per checkpoint "
            f"{_b(h['state_bytes_per_checkpoint'])} (every recurrent group's page); with the "
            "hybrid manager off vLLM refuses to start"
        )
    if h["chunked_layers"]:
        lines.append(
            f"  {h['chunked_layers']} chunked-local layers ({h['chunk_size']} tokens) counted as "
            "full: vLLM keeps its hybrid manager off for them unless "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1"
        )
    c = h.get("chunked_if_enabled")
    if c:
        lines.append(
            f"  with it on: {c['chunked_groups']} chunked groups of {c['pages_per_chunked_group']}"
            f" pages + {c['full_groups']} full group(s) at {w['context_tokens']:,} tokens = "
            f"{_b(c['hybrid_bytes'])} instead of {_b(c['all_full_bytes'])}, saves "
            f"{c['saving']:.1%}"
        )
    if not w["layer_ratio"]:
        return lines
    off = (
        "vLLM refuses to start (recurrent layers need the hybrid manager)"
        if w["hybrid_off_bytes"] is None
        else f"{_b(w['hybrid_off_bytes'])}, saves {w['hybrid_off_saving']:.1%}"
    )
    lines += [
        f"what the window saves at {ctx:,} tokens (one sequence, attention KV, one rank)",
        f"  every layer full length   {_b(w['all_full_bytes'])}",
        f"  hybrid manager on         {_b(w['hybrid_bytes'])}, saves {w['hybrid_saving']:.1%} "
        f"(at most {w['layer_ratio']:.1%} = sliding / attention layers)",
        f"  hybrid manager off        {off}",
    ]
    return lines
