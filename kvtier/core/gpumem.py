"""GPU memory a vLLM 0.32 engine rank holds beside weights and KV cache. Pure: no I/O.

How vLLM 0.32 sizes its KV cache (`v1/worker/gpu_worker.py` `determine_available_memory`,
`utils/mem_utils.py` `memory_profiling`, `v1/worker/utils.py` `request_memory`):

    requested = ceil(device x gpu_memory_utilization)
    KV cache  = requested - weights - activation peak - non-torch growth - CUDA graphs

- weights: measured (the model's memory after loading).
- activation peak: measured, the torch peak over a dummy forward of `max_num_batched_tokens`
  tokens (plus a sampler pass over `max_num_seqs` rows) in the profile run.
- non-torch growth: measured, memory not allocated by torch that appeared since the worker's
  first snapshot (NCCL and custom all-reduce buffers at TP > 1, attention-backend workspaces).
- CUDA graphs: estimated by vLLM itself (`profile_cudagraph_memory`: it captures two graphs per
  mode and extrapolates), subtracted by default (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1).
- the CUDA context (and NCCL's communicator setup) is created before that first snapshot, so it
  is not in `requested`: it must fit in device x (1 - gpu_memory_utilization).

vLLM measures on the GPU at start-up; kvtier cannot, so it estimates each part from the model's
shape and the constants below, each with where it comes from. `--reserved` overrides the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.presets import ModelSpec
from kvtier.core.sizing import cdiv

MIB = 2**20
GIB = 2**30

ACTIVATION_BYTES = 2
"""bf16/fp16 activations."""
LOGIT_BYTES = 4
"""vLLM computes logits in fp32 for the sampled rows."""
CUDA_CONTEXT_BYTES = 400 * MIB
"""CUDA context with lazy module loading (CUDA >= 11.7): about 400 MB (pytorch/pytorch#109888)."""
CUDA_GRAPH_BYTES = 25 * MIB
"""Per captured graph: 24-26 MiB per size in vLLM's capture log (vllm-project/vllm#22897); 0.36 GiB
for 16 graphs in vLLM's own estimate (gpustack/runner#251)."""
NON_TORCH_TP1 = 1_921_997_864
"""1.79 GiB non-torch memory, Llama-3-8B on an H100, TP 1 (vllm-project/vllm#10511)."""
NON_TORCH_TP2 = 3_843_995_729
"""3.58 GiB at TP 2, same run (vllm-project/vllm#10511); used for every TP > 1 (not measured
beyond 2)."""
MODEL_MAX_CAPTURE = {"gpt_oss": 1024}
"""Models whose vLLM config raises max_cudagraph_capture_size (GptOssForCausalLMConfig: 1024)."""
ACTIVATION_CHECK = "Llama-3-8B, 8,192 tokens, 256 seqs: 1.15 GiB here, 1.26 GiB measured (#10511)"


def vllm_serve_defaults(device_bytes: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` on a GPU of this size
    (vLLM 0.32 `engine/arg_utils.py`: >= 160 GiB 16384/1024, >= 70 GiB 8192/1024 (A100s
    excepted), else 2048/256)."""
    if device_bytes >= 160 * GIB:
        return 16_384, 1024
    if device_bytes >= 70 * GIB:
        return 8192, 1024
    return 2048, 256


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, max_capture: int | None = None
) -> list[int]:
    """vLLM's default CUDA graph capture sizes: [1, 2, 4], multiples of 8 below 256, multiples
    of 16 from 256, up to min(2 x max_num_seqs, 512, max_num_batched_tokens)
    (`config/vllm.py` `_set_cudagraph_sizes`; 1024 on data-center Blackwell is not modelled).
    A model that sets max_cudagraph_capture_size (`max_capture`; gpt-oss: 1024,
    `model_executor/models/config.py`) caps at min(max_capture, max_num_batched_tokens)."""
    if max_capture is not None:
        top = min(max_capture, max_num_batched_tokens)
    else:
        top = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max(top, 256) + 1, 16)]
    return [s for s in sizes if s <= top]


def cuda_graph_count(
    max_num_seqs: int, max_num_batched_tokens: int, max_capture: int | None = None
) -> int:
    """Graphs in FULL_AND_PIECEWISE mode (vLLM's default): a piecewise graph per capture size
    and a full decode graph per size up to max_num_seqs (approximate: the backend decides)."""
    sizes = capture_sizes(max_num_seqs, max_num_batched_tokens, max_capture)
    return len(sizes) + sum(1 for s in sizes if s <= max_num_seqs)


@dataclass(frozen=True, slots=True)
class Activations:
    bytes: int
    formula: str


def activation_peak(spec: ModelSpec, tp: int, tokens: int, seqs: int) -> Activations:
    """The largest step's activation peak on one rank, estimated.

    Per token at the MLP peak: residual, normed input, attention output and MLP input (4 x H)
    plus the MLP's gate/up output and activation (3 x I / TP); for MoE, vLLM's fused-MoE
    workspaces per routed (and shared) expert: k x (3 x I / TP + H). Plus the sampler's fp32
    logits and probabilities over the vocabulary for max_num_seqs rows: 2 x S x V x 4 B.
    """
    h, width, k = spec.hidden_size, spec.intermediate_size, spec.active_experts
    i = cdiv(width, tp)
    e = ACTIVATION_BYTES
    if k:
        per_token = 4 * h + k * (3 * i + h)
        mlp = f"4 x {h} + {k} experts x (3 x {i} + {h})"
    else:
        per_token = 4 * h + 3 * i
        mlp = f"4 x {h} + 3 x {i}"
    logits = 2 * seqs * spec.vocab_size * LOGIT_BYTES
    total = tokens * per_token * e + logits
    formula = (
        f"{tokens:,} tokens x ({mlp}) x {e} B + 2 x {seqs} seqs x {spec.vocab_size:,} vocab "
        f"x {LOGIT_BYTES} B"
    )
    if not width or not spec.vocab_size:
        formula += " (MLP width or vocabulary unknown for this model: give --reserved)"
    return Activations(total, formula)


@dataclass(frozen=True, slots=True)
class Overheads:
    """One rank's memory beside weights and KV, estimated part by part (bytes)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    activations: Activations
    graph_count: int
    cuda_graphs_bytes: int
    non_torch_bytes: int
    cuda_context_bytes: int

    @property
    def in_request_bytes(self) -> int:
        """What vLLM subtracts from device x gpu_memory_utilization besides the weights."""
        return self.activations.bytes + self.cuda_graphs_bytes + self.non_torch_bytes


def overheads(
    spec: ModelSpec,
    tp: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    eager: bool = False,
    max_capture: int | None = None,
) -> Overheads:
    graphs = 0 if eager else cuda_graph_count(max_num_seqs, max_num_batched_tokens, max_capture)
    return Overheads(
        max_num_batched_tokens,
        max_num_seqs,
        activation_peak(spec, tp, max_num_batched_tokens, max_num_seqs),
        graphs,
        graphs * CUDA_GRAPH_BYTES,
        NON_TORCH_TP1 if tp == 1 else NON_TORCH_TP2,
        CUDA_CONTEXT_BYTES,
    )
