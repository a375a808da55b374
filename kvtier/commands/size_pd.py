"""`kvtier size --pd`: prefill/decode disaggregation, the KV a request moves and the link that
keeps the move off the critical path.

Per request, the decode instance needs every full-attention (and MLA) layer's KV of the whole
prompt, a sliding layer's last `window` tokens and recurrent layers' state:

    bytes = P x (full-layer bytes per token) + min(P, W) x (sliding bytes per token) + state

Each TP rank sends its own share over its own NIC, so per rank (b = one rank's bytes per token):

    transfer = P x b / link            prefill = P x FLOPs per token / F     (one rank's share)
    hidden when transfer <= prefill  <=>  link >= b x F / FLOPs per token

so the prompt length cancels except through attention's share of the FLOPs (averaged over the
prompt here). F: the prefill rate (the planner's, or `--gpu` peak x MFU for the table).

Through kvtier (`kvtier_moves`) the KV moves in whole blocks of `--block-tokens`: the producer
stores the prompt's P // B full blocks, the consumer loads (P - 1) // B of them (it computes the
prompt's last token itself), each one rank's block; across nodes each stored block also goes to
the remote store with its 64-byte header. These are the daemons' counters for one request
(`kvtier_moved_bytes_total`, `kvtier_remote_bytes_total`), exactly.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.core.costmodel import CostModel
from kvtier.core.errors import UsageError
from kvtier.core.layout import AttentionKind, DType, KVLayout
from kvtier.core.presets import ModelSpec, get_preset, list_presets
from kvtier.tiers.blockfmt import HEADER_SIZE

MFU = 0.6
"""Prefill model-FLOP utilization assumed for the GPU table (the planner's default uses it too:
kvtier.daemon.rates.book DEFAULT_PREFILL_FLOPS_PER_S)."""
GPUS: dict[str, float] = {
    "A100": 312e12,
    "L40S": 362.05e12,
    "H100": 989.4e12,
    "H200": 989.4e12,
    "B200": 2250e12,
}
"""Dense bf16 tensor peak per GPU, FLOP/s (NVIDIA datasheets; B200 = half the 4.5 PF sparse)."""
GPU_SOURCES: dict[str, str] = {
    "A100": "A100 SXM datasheet: BF16 tensor 312 TFLOPS dense",
    "L40S": "L40S datasheet: BF16 tensor 362.05 TFLOPS dense (733 with sparsity)",
    "H100": "H100 SXM datasheet: BF16 tensor 1,979 TFLOPS with sparsity / 2",
    "H200": "H200 SXM datasheet: BF16 tensor 1,979 TFLOPS with sparsity / 2 (H100's compute)",
    "B200": "HGX B200 datasheet: FP16/BF16 tensor 4.5 PFLOPS with sparsity per GPU / 2",
}
"""Where each `GPUS` figure comes from (printed with the table)."""
LINKS: dict[str, float] = {
    "25 Gb/s": 25e9 / 8,
    "100 Gb/s": 100e9 / 8,
    "200 Gb/s": 200e9 / 8,
    "400 Gb/s": 400e9 / 8,
    "NVLink 4": 450e9,
}
"""Per-GPU link bandwidth one way, bytes/s (NICs at line rate; NVLink 4 = 900 GB/s both ways)."""
LINK_SOURCES: dict[str, str] = {
    "25 Gb/s": "Ethernet line rate / 8 bits, one way, no protocol overhead",
    "100 Gb/s": "Ethernet/InfiniBand EDR line rate / 8 bits, one way",
    "200 Gb/s": "Ethernet/InfiniBand HDR line rate / 8 bits, one way",
    "400 Gb/s": "Ethernet/InfiniBand NDR line rate / 8 bits, one way",
    "NVLink 4": "H100 SXM datasheet: NVLink 900 GB/s per GPU both ways / 2",
}
"""Where each `LINKS` figure comes from (printed with the table)."""
MFU_SOURCE = "assumed, as the planner's default prefill rate (kvtier.daemon.rates)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("prefill/decode disaggregation (--pd)")
    d.add_argument(
        "--pd",
        action="store_true",
        help="KV bytes a request moves from prefill to decode and the link that hides it, for "
        "this model and for the presets on common GPUs",
    )


def request_bytes(layout: KVLayout, prompt: int) -> tuple[int, str]:
    """One rank's bytes for one request of `prompt` tokens, and the formula."""
    parts, total = [], 0
    for spec, n in layout.kinds().items():
        per = layout.layer_token_bytes(spec) * n
        if spec.kind is AttentionKind.RECURRENT:
            state = layout.layer_state_bytes(spec) * n
            total += state
            parts.append(f"{state:,} B state")
        elif spec.kind is AttentionKind.SLIDING:
            kept = min(prompt, spec.window)
            total += kept * per
            parts.append(f"min({prompt:,}, {spec.window}) x {per:,} B")
        else:
            total += prompt * per
            parts.append(f"{prompt:,} x {per:,} B")
    return total, " + ".join(parts)


