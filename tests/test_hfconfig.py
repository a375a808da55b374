"""config.json read the way vLLM 0.32 reads it (kvtier.core.hfconfig): families size has no preset
for, written here from their published config.json fields (nothing downloaded). Every figure is
worked by hand in the comments; the code under test does not compute the expectations."""

import json

import pytest

from kvtier.commands.size import read_hf_config, read_hf_reading
from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import CLASS_DEFAULTS, read_config, spec_from_config
from kvtier.core.layout import AttentionKind

GEMMA2_9B = {  # google/gemma-2-9b: no layer_types, no sliding_window_pattern, no tie field
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "cache_implementation": "hybrid",
    "vocab_size": 256000,
    "torch_dtype": "float32",
}
GEMMA2_27B = GEMMA2_9B | {
    "hidden_size": 4608,
    "intermediate_size": 36864,
    "num_hidden_layers": 46,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "query_pre_attn_scalar": 144,
}
GEMMA3_1B = {  # google/gemma-3-1b-it: the older pattern field, no layer_types
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
    "torch_dtype": "bfloat16",
}
GEMMA3_27B = {  # google/gemma-3-27b-it: a multimodal wrapper, the text model in text_config
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "sliding_window": 1024,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10
        + ["sliding_attention"] * 2,
        "vocab_size": 262208,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}
QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct: a window that use_sliding_window switches off
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
QWEN25_05B = QWEN25_7B | {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_window_layers": 24,
    "sliding_window": 32768,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3_06B = {  # Qwen/Qwen3-0.6B
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_window_layers": 28,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3_NEXT = {  # Qwen/Qwen3-Next-80B-A3B-Instruct: no layer_types, full_attention_interval 4
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "moe_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V03 = {  # mistralai/Mistral-7B-v0.3: the window set to null
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "sliding_window": None,
    "vocab_size": 32768,
    "tie_word_embeddings": False,
}
LLAMA32_1B = {  # meta-llama/Llama-3.2-1B
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}
LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E-Instruct (text_config; vision omitted)
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192,
        "vocab_size": 202048,
    },
}
GPT_OSS_20B = {  # openai/gpt-oss-20b
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
}


def merged(doc):
    return doc | doc["text_config"] if "text_config" in doc else doc


def windows(spec):
    return [spec.window_of(i) for i in range(spec.num_layers)]


def test_gemma2_alternates_with_no_pattern_field():
    spec = spec_from_config(GEMMA2_9B)
    # transformers' Gemma2Config: layer i slides when (i + 1) % 2 != 0 -> even layers slide
    assert windows(spec) == [4096, None] * 21
    kinds = [x.kind for x in spec.layers]
    assert kinds.count(AttentionKind.SLIDING) == 21 and kinds.count(AttentionKind.FULL) == 21
    # KV/token: 42 layers x 2 x 8 heads x 256 x 2 B = 344,064 B
    assert spec.layout().bytes_per_token() == 344_064


def test_gemma2_missing_tie_is_tied():
    # per layer: q 3584*4096 + k,v 2*3584*2048 + o 4096*3584 = 44,040,192; MLP 3*3584*14336
    #   = 154,140,672; 4 norms 14,336 -> 198,195,200; x42 = 8,324,198,400
    # tied embeddings 256,000*3,584 = 917,504,000; final norm 3,584 -> 9,241,705,984 (9.24B)
    assert spec_from_config(GEMMA2_9B).total_params == 9_241_705_984
    # untied would add a second 917,504,000 table: 10,159,209,984 (the 10.16B of issue 24)
    untied = spec_from_config(GEMMA2_9B | {"tie_word_embeddings": False})
    assert untied.total_params == 10_159_209_984
    # 27B: per layer 3*18,874,368 + 3*4608*36864 + 4*4608 = 566,249,472; x46 = 26,047,475,712
    #   + 256,000*4,608 = 1,179,648,000 + 4,608 -> 27,227,128,320
    assert spec_from_config(GEMMA2_27B).total_params == 27_227_128_320


