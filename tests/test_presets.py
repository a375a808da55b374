"""Presets against the published config.json numbers, and --hf-config reading of those configs.

CONFIGS holds the KV- and parameter-relevant fields of each model's published config.json
(Hugging Face repos named in the presets). Parameter counts are re-derived here by hand.
"""

import json

import pytest

from kvtier.commands.size import read_hf_config
from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import spec_from_config
from kvtier.core.layout import AttentionKind
from kvtier.core.presets import get_preset, list_presets

_GPT_OSS_TYPES = ["sliding_attention", "full_attention"]

CONFIGS = {
    "Llama-3-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    },
    "Llama-3-70B": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "Qwen3-8B": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 36,
    },
    "Qwen3-32B": {
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "head_dim": 128,
        "num_attention_heads": 64,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 64,
    },
    "DeepSeek-V3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "topk_method": "noaux_tc",
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    },
    "Mistral-7B-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "gpt-oss-20b": {
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
        "layer_types": _GPT_OSS_TYPES * 12,
        "attention_bias": True,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
    },
    "gpt-oss-120b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": _GPT_OSS_TYPES * 18,
        "attention_bias": True,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
    },
}

# Published totals and active counts (model cards / papers), billions.
PUBLISHED = {
    "Llama-3-8B": (8.03, None),
    "Llama-3-70B": (70.6, None),
    "Qwen3-8B": (8.2, None),
    "Qwen3-32B": (32.8, None),
    "DeepSeek-V3": (671, 37),
    "Mistral-7B-v0.1": (7.24, None),
    "gpt-oss-20b": (20.91, 3.61),
    "gpt-oss-120b": (116.83, 5.13),
}


def test_required_presets_exist():
    assert set(CONFIGS) <= set(list_presets())


def test_lookup_is_case_insensitive_and_unknown_is_a_usage_error():
    assert get_preset("llama-3-8b").name == "Llama-3-8B"
    with pytest.raises(UsageError, match="unknown preset 'llama-9'"):
        get_preset("llama-9")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_preset_matches_published_config(name):
    cfg, m = CONFIGS[name], get_preset(name)
    assert m.num_layers == cfg["num_hidden_layers"]
    assert m.hidden_size == cfg["hidden_size"]
    assert m.num_attention_heads == cfg["num_attention_heads"]
    assert m.num_kv_heads == cfg["num_key_value_heads"]
    assert m.vocab_size == cfg["vocab_size"]
    if "kv_lora_rank" not in cfg:
        assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_preset_param_counts_round_to_published(name):
    total, active = PUBLISHED[name]
    m = get_preset(name)
    digits = len(str(total).split(".")[1]) if "." in str(total) else 0
    assert round(m.total_params / 1e9, digits) == total
    if active is not None:
        digits = len(str(active).split(".")[1]) if "." in str(active) else 0
        assert round(m.active_params / 1e9, digits) == active
    else:
        # Dense: every weight but the input embedding table is multiplied per token.
        assert m.active_params == m.total_params - m.vocab_size * m.hidden_size


def test_llama3_8b_params_by_hand():
    # per layer: q,o 4096*4096 each = 33,554,432; k,v 4096*1024 each = 8,388,608;
    #   MLP 3*4096*14336 = 176,160,768; 2 norms 8,192 -> 218,112,000; x32 = 6,979,584,000
    # embeddings + untied head 2*128256*4096 = 1,050,673,152; final norm 4,096
    assert get_preset("Llama-3-8B").total_params == 6_979_584_000 + 1_050_673_152 + 4_096


def test_deepseek_v3_params_by_hand():
    # MLA attention/layer: q_a 7168*1536 + norm 1536 + q_b 1536*128*192 + kv_a 7168*576
    #   + norm 512 + kv_b 512*128*256 + o 128*128*7168 = 187,107,328; 2 norms 14,336
    # 3 dense layers: + 3*7168*18432 = 396,361,728 -> 583,483,392 each
    # 58 MoE layers: 257 experts of 3*7168*2048 = 44,040,192 (256 routed + 1 shared)
    #   + router 256*7168 + bias 256 -> 11,320,164,608 + attn + norms = 11,507,286,272 each
    # embed + head 2*129280*7168 = 1,853,358,080; final norm 7,168
    total = 3 * 583_483_392 + 58 * 11_507_286_272 + 1_853_358_080 + 7_168
    assert total == 671_026_419_200 == get_preset("DeepSeek-V3").total_params
    # active MoE layer: 9 experts (8 routed + 1 shared) = 396,361,728 + router 1,835,264
    #   + attn + norms = 585,318,656; head 926,679,040 (input embedding is a lookup)
    active = 3 * 583_483_392 + 58 * 585_318_656 + 926_679_040 + 7_168
    assert active == get_preset("DeepSeek-V3").active_params


