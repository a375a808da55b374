"""The test models of shadow verification's benchmarks (`bench.verify_spread`, `bench.verify_fp`),
one per KV cache group kind, with what the connector's layout of each is (`EngineKV`):

    dense        the engine tests' Llama (2 layers, full attention; `tests.support.model_weights`)
    gemma3       3 sliding-window layers : 1 full (`tests.support.hybrid_models`; 4 groups)
    mistral-swa  a sliding window on every layer (1 sliding group)
    qwen3-next   3 Gated DeltaNet linear-attention layers : 1 full (state groups; vLLM picks a
                 160-token block so one attention page holds a layer's state)

Weights from each model's own initializer (normal scale: the output depends on the KV), seed 0;
`other_weights` writes the same model at seed 1 (a wrong-KV control).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from tests.support.hybrid_models import MODELS, WINDOW, write_hybrid
from tests.support.model_weights import llama_config, write_checkpoint

NAMES = ("dense", "gemma3", "mistral-swa", "qwen3-next")
HYBRID_ARGS = {"disable_hybrid_kv_cache_manager": False}
QWEN_BLOCK = 160
QWEN_STATE = "3x512:bfloat16+4x64x64:float32"


class Model(NamedTuple):
    name: str
    path: Path
    block: int
    engine_args: dict[str, Any]
    stateful: bool


def config(name: str) -> dict[str, Any]:
    return llama_config() if name == "dense" else MODELS[name]


def write(root: Path, name: str, seed: int = 0) -> Model:
    """Model `name` under `root` (kept if already written)."""
    path = root / f"{name}-seed{seed}"
    if name == "dense":
        write_checkpoint(path, config(name), seed=seed)
    else:
        write_hybrid(path, name, seed=seed)
    block = QWEN_BLOCK if name == "qwen3-next" else 32
    args = {} if name == "dense" else dict(HYBRID_ARGS)
    if name == "qwen3-next":  # QWEN_BLOCK and QWEN_STATE: a float32 SSM state, whatever the CPU
        args["mamba_ssm_cache_dtype"] = "float32"  # ("auto" follows its ISA)
    return Model(name, path, block, args, name == "qwen3-next")


def engine_kv(name: str, model_id: str) -> Any:
    """The connector's layout of model `name` under `model_id` (needs vLLM installed)."""
    from kvtier.integrations.vllm.layout import EngineKV, Shard

    cfg = config(name)
    n = cfg["num_hidden_layers"]
    kvh, hd = cfg["num_key_value_heads"], cfg.get("head_dim", cfg["hidden_size"]
                                                   // cfg["num_attention_heads"])
    if name == "qwen3-next":
        names = (*(f"model.layers.{i}.linear_attn" for i in range(3)),
                 "model.layers.3.self_attn.attn")
        return EngineKV(model_id, "bfloat16", QWEN_BLOCK, names, QWEN_BLOCK * 2 * kvh * hd * 2,
                        kvh, hd, "cpu", Shard(0, 1, True), layer_groups=(0, 1, 2, 3),
                        windows=(0, 0, 0, 0), hash_tokens=QWEN_BLOCK,
                        states=(QWEN_STATE, QWEN_STATE, QWEN_STATE, ""))
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(n))
    page = 2 * 32 * kvh * hd * 2
    if name == "dense":
        return EngineKV(model_id, "bfloat16", 32, names, page, kvh, hd, "cpu",
                        Shard(0, 1, True))
    if name == "gemma3":
        groups = tuple(range(n))
        windows = tuple(WINDOW if t == "sliding_attention" else 0 for t in cfg["layer_types"])
    else:
        groups, windows = tuple([0] * n), (WINDOW,)
    return EngineKV(model_id, "bfloat16", 32, names, page, kvh, hd, "cpu", Shard(0, 1, True),
                    layer_groups=groups, windows=windows, hash_tokens=32)
