"""`kvtier size`: every GPU gigabyte of one rank beside weights and KV.

The estimates and their sources are `kvtier.core.gpumem`; this module reads the options, builds
the `gpu_memory` object of `--json` and renders its lines under the GPU pool.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.commands.flags import whole
from kvtier.core import gpumem
from kvtier.core.presets import ModelSpec
from kvtier.core.units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU memory beside weights and KV (vLLM 0.32's start-up profile)")
    g.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        help="vLLM's per-step token budget, sizing the activation peak (default: --prefill-chunk "
        "when given, else vllm serve's default for the GPU: 16384 from 160 GiB, 8192 from 70 GiB, "
        "else 2048)",
    )
    g.add_argument(
        "--max-num-seqs",
        metavar="N",
        help="vLLM's max_num_seqs, sizing CUDA graphs and sampler logits (default: vllm serve's, "
        "1024 from 70 GiB, else 256)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (vLLM --enforce-eager)",
    )


def estimate(
    spec: ModelSpec,
    tp: int,
    device_bytes: int,
    prefill_chunk: int,
    a: argparse.Namespace,
    model_type: str = "",
) -> gpumem.Overheads:
    tokens, seqs = gpumem.vllm_serve_defaults(device_bytes)
    if a.max_num_batched_tokens is not None:
        tokens = whole(a.max_num_batched_tokens, "--max-num-batched-tokens", 1)
    elif prefill_chunk:
        tokens = prefill_chunk
    if a.max_num_seqs is not None:
        seqs = whole(a.max_num_seqs, "--max-num-seqs", 1)
    if not model_type and spec.hf_repo.startswith("openai/gpt-oss"):
        model_type = "gpt_oss"
    cap = gpumem.MODEL_MAX_CAPTURE.get(model_type)
    return gpumem.overheads(spec, tp, tokens, seqs, eager=a.enforce_eager, max_capture=cap)


def to_json(o: gpumem.Overheads, budget: int, device: int, reserved_given: bool) -> dict[str, Any]:
    slack = device - budget
    return {
        "max_num_batched_tokens": o.max_num_batched_tokens,
        "max_num_seqs": o.max_num_seqs,
        "activations_bytes": o.activations.bytes,
        "activations_formula": o.activations.formula,
        "activations_source": "measured by vLLM (profile run's torch peak); estimated here; "
        + gpumem.ACTIVATION_CHECK,
        "cuda_graphs": o.graph_count,
        "cuda_graphs_bytes": o.cuda_graphs_bytes,
        "cuda_graphs_source": "estimated by vLLM (profile_cudagraph_memory); here "
        f"{o.graph_count} graphs x {gpumem.CUDA_GRAPH_BYTES // gpumem.MIB} MiB "
        "(vllm-project/vllm#22897, gpustack/runner#251)",
        "non_torch_bytes": o.non_torch_bytes,
        "non_torch_source": "measured by vLLM (NCCL/all-reduce buffers, workspaces); here "
        "vllm-project/vllm#10511's 1.79 GiB at TP 1, 3.58 GiB at TP 2 (and beyond)",
        "allocator_slack_bytes": 0,
        "allocator_slack_source": "counted inside vLLM's measurement: it empties torch's caching "
        "allocator before measuring (utils/mem_utils.py memory_profiling: gc.collect, "
        "empty_cache) and splits no block above 20 MB during the profile run, so what stays "
        "reserved is in the figures above; not estimated apart",
        "estimate_bytes": o.in_request_bytes,
        "reserved_from": "--reserved" if reserved_given else "estimate",
        "cuda_context_bytes": o.cuda_context_bytes,
        "cuda_context_source": "outside vLLM's share, created before its first snapshot; "
        "about 400 MB with lazy loading (pytorch/pytorch#109888)",
        "outside_budget_bytes": slack,
        "context_fits_outside": o.cuda_context_bytes <= slack,
    }


def _b(n: int) -> str:
    return f"{n:,} B ({format_bytes(n)})"


def render(g: dict[str, Any], reserved_line: str) -> list[str]:
    """The reserved line (with where its figure came from) and the estimate's parts."""
    if g["reserved_from"] == "--reserved":
        lines = [f"{reserved_line}  [--reserved; the estimate would be {_b(g['estimate_bytes'])}]"]
    else:
        lines = [f"{reserved_line}  [estimated as below; --reserved overrides]"]
    lines += [
        f"      activations      {_b(g['activations_bytes'])} = {g['activations_formula']}",
        f"                       ({g['activations_source']})",
        f"      CUDA graphs      {_b(g['cuda_graphs_bytes'])}  ({g['cuda_graphs_source']})",
        f"      non-torch        {_b(g['non_torch_bytes'])}  ({g['non_torch_source']})",
        f"      allocator slack  {_b(g['allocator_slack_bytes'])}  ({g['allocator_slack_source']})",
        f"  outside the share    {_b(g['outside_budget_bytes'])} = device - device x utilization; "
        f"holds the CUDA context {_b(g['cuda_context_bytes'])} "
        + ("(fits)" if g["context_fits_outside"] else "(does NOT fit: lower --gpu-util)"),
    ]
    return lines
