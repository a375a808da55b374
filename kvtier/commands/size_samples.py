"""`kvtier size --samples N`: parallel sampling's pages with and without sharing the prompt.
The arithmetic is `kvtier.core.sizing.parallel_sampling`."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.commands.flags import whole
from kvtier.core.layout import KVLayout
from kvtier.core.sizing import page_bytes, parallel_sampling
from kvtier.core.units import format_bytes

FADE = 0.10
"""The saving below which sharing is said to have all but disappeared."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("parallel sampling (--samples)")
    s.add_argument(
        "--samples",
        metavar="N",
        help="completions per prompt (vLLM's n): pages with and without sharing the prompt",
    )


def _fade_output(layout: KVLayout, prompt: int, n: int, state_pages: int) -> int | None:
    """The smallest output length at which the saving drops below FADE (None: never, or from
    the start)."""
    if parallel_sampling(layout, prompt, 0, n, state_pages).saving < FADE:
        return None
    hi = 1
    while parallel_sampling(layout, prompt, hi, n, state_pages).saving >= FADE:
        hi *= 2
        if hi > 1 << 30:
            return None
    lo = hi // 2
    while lo < hi:
        mid = (lo + hi) // 2
        if parallel_sampling(layout, prompt, mid, n, state_pages).saving < FADE:
            hi = mid
        else:
            lo = mid + 1
    return lo


def compute(
    layout: KVLayout, prompt: int, output: int, a: argparse.Namespace, state_pages: int
) -> dict[str, Any] | None:
    if a.samples is None:
        return None
    n = whole(a.samples, "--samples", 1)
    s = parallel_sampling(layout, prompt, output, n, state_pages)
    page = page_bytes(layout)
    return {
        "samples": n,
        "prompt_tokens": prompt,
        "max_output_tokens": output,
        "page_bytes": page,
        "unshared_pages": s.unshared_pages,
        "shared_pages": s.shared_pages,
        "shared_blocks": s.shared_blocks,
        "saving": round(s.saving, 6),
        "recomputed_tokens_per_sample": s.recomputed_tokens,
        "cow_shared_blocks": s.cow_shared_blocks,
        "cow_pages": s.cow_pages,
        "cow_copies": s.cow_copies,
        "cow_copy_bytes": s.cow_copies * layout.block_bytes(),
        "prompt_remainder_tokens": prompt % layout.block_tokens,
        "saving_below_10pct_from_output": _fade_output(layout, prompt, n, state_pages),
    }


def render(s: dict[str, Any], block_tokens: int) -> list[str]:
    n, p, o = s["samples"], s["prompt_tokens"], s["max_output_tokens"]
    per = s["unshared_pages"] // n
    r = s["prompt_remainder_tokens"]
    lines = [
        "",
        f"parallel sampling: {n} samples of a {p:,}-token prompt + {o:,} output tokens "
        f"(pages of {format_bytes(s['page_bytes'])}, one rank)",
        f"  no sharing               {n} x {per:,} = {s['unshared_pages']:,} pages",
        f"  vLLM v1 prefix caching   {s['shared_blocks']:,} shared = floor(({p:,} - 1) / "
        f"{block_tokens}), {s['shared_pages']:,} pages, saves {s['saving']:.1%}; each sample "
        f"keeps its own last prompt block and recomputes {s['recomputed_tokens_per_sample']} "
        "tokens of it (a hit stops at prompt - 1)",
        f"  copy-on-write engine     {s['cow_shared_blocks']:,} shared = floor({p:,} / "
        f"{block_tokens}), {s['cow_pages']:,} pages; "
        + (
            f"the prompt leaves {r} tokens in a shared part-filled block: each sample's first "
            f"decode token copies it, {s['cow_copies']} copies x "
            f"{format_bytes(s['cow_copy_bytes'] // max(1, s['cow_copies']))} = "
            f"{format_bytes(s['cow_copy_bytes'])}"
            if r
            else "the prompt ends on a block boundary: no copy fires"
        ),
    ]
    fade = s["saving_below_10pct_from_output"]
    lines.append(
        f"  the saving falls below {FADE:.0%} from {fade:,} output tokens on (outputs much longer "
        "than the prompt)"
        if fade is not None
        else f"  the saving is below {FADE:.0%} whatever the output length"
    )
    return lines