def test_gemma3_pattern_and_layer_types():
    one_b = spec_from_config(GEMMA3_1B)
    # pattern 6: layers 5, 11, 17, 23 full, the other 22 slide (window 512)
    assert windows(one_b) == ([512] * 5 + [None]) * 4 + [512] * 2
    # per layer: q 1152*1024 + k,v 2*1152*256 + o 1024*1152 = 2,949,120; q/k norms 512;
    #   MLP 3*1152*6912 = 23,887,872; 4 norms 4,608 -> 26,842,112; x26 = 697,894,912
    # tied embeddings 262,144*1,152 = 301,989,888; final norm 1,152 -> 999,885,952
    assert one_b.total_params == 999_885_952
    big = spec_from_config(merged(GEMMA3_27B))
    assert windows(big) == ([1024] * 5 + [None]) * 10 + [1024] * 2
    # 52 sliding + 10 full layers, 2 x 16 x 128 x 2 B = 8,192 B per layer: 507,904 B/token
    assert big.layout().bytes_per_token() == 62 * 8192 == 507_904
    # per layer 3*22,020,096 + 256 + 3*5376*21504 + 4*5376 = 412,898,560; x62 = 25,599,710,720
    #   + tied 262,208*5,376 = 1,409,630,208 + 5,376 -> 27,009,346,304 (the text model)
    assert big.total_params == 27_009_346_304


def test_gpt_oss_even_layers_slide_whatever_layer_types_says():
    r = read_config(GPT_OSS_20B | {"layer_types": ["full_attention"] * 24})
    # vLLM gpt_oss.py: sliding_window if layer_idx % 2 == 0
    assert windows(r.spec) == [128, None] * 12
    assert any("layer_idx % 2 == 0" in rule for rule in r.rules)


def test_qwen_window_switched_off_and_params():
    q7 = spec_from_config(QWEN25_7B)
    assert windows(q7) == [None] * 28
    # per layer: q,o 2*3584^2 = 25,690,112; k,v 2*3584*512 = 3,670,016; qkv bias 3584 + 1024;
    #   MLP 3*3584*18944 = 203,685,888; norms 7,168 -> 233,057,792; x28 = 6,525,618,176
    # untied 2*152,064*3,584 = 1,089,994,752; final norm 3,584 -> 7,615,616,512
    assert q7.total_params == 7_615_616_512
    # 0.5B: per layer 2*802,816 + 229,376 + 1,152 + 13,074,432 + 1,792 = 14,912,384; x24
    #   = 357,897,216 + tied 151,936*896 = 136,134,656 + 896 -> 494,032,768
    assert spec_from_config(QWEN25_05B).total_params == 494_032_768
    # Qwen3-0.6B: per layer 3*2,097,152 + 256 + 9,437,184 + 2,048 = 15,730,944; x28
    #   = 440,466,432 + tied 151,936*1,024 = 155,582,464 + 1,024 -> 596,049,920
    assert spec_from_config(QWEN3_06B).total_params == 596_049_920


def test_qwen3_next_linear_attention_state():
    r = read_config(QWEN3_NEXT)
    spec = r.spec
    full = [i for i, x in enumerate(spec.layers) if x.kind is AttentionKind.FULL]
    assert full == list(range(3, 48, 4))  # every 4th layer; the 36 others Gated DeltaNet
    # state per layer (vLLM gated_delta_net_state_shape, bf16): conv (4 - 1) x (2*16*128 +
    #   32*128) = 24,576 + temporal 32*128*128 = 524,288 -> 548,864 elements x 2 B = 1,097,728 B
    rec = [x for x in spec.layers if x.kind is AttentionKind.RECURRENT]
    assert len(rec) == 36 and {x.state_bytes for x in rec} == {1_097_728}
    layout = spec.layout()
    assert layout.state_bytes_per_sequence() == 36 * 1_097_728 == 39_518_208
    # KV only in the 12 full layers: 12 x 2 x 2 heads x 256 x 2 B = 24,576 B/token
    assert layout.bytes_per_token() == 24_576
    # TP 2 halves both the state (v heads and conv channels) and the KV heads
    tp2 = spec.layout(tp_size=2)
    assert tp2.state_bytes_per_sequence() == 36 * 548_864
    assert tp2.bytes_per_token() == 12_288
    assert round(spec.total_params / 1e9) == 80  # published: 80B total


