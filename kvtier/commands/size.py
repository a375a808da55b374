"""`kvtier size`: KV bytes, GPU pool pages, workload fit and host-tier capacity for a model.

Flags are read as text and validated here, so every bad value is one `UsageError` line (exit 2).
The arithmetic lives in `kvtier.core.layout` and `kvtier.core.sizing`; this module builds the
inputs and renders the answer as a table (`size_report.render`) or (`--json`) one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from kvtier.commands import (
    size_gpu,
    size_hybrid,
    size_overload,
    size_pd,
    size_quant,
    size_rates,
    size_samples,
    size_tiers,
)
from kvtier.commands.flags import alias, whole
from kvtier.commands.size_report import render
from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import ConfigReading, parse_config, read_config
from kvtier.core.layout import DType, KVLayout, LayerSpec, alternating
from kvtier.core.presets import ModelSpec, get_preset, list_presets
from kvtier.core.sizing import (
    GpuPool,
    Workload,
    group_pages,
    kv_groups,
    page_bytes,
    plan_workload,
    tier_capacity,
)
from kvtier.core.units import Size, parse_size
from kvtier.core.weightquant import weight_bytes

HELP = "KV bytes per token/block, GPU pool pages, workload fit and host-tier capacity"

MAX_LAYERS = 10_000

_SHAPE_FLAGS = (
    "layers",
    "kv_heads",
    "head_dim",
    "attention_heads",
    "layer_pattern",
    "window",
    "kv_lora_rank",
    "rope_dim",
    "state_bytes",
    "state_heads",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = textwrap.fill(
        "Sizes take units: 80GB = 80e9 B, 16GiB = 16 x 2^30 B, a plain number is bytes "
        "(55.54e9). Pages follow vLLM v1's paged pool: ceil per sequence and per KV-cache group; "
        "a sliding window caps only its own layers. Presets: " + ", ".join(list_presets()) + ".",
        width=78,
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter

    def one_line_error(message: str) -> None:
        p.exit(2, f"kvtier size: error: {message} (see kvtier size --help)\n")

    p.error = one_line_error  # type: ignore[method-assign,assignment]
    m = p.add_argument_group("model (one of --preset, --hf-config, or the shape flags)")
    m.add_argument("--preset", metavar="NAME", help="a built-in model (see --list-presets)")
    m.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    m.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a local Hugging Face config.json, or a model directory holding one",
    )
    m.add_argument("--layers", metavar="N", help="custom model: number of layers")
    m.add_argument("--kv-heads", metavar="N", help="custom model: KV heads (MHA/GQA/MQA)")
    m.add_argument("--head-dim", metavar="N", help="custom model: head dimension")
    m.add_argument(
        "--attention-heads", metavar="N", help="custom model: query heads (default: --kv-heads)"
    )
    m.add_argument(
        "--layer-pattern",
        metavar="KINDS",
        help="custom model: comma list of full|sliding|mla|recurrent repeated over the layers "
        "(default: full; mla when --kv-lora-rank is given), e.g. sliding,full",
    )
    m.add_argument("--window", metavar="TOKENS", help="custom model: sliding-window size")
    m.add_argument("--kv-lora-rank", metavar="N", help="custom model: MLA latent dimension")
    m.add_argument("--rope-dim", metavar="N", help="custom model: MLA decoupled RoPE dimension")
    m.add_argument(
        "--state-bytes", metavar="SIZE", help="custom model: recurrent state per layer and sequence"
    )
    m.add_argument(
        "--state-heads",
        metavar="N",
        help="custom model: heads the recurrent state splits into under TP (default 1)",
    )
    m.add_argument(
        "--params", metavar="COUNT", help="total parameters (custom model, or override a preset)"
    )
    k = p.add_argument_group("KV layout")
    k.add_argument(
        "--dtype", default="bf16", help="KV dtype: fp32, bf16, fp16, fp8, int8 (default bf16)"
    )
    k.add_argument(
        "--fp8-scale-bytes",
        metavar="N",
        default="0",
        help="fp8 only: scale bytes stored with each K or V vector (per token, layer, KV head); "
        "0 = per-tensor scales outside the cache (default 0)",
    )
    k.add_argument("--block-tokens", metavar="N", default="16", help="tokens per block (16)")
    k.add_argument("--tp", metavar="N", default="1", help="tensor-parallel size (default 1)")
    k.add_argument("--tp-rank", metavar="N", default="0", help="rank to describe (default 0)")
    g = p.add_argument_group("GPU pool (one rank)")
    g.add_argument("--gpu-bytes", metavar="SIZE", default="80GiB", help="device memory (80GiB)")
    g.add_argument(
        "--gpu-util", metavar="FRACTION", default="0.9", help="share for the engine, (0,1] (0.9)"
    )
    g.add_argument(
        "--weights",
        metavar="SIZE",
        help="weight bytes on one rank (default: params x --weight-bytes-per-param / TP)",
    )
    g.add_argument(
        "--weight-bytes-per-param",
        metavar="B",
        help="bytes per weight for the default (2 = bf16; ~0.53 for MXFP4 experts) (default: "
        "2, or what an --hf-config's quantization_config stores)",
    )
    g.add_argument(
        "--reserved",
        metavar="SIZE",
        help="other memory held on the rank: activations, CUDA graphs, non-torch buffers "
        "(default: estimated, see the GPU memory options)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", metavar="N", default="64", help="concurrent requests (64)")
    w.add_argument("--prompt-tokens", metavar="N", default="2048", help="prompt length (2048)")
    w.add_argument(
        "--max-output-tokens", metavar="N", default="512", help="max generated tokens (512)"
    )
    w.add_argument(
        "--prefill-chunk",
        metavar="N",
        default="0",
        help="tokens per prefill step (vLLM max_num_batched_tokens); 0 = whole prompt (0)",
    )
    w.add_argument(
        "--max-seqs", metavar="N", help="concurrency cap for 'pages left' (default: --concurrency)"
    )
    h = p.add_argument_group("host tiers")
    h.add_argument("--dram-bytes", dest="dram", metavar="SIZE", help="DRAM tier size, e.g. 256GiB")
    h.add_argument("--ssd-bytes", dest="ssd", metavar="SIZE", help="SSD tier size, e.g. 4TB")
    alias(g, "--gpu-mem", "--gpu-bytes", "gpu_bytes")
    alias(h, "--dram", "--dram-bytes", "dram")
    alias(h, "--ssd", "--ssd-bytes", "ssd")
    size_gpu.add_arguments(p)
    size_hybrid.add_arguments(p)
    size_tiers.add_arguments(p)
    size_pd.add_arguments(p)
    size_rates.add_arguments(p)
    size_samples.add_arguments(p)
    size_quant.add_arguments(p)
    size_overload.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _count(value: str | None, flag: str, minimum: int = 0) -> int:
    if value is None:
        raise UsageError(f"this model needs {flag}")
    return whole(value, flag, minimum)


def _param_count(value: str) -> int:
    try:
        d = Decimal(value.strip())
    except InvalidOperation:
        raise UsageError(f"--params must be a number such as 8.03e9, got {value!r}") from None
    if not d.is_finite() or d < 0 or d != d.to_integral_value():
        raise UsageError(f"--params must be a non-negative whole count, got {value!r}")
    return int(d)


def _fraction(value: str, flag: str, low_open: float, high: float) -> float:
    try:
        x = float(value)
    except ValueError:
        raise UsageError(f"{flag} must be a number, got {value!r}") from None
    if not math.isfinite(x) or not low_open < x <= high:
        raise UsageError(f"{flag} must be in ({low_open:g}, {high:g}], got {value}")
    return x


def _custom_model(a: argparse.Namespace) -> ModelSpec:
    pattern_text = a.layer_pattern or ("mla" if a.kv_lora_rank is not None else "full")
    kinds = [k.strip().lower() for k in pattern_text.split(",")]
    pattern: list[LayerSpec] = []
    for kind in kinds:
        if kind == "full":
            pattern.append(LayerSpec.full())
        elif kind == "sliding":
            pattern.append(LayerSpec.sliding(_count(a.window, "--window", 1)))
        elif kind == "mla":
            rank = _count(a.kv_lora_rank, "--kv-lora-rank", 1)
            pattern.append(LayerSpec.mla(rank, _count(a.rope_dim or "0", "--rope-dim")))
        elif kind == "recurrent":
            if a.state_bytes is None:
                raise UsageError("recurrent layers need --state-bytes")
            state = parse_size(a.state_bytes, "--state-bytes").bytes
            heads = _count(a.state_heads or "1", "--state-heads", 1)
            pattern.append(LayerSpec.recurrent(state, heads))
        else:
            raise UsageError(f"--layer-pattern: unknown kind {kind!r} (full|sliding|mla|recurrent)")
    num_layers = _count(a.layers, "--layers", 1)
    if num_layers > MAX_LAYERS:
        raise UsageError(f"--layers {num_layers} is implausible (limit {MAX_LAYERS})")
    layers = alternating(pattern, num_layers)
    has_heads = any(k in ("full", "sliding") for k in kinds)
    kv_heads = _count(a.kv_heads, "--kv-heads", 1) if has_heads else 1
    head_dim = _count(a.head_dim, "--head-dim", 1) if has_heads or a.head_dim else 1
    heads = _count(a.attention_heads or str(kv_heads), "--attention-heads", 1)
    params = _param_count(a.params) if a.params is not None else 0
    return ModelSpec(
        name="custom",
        hf_repo="",
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layers=layers,
        total_params=params,
        active_params=params,
        vocab_size=0,
    )


def _model(a: argparse.Namespace) -> tuple[ModelSpec, str, ConfigReading | None]:
    shape = [f for f in _SHAPE_FLAGS if getattr(a, f) is not None]
    reading: ConfigReading | None = None
    sources = [s for s, given in (("--preset", a.preset), ("--hf-config", a.hf_config)) if given]
    if shape:
        sources.append("--" + shape[0].replace("_", "-"))
    if len(sources) > 1:
        raise UsageError(f"give one model source, not {' and '.join(sources)}")
    if a.preset is not None:
        spec, source = get_preset(a.preset), f"preset {a.preset}"
    elif a.hf_config is not None:
        reading = read_hf_reading(a.hf_config)
        spec, source = reading.spec, f"HF config {a.hf_config}"
    elif shape:
        spec, source = _custom_model(a), "flags"
    else:
        raise UsageError("no model: give --preset NAME, --hf-config PATH or --layers/--kv-heads")
    if a.params is not None and not shape:
        n = _param_count(a.params)
        spec = ModelSpec(**{**_fields(spec), "total_params": n, "active_params": n})
    return spec, source, reading


def _fields(spec: ModelSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in ModelSpec.__slots__}


def _kv_formula(layout: KVLayout) -> str:
    e, s = layout.dtype.itemsize, layout.fp8_scale_bytes
    parts = []
    for spec, n in layout.kinds().items():
        what = f"{n} {spec.describe()} layers"
        if spec.kind.value in ("full", "sliding"):
            vec = f"({layout.head_dim} x {e} + {s} B)" if s else f"{layout.head_dim} x {e} B"
            parts.append(f"2 x {what} x {layout.kv_heads_per_rank} heads x {vec}")
        elif spec.kind.value == "mla":
            lat = f"({spec.kv_lora_rank} + {spec.rope_dim}) x {e} B"
            parts.append(f"{what} x ({lat} + {s} B)" if s else f"{what} x {lat}")
    return " + ".join(parts) or "0 (no attention layers)"


def stored_note(layout: KVLayout) -> str:
    """How kvtier's host tiers count this layout's KV across the TP group, in words."""
    tp, rep, copies = layout.tp_size, layout.kv_replication, layout.kv_copies
    if rep == 1:
        return f"TP {tp} x per rank: each rank holds its own shard"
    if not layout.has_head_layers:
        return (f"1 x per rank: all {tp} ranks hold the same latent (MLA); kvtier stores it "
                "once (one rank saves it)")
    return (f"{copies} shards x per rank: each KV-head shard is on {rep} ranks; kvtier stores "
            "it once (vLLM connector: its first rank saves; SGLang stores every rank's)")


def compute(a: argparse.Namespace) -> dict[str, Any]:
    """The whole answer as a JSON-ready dict (the `--json` output)."""
    spec, source, reading = _model(a)
    dtype = DType.parse(a.dtype)
    tp = _count(a.tp, "--tp", 1)
    scale_bytes = _count(a.fp8_scale_bytes, "--fp8-scale-bytes", 0)
    per_token = a.scale_layout is not None and a.scale_layout.strip().lower() == "per-token"
    if per_token and dtype.quantized:
        scale_bytes = scale_bytes or _count(a.scale_bytes, "--scale-bytes", 1)
    layout = spec.layout(
        dtype=dtype,
        block_tokens=_count(a.block_tokens, "--block-tokens", 1),
        tp_size=tp,
        tp_rank=_count(a.tp_rank, "--tp-rank", 0),
        fp8_scale_bytes=scale_bytes,
    )
    layout, block_note = size_hybrid.align_block(layout)
    device = parse_size(a.gpu_bytes, "--gpu-bytes")
    if a.weights is not None:
        weights = parse_size(a.weights, "--weights").bytes
        weights_note = f"--weights {a.weights}"
    elif (a.weight_bytes_per_param is None and a.params is None and reading is not None
          and reading.quantization is not None):
        quant = weight_bytes(reading.quantization, reading.params, a.hf_config)
        weights = math.ceil(quant.bytes / tp)
        weights_note = f"{quant.note}, / TP {tp}"
    else:
        per = _fraction(a.weight_bytes_per_param or "2", "--weight-bytes-per-param", 0.0, 8.0)
        weights = math.ceil(spec.total_params * per / tp)
        weights_note = f"{spec.total_params:,} params x {per:g} B / TP {tp}"
        if spec.total_params == 0:
            weights_note = "0: parameter count unknown (give --params or --weights)"
    overheads = size_gpu.estimate(
        spec,
        tp,
        device.bytes,
        _count(a.prefill_chunk, "--prefill-chunk", 0),
        a,
        reading.model_type if reading else "",
    )
    reserved = (
        parse_size(a.reserved, "--reserved").bytes
        if a.reserved is not None
        else overheads.in_request_bytes
    )
    pool = GpuPool(
        device.bytes, _fraction(a.gpu_util, "--gpu-util", 0.0, 1.0), weights, reserved
    )
    page = page_bytes(layout)
    pool_pages = max(0, pool.usable_bytes) // page if page else 0
    concurrency = _count(a.concurrency, "--concurrency", 1)
    load = Workload(
        concurrency,
        _count(a.prompt_tokens, "--prompt-tokens", 1),
        _count(a.max_output_tokens, "--max-output-tokens", 0),
        _count(a.prefill_chunk, "--prefill-chunk", 0),
        _count(a.max_seqs, "--max-seqs", 1) if a.max_seqs is not None else concurrency,
    )
    state_pages = 2 if a.mamba_cache_mode == "align" else 1
    plan = plan_workload(layout, pool_pages, load, state_pages)
    full_len = load.prompt_tokens + load.max_output_tokens
    groups = [
        {
            "kind": g.spec.kind.value,
            "layer": g.spec.describe(),
            "layers": g.layers,
            "group_size": g.group_size,
            "admission_pages_per_seq": group_pages(
                layout, g.spec, load.prompt_tokens, load.admission_in_flight, state_pages
            ),
            "full_growth_pages_per_seq": group_pages(layout, g.spec, full_len, 1, state_pages),
        }
        for g in kv_groups(layout)
    ]
    tiers = {}
    ssd_size = parse_size(a.ssd, "--ssd-bytes") if a.ssd is not None else None
    for name, text in (("dram", a.dram), ("ssd", a.ssd)):
        size: Size | None = parse_size(text, f"--{name}-bytes") if text is not None else None
        cap = tier_capacity(layout, size.bytes) if size else None
        tiers[name] = (
            {
                "bytes": cap.capacity_bytes,
                "unit": size.explain(),
                "blocks": cap.blocks,
                "tokens": cap.tokens,
            }
            if cap and size
            else None
        )
    return {
        "model": {
            "name": spec.name,
            "source": source,
            "hf_repo": spec.hf_repo,
            "layers": layout.describe(),
            "num_layers": spec.num_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_kv_heads": spec.num_kv_heads,
            "kv_heads_per_rank": layout.kv_heads_per_rank,
            "head_dim": spec.head_dim,
            "total_params": spec.total_params,
            "active_params": spec.active_params,
        },
        "dtype": dtype.value,
        "fp8_scale_bytes": layout.fp8_scale_bytes,
        "block_tokens": layout.block_tokens,
        "tp_size": layout.tp_size,
        "tp_rank": layout.tp_rank,
        "fingerprint": layout.fingerprint().hex(),
        "kv_formula": _kv_formula(layout),
        "kv_bytes_per_token": layout.bytes_per_token(),
        "kv_bytes_per_token_total": layout.bytes_per_token_total(),
        "block_bytes": layout.block_bytes(),
        "block_bytes_total": layout.block_bytes_total(),
        "kv_copies_stored": layout.kv_copies,
        "kv_bytes_per_token_stored": layout.bytes_per_token_stored(),
        "block_bytes_stored": layout.block_bytes_stored(),
        "stored_note": stored_note(layout),
        "state_bytes_per_sequence": layout.state_bytes_per_sequence(),
        "page_bytes": page,
        "kv_groups": groups,
        "gpu_bytes": pool.device_bytes,
        "gpu_bytes_unit": f"{a.gpu_bytes}: "
        + (f"{device.unit} = {device.meaning}" if device.unit else device.meaning),
        "gpu_util": pool.utilization,
        "gpu_budget_bytes": pool.budget_bytes,
        "weights_bytes": pool.weights_bytes,
        "weights_note": weights_note,
        "reserved_bytes": pool.reserved_bytes,
        "gpu_memory": size_gpu.to_json(
            overheads, pool.budget_bytes, pool.device_bytes, a.reserved is not None
        ),
        "usable_kv_bytes": pool.usable_bytes,
        "pool_pages": pool_pages,
        "concurrency": load.concurrency,
        "prompt_tokens": load.prompt_tokens,
        "max_output_tokens": load.max_output_tokens,
        "prefill_chunk": load.prefill_chunk,
        "max_seqs": load.concurrency_cap,
        "admission_pages_per_seq": plan.admission_pages_per_seq,
        "full_growth_pages_per_seq": plan.full_pages_per_seq,
        "admission_pages": plan.admission_pages,
        "full_growth_pages": plan.full_growth_pages,
        "full_growth_pages_if_summed": plan.full_pages_if_summed,
        "admission_fits": plan.admission_fits,
        "full_growth_fits": plan.full_growth_fits,
        "concurrency_ceiling": plan.concurrency_ceiling,
        "pages_left_at_max_seqs": plan.pages_left_at_cap,
        "dram": tiers["dram"],
        "ssd": tiers["ssd"],
        "hybrid": size_hybrid.compute(layout, reading, a, block_note),
        "tiers": size_tiers.compute(
            spec,
            layout,
            load.prompt_tokens,
            ssd_size.bytes if ssd_size else None,
            a,
        )
        if a.tiers
        else None,
        "pd": _pd(spec, layout, load.prompt_tokens, a) if a.pd else None,
        "quantized": size_quant.compute(layout, a),
        "overload": _overload(spec, layout, pool.weights_bytes, load, a),
        "samples": size_samples.compute(
            layout, load.prompt_tokens, load.max_output_tokens, a, state_pages
        ),
    }


def _overload(
    spec: ModelSpec, layout: KVLayout, weights: int, load: Workload, a: argparse.Namespace
) -> dict[str, Any] | None:
    if a.overload is None:
        return None
    rates, sources = size_rates.planner_rates(a)
    return size_overload.compute(
        spec,
        layout,
        weights,
        load.concurrency,
        load.prompt_tokens,
        load.max_output_tokens,
        load.prefill_chunk,
        rates,
        sources,
        a,
    )


def _pd(spec: ModelSpec, layout: KVLayout, prompt: int, a: argparse.Namespace) -> dict[str, Any]:
    rates, sources = size_rates.planner_rates(a)
    return size_pd.compute(spec, layout, prompt, rates["prefill_flops_per_s"], sources["prefill"])


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        for name in list_presets():
            s = get_preset(name)
            print(
                f"{name:<16} {s.hf_repo:<30} {s.total_params / 1e9:7.2f}B total "
                f"{s.active_params / 1e9:7.2f}B active"
            )
        return 0
    result = compute(args)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def read_hf_config(path: str | Path) -> ModelSpec:
    """The `ModelSpec` of a local `config.json` or model directory (see `read_hf_reading`)."""
    return read_hf_reading(path).spec


def read_hf_reading(path: str | Path) -> ConfigReading:
    """A local `config.json`, or a model directory holding one, read the vLLM way (offline;
    named by its folder when the config has no `_name_or_path`)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise UsageError(f"model directory {str(path)!r} has no config.json")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read config {str(p)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"config {str(p)!r} is not UTF-8 text") from None
    return read_config(parse_config(text, str(p)), str(p), p.resolve().parent.name)