def kvtier_moves(layout: KVLayout, prompt: int) -> dict[str, int]:
    """What kvtier's vLLM connector moves for one request of `prompt` tokens on one rank (the
    module docstring): blocks and bytes the producer stores, the consumer loads, and the
    remote store is sent and read across nodes."""
    bt, block = layout.block_tokens, layout.block_bytes()
    stored, loaded = prompt // bt, max(0, prompt - 1) // bt
    return {"block_tokens": bt, "block_bytes": block,
            "stored_blocks": stored, "stored_bytes": stored * block,
            "loaded_blocks": loaded, "loaded_bytes": loaded * block,
            "remote_write_bytes": stored * (block + HEADER_SIZE),
            "remote_read_bytes": loaded * block}


def hide_bandwidth(layout: KVLayout, cost: CostModel, prompt: int, flops_per_s: float) -> float:
    """Bytes/s one rank's link needs so the transfer takes no longer than the prefill."""
    moved, _ = request_bytes(layout, prompt)
    prefill_s = float(cost.prefill_flops(0, prompt)) / flops_per_s
    return moved / prefill_s


def _links_ok(bw: float) -> list[str]:
    return [name for name, rate in LINKS.items() if rate >= bw]


def compute(
    spec: ModelSpec, layout: KVLayout, prompt: int, flops_per_s: float, flops_source: str
) -> dict[str, Any]:
    cost = CostModel.from_spec(spec, tp=layout.tp_size, dtype=layout.dtype)
    moved, formula = request_bytes(layout, prompt)
    bw = hide_bandwidth(layout, cost, prompt, flops_per_s)
    table = []
    for name in list_presets():
        m = get_preset(name)
        try:
            lay = m.layout(dtype=DType.BF16)
        except UsageError:
            continue
        c = CostModel.from_spec(m)
        row: dict[str, Any] = {"model": name, "gbps": {}, "hidden_by": {}}
        for gpu, peak in GPUS.items():
            need = hide_bandwidth(lay, c, prompt, peak * MFU)
            row["gbps"][gpu] = need * 8 / 1e9
            row["hidden_by"][gpu] = _links_ok(need)
        table.append(row)
    return {
        "prompt_tokens": prompt,
        "bytes_per_request_rank": moved,
        "bytes_per_request_total": moved * layout.tp_size,
        "bytes_formula": formula,
        "kvtier": kvtier_moves(layout, prompt),
        "prefill_s": float(cost.prefill_flops(0, prompt)) / flops_per_s,
        "prefill_flops": float(cost.prefill_flops(0, prompt)),
        "flops_per_s": flops_per_s,
        "flops_source": flops_source,
        "hide_bytes_per_s": bw,
        "hide_gbps": bw * 8 / 1e9,
        "hidden_by": _links_ok(bw),
        "links": {k: v * 8 / 1e9 for k, v in LINKS.items()},
        "link_sources": dict(LINK_SOURCES),
        "mfu": MFU,
        "mfu_source": MFU_SOURCE,
        "gpus_tflops": {k: v / 1e12 for k, v in GPUS.items()},
        "gpu_sources": dict(GPU_SOURCES),
        "table": table,
    }


def render(d: dict[str, Any]) -> list[str]:
    p = d["prompt_tokens"]
    lines = [
        "",
        f"prefill/decode disaggregation ({p:,}-token prompt)",
        f"  KV moved per request, one rank  {d['bytes_per_request_rank']:,} B = "
        f"{d['bytes_formula']}  (all ranks {d['bytes_per_request_total']:,} B)",
        "  through kvtier, one rank        stored {stored_blocks:,} blocks = {stored_bytes:,} B, "
        "loaded {loaded_blocks:,} = {loaded_bytes:,} B ({block_tokens}-token blocks of "
        "{block_bytes:,} B); across nodes the remote store is sent {remote_write_bytes:,} B "
        "(64-byte headers) and read {remote_read_bytes:,} B".format(**d["kvtier"]),
        f"  prefill on one rank             {d['prefill_s'] * 1e3:.3f} ms = "
        f"{d['prefill_flops']:.4g} FLOPs / {d['flops_per_s']:.4g} FLOP/s  [{d['flops_source']}]",
        f"  link per rank that hides it     {d['hide_gbps']:.1f} Gb/s = bytes / prefill seconds "
        f"(the prompt cancels but for attention's FLOPs); hidden by: "
        + (", ".join(d["hidden_by"]) or "none of " + ", ".join(d["links"])),
        f"  presets on common GPUs (bf16, TP 1, {d['mfu']:.0%} of dense bf16 peak: "
        + ", ".join(f"{g} {t:g}" for g, t in d["gpus_tflops"].items())
        + " TFLOP/s): Gb/s per GPU needed / the slowest link that hides it",
        "    " + f"{'model':<16}" + "".join(f"{g:>16}" for g in d["gpus_tflops"]),
    ]
    for row in d["table"]:
        cells = ""
        for gpu, need in row["gbps"].items():
            ok = row["hidden_by"][gpu]
            cell = f"{need:.1f} / {ok[0].removesuffix(' Gb/s') if ok else 'none'}"
            cells += f"{cell:>16}"
        lines.append(f"    {row['model']:<16}{cells}")
    lines.append(f"  where the table's figures come from: MFU {d['mfu']:.0%} [{d['mfu_source']}]")
    for gpu, tflops in d["gpus_tflops"].items():
        lines.append(f"    {gpu:<9} {tflops:g} TFLOP/s  [{d['gpu_sources'][gpu]}]")
    for link, gbps in d["links"].items():
        lines.append(f"    {link:<9} {gbps * 1e9 / 8:.4g} B/s  [{d['link_sources'][link]}]")
    return lines
