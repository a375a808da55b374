"""`kvtier size --hf-config` sizes a quantized checkpoint's weights from its
`quantization_config` (kvtier.core.weightquant), through the real CLI. The configs are written
here from the published config.json fields of deepseek-ai/DeepSeek-V3 (fp8, 128x128 block
scales) and openai/gpt-oss-120b (mxfp4 experts); nothing is downloaded. Every figure is worked by
hand in the comments."""

import json
import subprocess
import sys

import pytest

from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import read_config
from kvtier.core.weightquant import weight_bytes

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def size(tmp_path, doc, *args):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(doc))
    return subprocess.run([sys.executable, "-m", "kvtier", "size", "--hf-config", str(model),
                           *args], capture_output=True, text=True, timeout=60)


def size_json(tmp_path, doc, *args):
    proc = size(tmp_path, doc, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_parts_add_up_to_the_published_totals():
    ds = read_config(DEEPSEEK_V3)
    # linear: MLA projections 187,105,280 x 61 = 11,413,422,080 + 3 dense MLPs x 396,361,728
    #   + 58 shared experts x 44,040,192 = 15,156,838,400; experts 58 x 256 x 44,040,192
    #   = 653,908,770,816; embed + head 2 x 129,280 x 7168 = 1,853,358,080; other: 61 x 2 norms
    #   of 7168 + MLA norms 1536 + 512, routers 58 x (256 x 7168 + 256), final norm 7168
    #   = 107,451,904
    assert tuple(ds.params) == (15_156_838_400, 653_908_770_816, 1_853_358_080, 107_451_904)
    assert ds.params.total == ds.spec.total_params == 671_026_419_200
    oss = read_config(GPT_OSS_120B)
    # experts 36 x 128 x 3 x 2880 x 2880 = 114,661,785,600 of 116,829,156,672
    assert oss.params.experts == 114_661_785_600
    assert oss.params.total == oss.spec.total_params == 116_829_156_672


def test_deepseek_v3_fp8_fits_on_8_h200s(tmp_path):
    """Defect: the fp8 checkpoint was counted at 2 B a weight (167.8 GB a rank at TP 8): not
    fitting in an H200's 126.9 GB share."""
    r = size_json(tmp_path, DEEPSEEK_V3, "--tp", "8", "--gpu-bytes", "141GB")
    # fp8: 669,065,609,216 x 1 B + 4 B x ceil(that / 16,384) = 163,346,096 B of scales;
    #   1,960,809,984 other params x 2 B = 3,921,619,968 -> 673,150,575,280 B / 8 (ceil)
    assert r["weights_bytes"] == 84_143_821_910
    assert r["weights_note"].startswith("fp8 (quantization_config)")
    assert r["usable_kv_bytes"] > 0 and r["admission_fits"]
    assert r["dtype"] == "bf16"  # the KV dtype stays what the user says
    table = size(tmp_path, DEEPSEEK_V3, "--tp", "8", "--gpu-bytes", "141GB").stdout
    assert "weights do not fit" not in table and "128x128 block" in table


def test_gpt_oss_120b_mxfp4_fits_on_one_gpu(tmp_path):
    """Defect: mxfp4 experts were counted at 2 B a weight (233.7 GB on one 80 GiB GPU)."""
    r = size_json(tmp_path, GPT_OSS_120B)
    # experts 114,661,785,600 x 0.53125 = 60,914,073,600 + 2,167,371,072 x 2 B -> 65,248,815,744
    assert r["weights_bytes"] == 65_248_815_744
    assert r["usable_kv_bytes"] > 0  # the weights fit an 80 GiB GPU's 72 GiB share
    assert size_json(tmp_path, GPT_OSS_120B, "--gpu-bytes", "141GB")["admission_fits"]
    # the user's --weight-bytes-per-param or --weights still wins over the config
    assert size_json(tmp_path, GPT_OSS_120B, "--weight-bytes-per-param", "2")[
        "weights_bytes"] == 2 * 116_829_156_672
    assert size_json(tmp_path, GPT_OSS_120B, "--weights", "70GB")["weights_bytes"] == 70 * 10**9


def test_gptq_and_unknown_methods(tmp_path):
    parts = read_config(GPT_OSS_120B).params
    q = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    # linear + experts 115,617,300,480 x 0.5 B + ceil(that / 128 x 2.5 B) = 2,258,150,400
    #   + 1,211,856,192 other x 2 B
    quantized = parts.linear + parts.experts
    assert quantized == 115_617_300_480
    assert weight_bytes(q, parts, "c").bytes == (
        quantized // 2 + 2_258_150_400 + 2 * 1_211_856_192)
    with pytest.raises(UsageError, match="group_size"):
        weight_bytes(q | {"group_size": 0}, parts, "c")
    proc = size(tmp_path, GPT_OSS_120B | {"quantization_config": {"quant_method": "hqq"}})
    assert proc.returncode == 2
    assert "quant_method 'hqq' is not one kvtier size reads" in proc.stderr
    assert "--weights" in proc.stderr and proc.stdout == ""
    ok = size(tmp_path, GPT_OSS_120B | {"quantization_config": {"quant_method": "hqq"}},
              "--weights", "70GB")
    assert ok.returncode == 0, ok.stderr
