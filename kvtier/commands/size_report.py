"""The human table of `kvtier size` (`render`), from the result dict of `size.compute`."""

from __future__ import annotations

from typing import Any

from kvtier.commands.size_gpu import render as render_gpu
from kvtier.commands.size_hybrid import render as render_hybrid
from kvtier.commands.size_overload import render as render_overload
from kvtier.commands.size_pd import render as render_pd
from kvtier.commands.size_quant import render as render_quant
from kvtier.commands.size_samples import render as render_samples
from kvtier.commands.size_tiers import render as render_tiers
from kvtier.core.units import format_bytes


def _b(n: int) -> str:
    return f"{n:,} B ({format_bytes(n)})"


def render(r: dict[str, Any]) -> str:
    """The human table for `compute`'s result."""
    m, tp = r["model"], r["tp_size"]
    yes = {True: "yes", False: "NO"}
    lines = [
        f"model        {m['name']}  ({m['source']})",
        f"layout       {m['layers']}",
        f"fingerprint  {r['fingerprint']}",
        "",
        "KV per token",
        f"  per rank   {_b(r['kv_bytes_per_token'])} = {r['kv_formula']}",
        f"  all ranks  {_b(r['kv_bytes_per_token_total'])} = TP {tp} x per rank (GPU memory)",
        f"  in kvtier  {_b(r['kv_bytes_per_token_stored'])} = {r['stored_note']}",
        f"KV per block ({r['block_tokens']} tokens)",
        f"  per rank   {_b(r['block_bytes'])} = {r['block_tokens']} tokens x per-token bytes",
        f"  all ranks  {_b(r['block_bytes_total'])}",
        f"  in kvtier  {_b(r['block_bytes_stored'])}",
    ]
    if r["state_bytes_per_sequence"]:
        lines.append(f"recurrent state per sequence (rank): {_b(r['state_bytes_per_sequence'])}")
    if r["quantized"]:
        lines += render_quant(r["quantized"])
    lines += render_hybrid(r["hybrid"], r["block_tokens"])
    lines += [
        "",
        "GPU pool (one rank)",
        f"  device memory        {_b(r['gpu_bytes'])}  [{r['gpu_bytes_unit']}]",
        f"  x utilization {r['gpu_util']:<6g} {_b(r['gpu_budget_bytes'])}",
        f"  - weights            {_b(r['weights_bytes'])}  [{r['weights_note']}]",
        *render_gpu(r["gpu_memory"], f"  - other reserved     {_b(r['reserved_bytes'])}"),
        f"  = usable KV          {_b(r['usable_kv_bytes'])}"
        + ("  (weights do not fit)" if r["usable_kv_bytes"] < 0 else ""),
        f"  page                 {_b(r['page_bytes'])}",
        f"  usable pages         {r['pool_pages']:,} = floor(usable / page)",
        "",
        f"workload     {r['concurrency']} requests x ({r['prompt_tokens']} prompt + "
        f"{r['max_output_tokens']} output tokens), prefill chunk "
        + (f"{r['prefill_chunk']} tokens" if r["prefill_chunk"] else "= whole prompt"),
        f"                    per sequence   x {r['concurrency']:<8} fits in {r['pool_pages']:,}?",
        f"  at admission      {r['admission_pages_per_seq']:<14,} {r['admission_pages']:<10,} "
        f"{yes[r['admission_fits']]}",
        f"  at full growth    {r['full_growth_pages_per_seq']:<14,} {r['full_growth_pages']:<10,} "
        f"{yes[r['full_growth_fits']]}",
        "  pages per sequence by KV-cache group (admission / full growth):",
    ]
    for g in r["kv_groups"]:
        lines.append(
            f"    {g['layer']:<34} {g['layers']:>3} layers (group of {g['group_size']}): "
            f"{g['admission_pages_per_seq']} / {g['full_growth_pages_per_seq']}"
        )
    lines += [
        f"  (ceil per sequence; ceil on the summed tokens would claim "
        f"{r['full_growth_pages_if_summed']:,} pages at full growth)",
        f"  concurrency ceiling at full length: {r['concurrency_ceiling']:,} "
        f"= floor({r['pool_pages']:,} / {r['full_growth_pages_per_seq']:,})",
        f"  pages left at {r['max_seqs']} sequences: {r['pages_left_at_max_seqs']:,}",
    ]
    if r["dram"] or r["ssd"]:
        lines.append("")
    for name in ("dram", "ssd"):
        t = r[name]
        if t:
            lines += [
                f"{name.upper()} tier     {t['unit']}",
                f"  holds {t['blocks']:,} blocks of {format_bytes(r['block_bytes'])} (one rank's "
                f"layout) = {t['tokens']:,} tokens of the whole model (TP {tp}"
                + (", replicated KV stored once)" if r["kv_copies_stored"] < tp else ")"),
            ]
    if r["tiers"]:
        lines += render_tiers(r["tiers"])
    if r["pd"]:
        lines += render_pd(r["pd"])
    if r["overload"]:
        lines += render_overload(r["overload"])
    if r["samples"]:
        lines += render_samples(r["samples"], r["block_tokens"])
    return "\n".join(lines)
