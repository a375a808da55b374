import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.errors import UsageError
from kvtier.core.layout import DType, KVLayout, LayerSpec, alternating
from kvtier.core.presets import get_preset

LLAMA8 = get_preset("Llama-3-8B")


def test_llama3_8b_worked_example():
    layout = LLAMA8.layout()
    # 2 (K,V) * 32 layers * 8 KV heads * 128 head_dim * 2 B (bf16) = 131,072 B = 128 KiB
    assert layout.bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072
    # 16 tokens * 131,072 B = 2,097,152 B = 2 MiB per block
    assert layout.block_bytes() == 2 * 2**20
    assert layout.bytes_per_token_total() == 131_072


def test_tp8_splits_kv_heads():
    layout = LLAMA8.layout(tp_size=8, tp_rank=7)
    # 8 KV heads / 8 ranks = 1 head per rank: 2 * 32 * 1 * 128 * 2 = 16,384 B = 16 KiB
    assert layout.kv_heads_per_rank == 1
    assert layout.bytes_per_token() == 16 * 1024
    assert layout.block_bytes() == 16 * 16 * 1024  # 256 KiB
    assert layout.bytes_per_token_total() == 131_072  # 8 ranks * 16 KiB, no replication


def test_tp16_replicates_kv_heads():
    layout = LLAMA8.layout(tp_size=16, tp_rank=15)
    # 16 ranks > 8 KV heads: still 1 head per rank, each head held by 16/8 = 2 ranks
    assert layout.kv_heads_per_rank == 1
    assert layout.kv_replication == 2
    assert layout.bytes_per_token() == 16 * 1024
    assert layout.bytes_per_token_total() == 2 * 131_072  # 16 * 16 KiB: replicas count


def test_mla_deepseek_v3():
    layout = get_preset("DeepSeek-V3").layout(tp_size=8)
    # 61 layers * (512 latent + 64 rope) * 2 B = 70,272 B/token, not split by TP
    assert layout.bytes_per_token() == 61 * 576 * 2 == 70_272
    assert layout.kv_replication == 8
    assert layout.block_bytes() == 16 * 70_272


def test_fp8_with_declared_scales():
    layout = LLAMA8.layout(dtype=DType.FP8, fp8_scale_bytes=4)
    # each K or V vector: 128 * 1 B + 4 B scale; 2 * 32 layers * 8 heads * 132 B = 67,584 B
    assert layout.bytes_per_token() == 2 * 32 * 8 * (128 + 4) == 67_584
    assert LLAMA8.layout(dtype=DType.FP8).bytes_per_token() == 65_536  # per-tensor scales
    mla = get_preset("DeepSeek-V3").layout(dtype=DType.FP8, fp8_scale_bytes=16)
    assert mla.bytes_per_token() == 61 * (576 + 16)


def test_dtypes():
    assert [d.itemsize for d in DType] == [4, 2, 2, 1, 1]  # fp32 bf16 fp16 fp8 int8
    assert LLAMA8.layout(dtype=DType.FP32).bytes_per_token() == 2 * 131_072
    assert DType.parse("bfloat16") is DType.BF16
    with pytest.raises(UsageError, match="unknown dtype 'int3'"):
        DType.parse("int3")


def test_sliding_layers_store_per_token_like_full_layers():
    # gpt-oss-20b: 24 layers (12 sliding, 12 full) * 2 * 8 heads * 64 * 2 B = 49,152 B/token
    layout = get_preset("gpt-oss-20b").layout()
    assert layout.bytes_per_token() == 24 * 2 * 8 * 64 * 2 == 49_152
    assert list(layout.kinds().values()) == [12, 12]


