"""Parse a Hugging Face `config.json` into a `ModelSpec` (pure: no files, no network, no
transformers; `kvtier.commands.size.read_hf_config` reads a local file through it).

Understood: Llama/Qwen/Mistral-style decoders (`num_key_value_heads`, `head_dim`), per-layer
`layer_types` (full_attention / sliding_attention, as in gpt-oss and Gemma 3), Mistral's global
`sliding_window`, Qwen2's `use_sliding_window` + `max_window_layers`, Gemma 2's
`sliding_window_pattern`, DeepSeek MLA (`kv_lora_rank`, `qk_rope_head_dim`), multimodal
wrappers with a `text_config`, and MoE fields for the parameter estimate. Anything unreadable,
incomplete or of an unsupported kind (e.g. linear-attention layers, whose state size the config
does not state portably) raises `UsageError` naming the file and the field.

Parameter counts are not in config.json; they are estimated from the dimensions (embeddings,
attention incl. MLA and biases, dense or MoE SwiGLU MLPs, norms). The estimate reproduces the
published totals of the presets (tests/test_presets.py); it ignores rarer extras.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvtier.core.errors import UsageError
from kvtier.core.layout import LayerSpec
from kvtier.core.presets import ModelSpec


class _Config:
    def __init__(self, path: str, doc: Mapping[str, Any]) -> None:
        self.path = path
        self.doc = doc

    def get(self, *names: str) -> Any:
        for name in names:
            if self.doc.get(name) is not None:
                return self.doc[name]
        return None

    def count(self, *names: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(*names)
        if value is None:
            if default is not None:
                return default
            raise UsageError(f"{self.path}: config lacks {names[0]!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UsageError(
                f"{self.path}: {names[0]!r} must be an integer >= {minimum}, got {value!r}"
            )
        return value


def parse_config(text: str, path: str = "config.json") -> dict[str, Any]:
    """The config text as a dict, with a multimodal `text_config` merged over the top level.
    `path` only names the file in error messages."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"config {path!r} is not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(doc, dict):
        raise UsageError(f"config {path!r} must hold a JSON object")
    inner = doc.get("text_config")
    if isinstance(inner, dict):
        doc = {**doc, **inner}
    return doc


def spec_from_config(
    doc: Mapping[str, Any], path: str = "config.json", default_name: str = "custom",
) -> ModelSpec:
    """Build a `ModelSpec` from a parsed config (see module docstring for what is understood);
    it is named by `_name_or_path`, else `default_name` (a reader passes the file's folder)."""
    c = _Config(path, doc)
    layers = c.count("num_hidden_layers", "n_layer", "num_layers")
    hidden = c.count("hidden_size", "n_embd", "d_model")
    heads = c.count("num_attention_heads", "n_head")
    kv_heads = c.count("num_key_value_heads", default=heads)
    v_head_dim = 0
    if c.get("kv_lora_rank") is not None:
        rope = c.count("qk_rope_head_dim")
        nope = c.count("qk_nope_head_dim")
        head_dim = nope + rope
        v_head_dim = c.count("v_head_dim", default=nope)
        kinds = (LayerSpec.mla(c.count("kv_lora_rank"), rope),) * layers
    else:
        if c.get("head_dim") is None and hidden % heads:
            raise UsageError(f"{path}: hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = c.count("head_dim", default=hidden // heads)
        kinds = _layer_kinds(c, layers)
    vocab = c.count("vocab_size")
    total, active = estimate_params(c, layers, hidden, heads, kv_heads, head_dim, vocab)
    name = str(c.get("_name_or_path") or default_name or "custom")
    return ModelSpec(
        name=name,
        hf_repo=str(c.get("_name_or_path") or ""),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        layers=kinds,
        total_params=total,
        active_params=active,
        vocab_size=vocab,
    )


def _layer_kinds(c: _Config, layers: int) -> tuple[LayerSpec, ...]:
    types = c.get("layer_types")
    window = c.get("sliding_window")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise UsageError(f"{c.path}: layer_types must list one type per layer ({layers})")
        out = []
        for t in types:
            if t == "full_attention":
                out.append(LayerSpec.full())
            elif t == "sliding_attention":
                out.append(LayerSpec.sliding(c.count("sliding_window")))
            else:
                raise UsageError(
                    f"{c.path}: layer type {t!r} is not supported; describe the model with "
                    f"flags (--layer-pattern ... --state-bytes ...)"
                )
        return tuple(out)
    if window is None or c.get("use_sliding_window") is False:
        return (LayerSpec.full(),) * layers
    w = c.count("sliding_window")
    pattern = c.get("sliding_window_pattern")
    if pattern is not None:
        n = c.count("sliding_window_pattern")
        return tuple(
            LayerSpec.full() if i % n == n - 1 else LayerSpec.sliding(w) for i in range(layers)
        )
    if c.get("use_sliding_window") is True:
        first = c.count("max_window_layers", default=0, minimum=0)
        return tuple(
            LayerSpec.sliding(w) if i >= first else LayerSpec.full() for i in range(layers)
        )
    return (LayerSpec.sliding(w),) * layers


def estimate_params(
    c: _Config, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> tuple[int, int]:
    """(total, active) parameters from the config's dimensions; see `kvtier.core.presets`."""
    bias = 1 if c.get("attention_bias") else 0
    if c.get("kv_lora_rank") is not None:
        rank, rope = c.count("kv_lora_rank"), c.count("qk_rope_head_dim")
        nope = c.count("qk_nope_head_dim")
        v_dim = c.count("v_head_dim", default=nope)
        q_rank = c.get("q_lora_rank")
        q = hidden * heads * (nope + rope)
        if q_rank:
            q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        attn = q + hidden * (rank + rope) + rank + rank * heads * (nope + v_dim)
        attn += heads * v_dim * hidden
    else:
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        attn = hidden * (q_out + 2 * kv_out) + q_out * hidden
        attn += bias * (q_out + 2 * kv_out + hidden)
        if c.get("model_type") in ("qwen3", "qwen3_moe"):
            attn += 2 * head_dim
        if c.get("model_type") == "gpt_oss":
            attn += heads
    norms = 2 * hidden
    inter = c.count("intermediate_size", default=4 * hidden)
    experts = c.count("num_local_experts", "num_experts", "n_routed_experts", default=0, minimum=0)
    dense_mlp = 3 * hidden * inter
    total = active = 0
    if experts:
        moe_inter = c.count("moe_intermediate_size", default=inter)
        per_expert = 3 * hidden * moe_inter
        if c.get("model_type") == "gpt_oss":
            per_expert += 2 * moe_inter + hidden
        top_k = c.count("num_experts_per_tok", "experts_per_token")
        shared = c.count("n_shared_experts", default=0, minimum=0) * per_expert
        shared_inter = c.count("shared_expert_intermediate_size", default=0, minimum=0)
        if shared_inter:
            shared += 3 * hidden * shared_inter + hidden
        router = hidden * experts + (experts if c.get("model_type") == "gpt_oss" else 0)
        if c.get("topk_method") == "noaux_tc":
            router += experts
        dense_first = c.count("first_k_dense_replace", default=0, minimum=0)
        for i in range(layers):
            common = attn + norms
            if i < dense_first:
                total += common + dense_mlp
                active += common + dense_mlp
            else:
                total += common + experts * per_expert + shared + router
                active += common + top_k * per_expert + shared + router
    else:
        total = active = layers * (attn + norms + dense_mlp)
    embed = vocab * hidden
    head = 0 if c.get("tie_word_embeddings") else vocab * hidden
    total += embed + head + hidden
    active += head + hidden if head else embed + hidden
    return total, active