def test_gpt_oss_20b_params_by_hand():
    # expert: gate_up 2880*5760 + 5760 bias, down 2880*2880 + 2880 bias = 24,891,840
    # attention: q 2880*4096+4096, k,v 2880*512+512 each, o 4096*2880+2880, sinks 64
    #   = 26,550,144; router 2880*32+32 = 92,192; norms 5,760
    layer_total = 32 * 24_891_840 + 26_550_144 + 92_192 + 5_760
    layer_active = 4 * 24_891_840 + 26_550_144 + 92_192 + 5_760
    embed = 201_088 * 2880
    m = get_preset("gpt-oss-20b")
    assert m.total_params == 24 * layer_total + 2 * embed + 2880
    assert m.active_params == 24 * layer_active + embed + 2880


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_config_reproduces_preset(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    spec, preset = read_hf_config(path), get_preset(name)
    for kw in ({}, {"tp_size": 8, "tp_rank": 3}, {"block_tokens": 64}):
        assert spec.layout(**kw).fingerprint() == preset.layout(**kw).fingerprint()
    assert spec.d_attn == preset.d_attn
    assert (spec.intermediate_size, spec.active_experts) == (
        preset.intermediate_size,
        preset.active_experts,
    )
    assert spec.total_params == preset.total_params
    assert spec.active_params == preset.active_params


def test_layer_kinds_of_hybrid_presets():
    oss = get_preset("gpt-oss-120b")
    assert [oss.window_of(i) for i in range(4)] == [128, None, 128, None]
    assert get_preset("Mistral-7B-v0.1").window_of(31) == 4096
    ds = get_preset("DeepSeek-V3").layers
    assert {x.kind for x in ds} == {AttentionKind.MLA}
    assert (ds[0].kv_lora_rank, ds[0].rope_dim) == (512, 64)


def test_d_attn():
    assert get_preset("Llama-3-8B").d_attn == 32 * 128
    assert get_preset("Qwen3-32B").d_attn == 64 * 128
    # MLA: QK^T over 192 dims per head, AV over 128: 128 * (192 + 128) / 2
    assert get_preset("DeepSeek-V3").d_attn == 20480


def test_qwen2_window_on_some_layers_is_refused_as_vllm_does_and_text_config_merges():
    doc = {
        "text_config": {
            "model_type": "qwen2",
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_hidden_layers": 4,
            "vocab_size": 1000,
            "sliding_window": 256,
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    }
    # transformers would slide layers 2 and 3 only; vLLM 0.32's qwen2.py asserts against it
    with pytest.raises(UsageError, match="refused by vLLM"):
        spec_from_config(doc | doc["text_config"])
    # with max_window_layers = layers vLLM gives every layer the model-level window
    every = doc["text_config"] | {"max_window_layers": 4}
    spec = spec_from_config(every)
    assert [spec.window_of(i) for i in range(4)] == [256] * 4
    assert spec.num_kv_heads == 8 and spec.head_dim == 128


def test_gemma2_style_pattern():
    doc = {
        "hidden_size": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 6,
        "vocab_size": 10,
        "sliding_window": 64,
        "sliding_window_pattern": 3,
    }
    assert [spec_from_config(doc).window_of(i) for i in range(6)] == [64, 64, None] * 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read config"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"hidden_size": 4096, "num_attention_heads": 32}', "lacks 'num_hidden_layers'"),
        (
            '{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": -2,'
            ' "vocab_size": 5}',
            "'num_hidden_layers' must be an integer >= 1",
        ),
        (
            '{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,'
            ' "vocab_size": 5, "layer_types": ["linear_attention", "full_attention"]}',
            "not supported",
        ),
        (
            '{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,'
            ' "vocab_size": 5, "layer_types": ["full_attention"]}',
            "one type per layer",
        ),
    ],
)
def test_bad_configs_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message):
        read_hf_config(path)