def test_recurrent_state_is_per_sequence_and_split_over_state_heads():
    layers = alternating([LayerSpec.recurrent(1 << 20, state_heads=16)] * 3 + [LayerSpec.full()], 8)
    layout = KVLayout(layers, num_kv_heads=4, head_dim=128, tp_size=4)
    # 2 full layers * 2 * (4/4 heads) * 128 * 2 B = 1,024 B/token; 6 recurrent layers hold none
    assert layout.bytes_per_token() == 1024
    # 6 layers * 1 MiB state / 4 ranks (16 state heads split 4 ways)
    assert layout.state_bytes_per_sequence() == 6 * (1 << 20) // 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 3}, "TP size 3 does not divide the 8 KV heads"),
        ({"tp_size": 12}, "not a multiple"),
        ({"block_tokens": 0}, "block_tokens must be a positive integer"),
        ({"tp_size": 2, "tp_rank": 2}, "out of range"),
        ({"fp8_scale_bytes": 2}, "only meaningful with dtype fp8"),
        ({"head_dim": -1}, "head_dim must be a positive integer"),
        ({"num_kv_heads": 2.5}, "num_kv_heads must be a positive integer"),
    ],
)
def test_invalid_layouts(kwargs, message):
    base = {"layers": (LayerSpec.full(),) * 4, "num_kv_heads": 8, "head_dim": 128}
    with pytest.raises(UsageError, match=message):
        KVLayout(**(base | kwargs))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LayerSpec.sliding(0), "window of at least 1"),
        (lambda: LayerSpec.mla(0, 64), "kv_lora_rank >= 1"),
        (lambda: LayerSpec.recurrent(0), "state_bytes >= 1"),
        (lambda: LayerSpec.recurrent(10, state_heads=3), "not divisible"),
        (lambda: LayerSpec(LayerSpec.full().kind, window=5), "only sliding-window"),
        (lambda: KVLayout((), 8, 128), "at least one layer"),
    ],
)
def test_invalid_layer_specs(make, message):
    with pytest.raises(UsageError, match=message):
        make()


# Golden value: changing it breaks every stored block key and SSD header. Bump FORMAT_VERSION
# deliberately if the encoding must change.
LLAMA8_FINGERPRINT = "b7df19f1b31cba9fb5a5d9cbca7f9749d3d8ad7ff200e22c124a8056df17df7b"


def test_fingerprint_golden_and_length():
    fp = LLAMA8.layout().fingerprint()
    assert len(fp) == 32
    assert fp.hex() == LLAMA8_FINGERPRINT


def test_fingerprint_stable_across_processes():
    code = (
        "from kvtier.core.presets import get_preset;"
        "print(get_preset('Llama-3-8B').layout().fingerprint().hex())"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.strip() == LLAMA8_FINGERPRINT


def test_fingerprint_covers_every_layout_field():
    base = LLAMA8.layout(dtype=DType.FP8, tp_size=2)
    variants = [
        LLAMA8.layout(dtype=DType.FP8, tp_size=2, tp_rank=1),
        LLAMA8.layout(dtype=DType.FP8, tp_size=4),
        LLAMA8.layout(dtype=DType.FP8, tp_size=2, block_tokens=32),
        LLAMA8.layout(dtype=DType.FP8, tp_size=2, fp8_scale_bytes=4),
        LLAMA8.layout(dtype=DType.BF16, tp_size=2),
        KVLayout(base.layers[:-1], 8, 128, DType.FP8, 16, 2),
        KVLayout(base.layers, 8, 64, DType.FP8, 16, 2),
        KVLayout((*base.layers[:-1], LayerSpec.sliding(4096)), 8, 128, DType.FP8, 16, 2),
        KVLayout((*base.layers[:-1], LayerSpec.sliding(2048)), 8, 128, DType.FP8, 16, 2),
    ]
    prints = {v.fingerprint() for v in variants}
    assert len(prints) == len(variants)
    assert base.fingerprint() not in prints
    assert KVLayout(base.layers, 8, 128, DType.FP8, 16, 2).fingerprint() == base.fingerprint()


def test_describe():
    assert LLAMA8.layout(tp_size=16, tp_rank=3).describe() == (
        "32 layers [32 full], 8 KV heads (1 on rank) x 128, bf16, 16-token blocks, TP rank 3 of 16"
    )


_heads = st.sampled_from([1, 2, 4, 8, 16, 32])
_mult = st.sampled_from([1, 2, 4, 8])


@given(kv_heads=_heads, tp_small=_mult, tp_factor=_mult, head_dim=st.integers(1, 256))
def test_tp_beyond_kv_heads_never_lowers_per_rank_kv(kv_heads, tp_small, tp_factor, head_dim):
    layers = (LayerSpec.full(),) * 3
    tp_small = min(tp_small, kv_heads)
    tp_big = kv_heads * tp_factor  # at or beyond the KV head count
    at_heads = KVLayout(layers, kv_heads, head_dim, tp_size=kv_heads).bytes_per_token()
    below = KVLayout(layers, kv_heads, head_dim, tp_size=tp_small).bytes_per_token()
    beyond = KVLayout(layers, kv_heads, head_dim, tp_size=tp_big, tp_rank=tp_big - 1)
    assert beyond.bytes_per_token() == at_heads  # one head per rank, however many ranks
    assert below >= at_heads  # more ranks never add per-rank KV below the head count
    assert beyond.bytes_per_token_total() >= KVLayout(layers, kv_heads, head_dim).bytes_per_token()
