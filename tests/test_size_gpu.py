"""Every GPU gigabyte beside weights and KV (kvtier.core.gpumem, the size pool), by hand."""

import json

import pytest

from kvtier.cli import main
from kvtier.core.gpumem import (
    activation_peak,
    capture_sizes,
    cuda_graph_count,
    overheads,
    vllm_serve_defaults,
)
from kvtier.core.presets import get_preset

GIB = 2**30


def test_vllm_serve_defaults_by_gpu_size():
    assert vllm_serve_defaults(80 * GIB) == (8192, 1024)  # H100 80GB
    assert vllm_serve_defaults(141 * 10**9) == (8192, 1024)  # H200: 131.3 GiB
    assert vllm_serve_defaults(180 * GIB) == (16_384, 1024)  # B200
    assert vllm_serve_defaults(48 * 10**9) == (2048, 256)  # L40S: 44.7 GiB


def test_capture_sizes_and_graph_count():
    # max_num_seqs 1024: top = min(2048, 512, 8192) = 512: [1, 2, 4] + 31 multiples of 8 below
    # 256 + 17 multiples of 16 from 256 to 512 = 51 sizes; all <= 1024 get a full graph: 102
    sizes = capture_sizes(1024, 8192)
    assert len(sizes) == 51 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert cuda_graph_count(1024, 8192) == 102
    # 256 seqs: 51 piecewise + 35 full (3 + 31 + the 256 itself) = 86
    assert cuda_graph_count(256, 8192) == 86
    # 16 seqs: top 32 -> [1, 2, 4, 8, 16, 24, 32]; full graphs at 1, 2, 4, 8, 16 -> 12
    assert capture_sizes(16, 8192) == [1, 2, 4, 8, 16, 24, 32]
    assert cuda_graph_count(16, 8192) == 12
    # a token budget below the sizes caps them: 100 tokens -> 1, 2, 4, 8, ..., 96 (15 sizes)
    assert len(capture_sizes(1024, 100)) == 15


def test_activation_peak_dense_and_moe():
    # Llama-3-8B, 8,192 tokens, 256 seqs: 8,192 x (4 x 4,096 + 3 x 14,336) x 2 B = 973,078,528
    #   + 2 x 256 x 128,256 x 4 B = 262,668,288 -> 1,235,746,816 B (1.15 GiB; vLLM measured
    #   1.26 GiB for this case in vllm-project/vllm#10511)
    a = activation_peak(get_preset("Llama-3-8B"), 1, 8192, 256)
    assert a.bytes == 1_235_746_816
    # TP 2 halves the MLP width: 8,192 x (16,384 + 21,504) x 2 = 620,756,992 + 262,668,288
    assert activation_peak(get_preset("Llama-3-8B"), 2, 8192, 256).bytes == 883_425_280
    # gpt-oss-20b, 8,192 tokens, 1,024 seqs: per token 4 x 2,880 + 4 experts x (3 x 2,880 +
    #   2,880) = 57,600 -> 943,718,400 B + 2 x 1,024 x 201,088 x 4 = 1,647,312,896 B
    moe = activation_peak(get_preset("gpt-oss-20b"), 1, 8192, 1024)
    assert moe.bytes == 943_718_400 + 1_647_312_896
    assert "4 experts x (3 x 2880 + 2880)" in moe.formula


def test_overheads_sum_and_eager():
    o = overheads(get_preset("Llama-3-8B"), 1, 8192, 1024)
    # activations 8,192 x 59,392 x 2 = 973,078,528 + 2 x 1,024 x 128,256 x 4 = 1,050,673,152
    #   = 2,023,751,680; graphs 102 x 25 MiB = 2,673,868,800; non-torch 1.79 GiB = 1,921,997,864
    assert o.activations.bytes == 2_023_751_680
    assert o.cuda_graphs_bytes == 2_673_868_800
    assert o.in_request_bytes == 2_023_751_680 + 2_673_868_800 + 1_921_997_864
    eager = overheads(get_preset("Llama-3-8B"), 2, 8192, 1024, eager=True)
    assert eager.graph_count == 0 and eager.cuda_graphs_bytes == 0
    assert eager.non_torch_bytes == 3_843_995_729  # 3.58 GiB at TP 2


def size_json(capsys, *args):
    assert main(["size", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_pool_subtracts_the_estimate(capsys):
    r = size_json(capsys, "--preset", "Llama-3-8B")
    g = r["gpu_memory"]
    assert g["reserved_from"] == "estimate" and r["reserved_bytes"] == 6_619_618_344
    # 77,309,411,328 - 16,060,522,496 - 6,619,618,344 = 54,629,270,488 B; / 2 MiB = 26,049
    assert r["usable_kv_bytes"] == 54_629_270_488 and r["pool_pages"] == 26_049
    # outside the 0.9 share: 80 GiB x 0.1 = 8 GiB, holds the 400 MiB context
    assert g["outside_budget_bytes"] == 8 * GIB and g["context_fits_outside"]
    over = size_json(capsys, "--preset", "Llama-3-8B", "--reserved", "2GiB")
    assert over["reserved_bytes"] == 2 * GIB and over["gpu_memory"]["reserved_from"] == "--reserved"
    # the prefill chunk is the token budget unless --max-num-batched-tokens says otherwise
    chunk = size_json(capsys, "--preset", "Llama-3-8B", "--prefill-chunk", "2048")
    assert chunk["gpu_memory"]["max_num_batched_tokens"] == 2048
    full = size_json(capsys, "--preset", "Llama-3-8B", "--gpu-util", "0.999")
    assert not full["gpu_memory"]["context_fits_outside"]  # 80 GiB x 0.001 = 82 MiB < 400 MiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--max-num-batched-tokens", "x"], "--max-num-batched-tokens must be an integer"),
    ],
)
def test_bad_gpu_options(capsys, args, message):
    assert main(["size", "--preset", "Llama-3-8B", *args]) == 2
    assert message in capsys.readouterr().err


def test_gpt_oss_raises_the_capture_ceiling():
    # GptOssForCausalLMConfig sets max_cudagraph_capture_size 1024: [1, 2, 4] + 31 + 49
    #   multiples of 16 from 256 to 1024 = 83 sizes (vLLM's comment: "from 67 to 83" graphs)
    assert len(capture_sizes(1024, 8192, max_capture=1024)) == 83
    # + full decode graphs for the 83 sizes <= 1,024 seqs: 166
    assert cuda_graph_count(1024, 8192, max_capture=1024) == 166
    o = overheads(get_preset("gpt-oss-20b"), 1, 8192, 1024, max_capture=1024)
    assert o.graph_count == 166


def test_preset_gpt_oss_uses_its_ceiling(capsys):
    r = size_json(capsys, "--preset", "gpt-oss-20b")
    assert r["gpu_memory"]["cuda_graphs"] == 166