def test_llama4_chunked_layers_are_allocated_full():
    r = read_config(merged(LLAMA4_SCOUT))
    # no_rope_layers absent: every 4th layer is NoPE (global), the other 36 chunked (8192)
    assert (r.chunked_layers, r.chunk_size) == (36, 8192)
    assert windows(r.spec) == [None] * 48
    # 48 layers x 2 x 8 heads x 128 x 2 B = 196,608 B/token
    assert r.spec.layout().bytes_per_token() == 196_608


def test_mistral_window_null_absent_and_llama_tie_defaults():
    assert windows(spec_from_config(MISTRAL_7B_V03)) == [None] * 32
    # 32 x 218,112,000 + 2 x 32,768 x 4,096 + 4,096 = 7,248,023,552 (Mistral-7B-v0.3)
    assert spec_from_config(MISTRAL_7B_V03).total_params == 7_248_023_552
    # an absent window is MistralConfig's default 4096 (a null one is none at all)
    absent = {k: v for k, v in MISTRAL_7B_V03.items() if k != "sliding_window"}
    assert windows(spec_from_config(absent)) == [4096] * 32
    # Llama-3.2-1B (tied): per layer 2*2048^2 + 2*2048*512 + 3*2048*8192 + 4,096 = 60,821,504;
    #   x16 = 973,144,064 + 128,256*2,048 = 262,668,288 + 2,048 -> 1,235,814,400
    assert spec_from_config(LLAMA32_1B).total_params == 1_235_814_400
    no_tie = {k: v for k, v in LLAMA32_1B.items() if k != "tie_word_embeddings"}
    # LlamaConfig defaults to untied: + 262,668,288
    assert spec_from_config(no_tie).total_params == 1_235_814_400 + 262_668_288
    # an unknown model_type falls back to PretrainedConfig's tied default
    unknown = no_tie | {"model_type": "somebody_new"}
    assert spec_from_config(unknown).total_params == 1_235_814_400


def test_model_directory_and_missing_config(tmp_path):
    (tmp_path / "gemma-2-9b").mkdir()
    (tmp_path / "gemma-2-9b" / "config.json").write_text(json.dumps(GEMMA2_9B))
    spec = read_hf_config(tmp_path / "gemma-2-9b")
    assert spec.name == "gemma-2-9b" and spec.total_params == 9_241_705_984
    assert read_hf_reading(tmp_path / "gemma-2-9b").model_type == "gemma2"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"has no config\.json"):
        read_hf_config(tmp_path / "empty")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (QWEN3_NEXT | {"layer_types": ["mamba"] * 48}, "not supported"),
        (GEMMA2_9B | {"sliding_window": -1}, "'sliding_window' must be an integer >= 0"),
        (GEMMA2_9B | {"head_dim": "256"}, "'head_dim' must be an integer"),
        (merged(LLAMA4_SCOUT) | {"no_rope_layers": [1, 0]}, "one flag per layer"),
    ],
)
def test_bad_family_fields(doc, message):
    with pytest.raises(UsageError, match=message):
        spec_from_config(doc)


@pytest.mark.parametrize("model_type", sorted(CLASS_DEFAULTS))
def test_class_defaults_match_installed_transformers(model_type):
    transformers = pytest.importorskip("transformers")
    cls = transformers.CONFIG_MAPPING[model_type]
    for field, value in CLASS_DEFAULTS[model_type].items():
        assert getattr(cls, field) == value, (model_type, field)


def test_transformers_to_dict_reads_the_same():
    transformers = pytest.importorskip("transformers")
    # integrations/vllm/layout.py passes hf_config.to_dict(): transformers fills layer_types
    cfg = transformers.Gemma2Config(**{k: v for k, v in GEMMA2_9B.items() if k != "architectures"})
    assert windows(spec_from_config(cfg.to_dict())) == [4096, None] * 21
