"""Local checkpoints for the engine tests and benchmarks: a Hugging Face config dict in, a model
directory out (config.json + model.safetensors), with weights from the model's own initializer at
its normal scale (`initializer_range`, std 0.02 for Llama), so that an engine's output depends on
the context it attends to. Nothing is downloaded; the weights are a function of (config, seed).

    cfg = llama_config(layers=2, hidden=256)
    model = write_checkpoint(tmp / "llama", cfg, seed=0)   # vLLM loads it as any checkpoint

Why not vLLM's `load_format="dummy"`: it fills every weight, norms included, with uniform
±1e-3; at that scale attention's contribution is lost in bf16 rounding and the continuation is
the same whatever KV was loaded, so a test could not see wrong KV.

Generic over architectures: anything `transformers.AutoModelForCausalLM.from_config` builds
(`auto_class` names another Auto class, e.g. "AutoModelForImageTextToText" for multimodal
configs). `tests/conftest.py` caches checkpoints per test session (fixture `checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

DONE = ".kvtier-weights"
"""Written last: a directory without it is an interrupted write, rewritten."""


def llama_config(*, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 512, vocab: int = 1024, max_len: int = 8192,
                 rope_theta: float = 10000.0) -> dict[str, Any]:
    """A small Llama (default: the engine tests' 2 layers, hidden 256, 4 heads, 2 KV heads of
    64)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
            "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": max_len,
            "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
            "initializer_range": 0.02}


def config_digest(config: dict[str, Any], seed: int = 0) -> str:
    """A short name for (config, seed): the cache key of `tests/conftest.py`'s fixture."""
    text = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_checkpoint(path: Path, config: dict[str, Any], *, seed: int = 0,
                     auto_class: str = "AutoModelForCausalLM") -> Path:
    """Writes `config`'s model, initialized under torch seed `seed`, to `path` (created) and
    returns `path`. The dtype is the config's `torch_dtype` (default bfloat16). A complete
    checkpoint already at `path` (same config and seed) is kept as it is."""
    stamp = path / DONE
    key = config_digest(config, seed)
    if stamp.exists() and stamp.read_text() == key:
        return path
    import torch
    import transformers

    model_type = config["model_type"]
    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    hf = transformers.AutoConfig.for_model(model_type, **fields)
    dtype = getattr(torch, str(config.get("torch_dtype", "bfloat16")))
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(hf, dtype=torch.float32)
    model = model.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    # save_pretrained writes transformers' view of the config; keep the caller's fields too
    # (vLLM reads config.json): theirs first, ours over them
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **config}, indent=1))
    stamp.write_text(key)
    return path
