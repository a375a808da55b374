"""Parse a Hugging Face `config.json` into a `ModelSpec`, reading it the way vLLM 0.32 does (pure:
no files, no network, no transformers; `kvtier.commands.size.read_hf_config` reads a local file
or model directory through it).

A config.json holds only the fields its model's author set; transformers fills the rest from the
config class's defaults, and vLLM then decides each layer's cache kind in the model's code. Both
steps are reproduced here, field by field, from the installed sources they come from:

- Absent fields take the class default of transformers 5.19 `configuration_<type>.py`
  (`CLASS_DEFAULTS`, checked against the installed classes in tests/test_hfconfig.py); a field
  set to null stays null. An unknown `model_type` with no `tie_word_embeddings` is read as tied
  (transformers' `PretrainedConfig` default).
- Layer kinds (vLLM 0.32 `model_executor/models/*.py`):
  gpt_oss      even layers slide (`layer_idx % 2 == 0`), whatever `layer_types` says
  gemma2       `layer_types`, else transformers' rule: layer i slides when (i + 1) % 2 != 0
  gemma3(_text) `layer_types`, else `sliding_window_pattern` p (default 6): slides when
               (i + 1) % p != 0; `use_bidirectional_attention` halves the window (W // 2 + 1)
  qwen2/qwen3 (and _moe) the window applies only with `use_sliding_window`; vLLM then gives every
               layer the model-level window, and refuses (an assertion in qwen2.py) when
               `max_window_layers` < `num_hidden_layers` would mix kinds
  qwen3_next   `layer_types`, else every `full_attention_interval`-th (default 4) layer is full and
               the rest Gated DeltaNet linear attention, whose per-sequence state is
               conv (kernel - 1) x (2 x k_heads x k_dim + v_heads x v_dim) + v_heads x v_dim x
               k_dim elements (vLLM `mamba_utils.gated_delta_net_state_shape`), in the model dtype
               (`gated_delta_net_state_dtype` with mamba_cache_dtype "auto")
  llama4       `no_rope_layers` (default: every 4th layer is NoPE/global); the others are chunked
               local attention (`attention_chunk_size`, default 8192). vLLM turns its hybrid KV
               cache manager off for chunked local attention unless
               VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1, so they are allocated as full
               layers: read as full, with the chunked count kept in `ConfigReading.chunked_layers`
  others       `layer_types` (full_attention / sliding_attention, llama.py), else the model-level
               `sliding_window` on every layer (Mistral), else full; DeepSeek MLA
               (`kv_lora_rank`, `qk_rope_head_dim`) on every layer
- A multimodal wrapper's `text_config` is merged over the top level.

Anything unreadable, incomplete or of an unsupported kind (e.g. Mamba layers) raises `UsageError`
naming the file and the field.

Parameter counts are not in config.json; they are estimated from the dimensions (embeddings,
attention incl. MLA, biases and q/k norms, Gated DeltaNet, dense or MoE SwiGLU MLPs, norms). The
estimate reproduces the published totals of the presets and of the families above
(tests/test_presets.py, tests/test_hfconfig.py); it ignores rarer extras (MTP layers, vision
towers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError
from kvtier.core.layout import LayerSpec
from kvtier.core.presets import ModelSpec

CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"tie_word_embeddings": True, "sliding_window": 4096, "head_dim": 256},
    "gemma3_text": {"tie_word_embeddings": True, "sliding_window": 4096, "head_dim": 256},
    "gpt_oss": {"tie_word_embeddings": False, "sliding_window": 128, "head_dim": 64},
    "qwen2": {
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "qwen2_moe": {
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "qwen3": {
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "head_dim": 128,
    },
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "use_sliding_window": False,
    },
    "qwen3_next": {
        "tie_word_embeddings": False,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
    "mistral": {"tie_word_embeddings": False, "sliding_window": 4096},
    "mixtral": {"tie_word_embeddings": False, "sliding_window": None},
    "llama": {"tie_word_embeddings": False},
    "llama4_text": {
        "tie_word_embeddings": False,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
    },
    "deepseek_v3": {"tie_word_embeddings": False},
}
"""Class defaults of transformers 5.19 for the fields read here, by `model_type` (a field a
config.json omits takes these; tests/test_hfconfig.py compares them with the installed classes)."""

_UNKNOWN_TYPE_DEFAULTS: dict[str, Any] = {"tie_word_embeddings": True}
_QWEN_WINDOWED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


class ParamParts(NamedTuple):
    """A model's weights by what quantization methods treat differently (counts, all ranks):
    `linear` the projections of attention, dense MLPs and shared experts; `experts` the routed
    experts' weight matrices; `embeddings` the input table and an untied output head; `other`
    norms, biases, routers and attention sinks (never quantized)."""

    linear: int = 0
    experts: int = 0
    embeddings: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.experts + self.embeddings + self.other


@dataclass(frozen=True, slots=True)
class ConfigReading:
    """A config read the vLLM way: the spec, and what the spec alone cannot say.

    `rules`: one line per decision that is not a plain copy of a field (defaults taken, layer-kind
    rules applied), each naming where it comes from. `chunked_layers`/`chunk_size`: Llama 4's
    chunked-local layers, read as full (see the module docstring). `state_dtype_bytes`: element
    size of linear-attention state (0 when there is none).
    """

    spec: ModelSpec
    model_type: str
    rules: tuple[str, ...]
    chunked_layers: int = 0
    chunk_size: int = 0
    state_dtype_bytes: int = 0
    params: ParamParts = ParamParts(0, 0, 0, 0)  # noqa: RUF009 (an immutable tuple)
    """The parameter estimate by kind of weight (sums to `spec.total_params`)."""
    quantization: Mapping[str, Any] | None = None
    """The config's `quantization_config` (None when the checkpoint is not quantized)."""


class _Config:
    def __init__(self, path: str, doc: Mapping[str, Any]) -> None:
        self.path = path
        self.doc = doc
        self.model_type = str(doc.get("model_type") or "")
        self.defaults = CLASS_DEFAULTS.get(self.model_type, _UNKNOWN_TYPE_DEFAULTS)
        self.rules: list[str] = []

    def get(self, *names: str) -> Any:
        for name in names:
            if self.doc.get(name) is not None:
                return self.doc[name]
        return None

    def field(self, name: str) -> Any:
        """The field as transformers sees it: the config's value (null included), else the
        class default of this model_type (noted in `rules`), else None."""
        if name in self.doc:
            return self.doc[name]
        if name in self.defaults:
            value = self.defaults[name]
            where = (
                f"transformers' {self.model_type} config default"
                if self.model_type in CLASS_DEFAULTS
                else "transformers' PretrainedConfig default (unknown model_type)"
            )
            self.rules.append(f"{name} absent: {json.dumps(value)} ({where})")
            return value
        return None

    def count(self, *names: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(*names)
        if value is None:
            for name in names:
                fallback = self.field(name)
                if fallback is not None:
                    value = fallback
                    break
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
    return read_config(doc, path, default_name).spec


def read_config(
    doc: Mapping[str, Any], path: str = "config.json", default_name: str = "custom",
) -> ConfigReading:
    """`spec_from_config` with the decisions behind it (`ConfigReading`)."""
    c = _Config(path, doc)
    layers = c.count("num_hidden_layers", "n_layer", "num_layers")
    hidden = c.count("hidden_size", "n_embd", "d_model")
    heads = c.count("num_attention_heads", "n_head")
    kv_heads = c.count("num_key_value_heads", default=heads)
    v_head_dim = 0
    chunked = chunk = state_bytes = 0
    if c.get("kv_lora_rank") is not None:
        rope = c.count("qk_rope_head_dim")
        nope = c.count("qk_nope_head_dim")
        head_dim = nope + rope
        v_head_dim = c.count("v_head_dim", default=nope)
        kinds: tuple[LayerSpec, ...] = (LayerSpec.mla(c.count("kv_lora_rank"), rope),) * layers
    else:
        head_dim = _head_dim(c, hidden, heads)
        if c.model_type == "qwen3_next":
            state_bytes = _dtype_bytes(c)
            kinds = _qwen3_next_kinds(c, layers, state_bytes)
        elif c.model_type == "llama4_text":
            kinds, chunked, chunk = _llama4_kinds(c, layers)
        else:
            kinds = _layer_kinds(c, layers)
    vocab = c.count("vocab_size")
    parts, active = _estimate(c, layers, hidden, heads, kv_heads, head_dim, vocab)
    total = parts.total
    quant = doc.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise UsageError(f"{path}: 'quantization_config' must be a JSON object, got {quant!r}")
    inter, experts = _mlp_shape(c, hidden)
    name = str(c.get("_name_or_path") or default_name or "custom")
    spec = ModelSpec(
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
        intermediate_size=inter,
        active_experts=experts,
    )
    rules = tuple(dict.fromkeys(c.rules))
    return ConfigReading(spec, c.model_type, rules, chunked, chunk, state_bytes, parts, quant)


def _mlp_shape(c: _Config, hidden: int) -> tuple[int, int]:
    """(MLP width, experts per token): the expert width and routed + shared experts for MoE."""
    inter = c.count("intermediate_size", default=4 * hidden)
    experts = c.count("num_local_experts", "num_experts", "n_routed_experts", default=0, minimum=0)
    if not experts:
        return inter, 0
    k = c.count("num_experts_per_tok", "experts_per_token")
    k += c.count("n_shared_experts", default=0, minimum=0)
    if c.model_type == "llama4_text" or c.get("shared_expert_intermediate_size"):
        k += 1
    return c.count("moe_intermediate_size", default=inter), k


def _head_dim(c: _Config, hidden: int, heads: int) -> int:
    value = c.get("head_dim")
    if value is None:
        value = c.field("head_dim")
    if value is None:
        if hidden % heads:
            raise UsageError(f"{c.path}: hidden_size {hidden} is not a multiple of {heads} heads")
        return hidden // heads
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{c.path}: 'head_dim' must be an integer >= 1, got {value!r}")
    return value


def _window(c: _Config) -> int | None:
    value = c.field("sliding_window")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{c.path}: 'sliding_window' must be an integer >= 0, got {value!r}")
    if value == 0:
        c.rules.append("sliding_window 0 means no window (vLLM config/model.py)")
        return None
    return value


def _from_types(c: _Config, types: Any, layers: int, window: int | None) -> tuple[LayerSpec, ...]:
    if not isinstance(types, list) or len(types) != layers:
        raise UsageError(f"{c.path}: layer_types must list one type per layer ({layers})")
    out = []
    for t in types:
        if t == "full_attention":
            out.append(LayerSpec.full())
        elif t == "sliding_attention":
            if window is None:
                raise UsageError(f"{c.path}: sliding_attention layers need 'sliding_window'")
            out.append(LayerSpec.sliding(window))
        else:
            raise UsageError(
                f"{c.path}: layer type {t!r} is not supported; describe the model with "
                f"flags (--layer-pattern ... --state-bytes ...)"
            )
    return tuple(out)


def _layer_kinds(c: _Config, layers: int) -> tuple[LayerSpec, ...]:
    mt = c.model_type
    types = c.get("layer_types")
    if mt == "gpt_oss":
        w = _window(c)
        if w is None:
            return (LayerSpec.full(),) * layers
        c.rules.append(
            f"gpt_oss: even layers slide (window {w}), odd are full, whatever layer_types says "
            "(vLLM gpt_oss.py: layer_idx % 2 == 0)"
        )
        return tuple(
            LayerSpec.sliding(w) if i % 2 == 0 else LayerSpec.full() for i in range(layers)
        )
    if mt in ("gemma2", "gemma3_text", "gemma3"):
        w = _window(c)
        if w is not None and mt != "gemma2" and c.get("use_bidirectional_attention"):
            c.rules.append(f"use_bidirectional_attention: window {w} // 2 + 1 (transformers)")
            w = w // 2 + 1
        if types is not None:
            return _from_types(c, types, layers, w)
        p = 2 if mt == "gemma2" else c.count("sliding_window_pattern", default=6)
        if w is None:
            return (LayerSpec.full(),) * layers
        c.rules.append(
            f"{mt}: no layer_types; layer i slides (window {w}) when (i + 1) % {p} != 0, else "
            f"full (transformers configuration_{mt.removesuffix('_text')}.py, used by vLLM)"
        )
        return tuple(
            LayerSpec.sliding(w) if (i + 1) % p else LayerSpec.full() for i in range(layers)
        )
    if mt in _QWEN_WINDOWED:
        if not c.field("use_sliding_window"):
            if c.get("sliding_window") is not None:
                c.rules.append(
                    f"{mt}: sliding_window ignored, use_sliding_window is false (transformers)"
                )
            return (LayerSpec.full(),) * layers
        w = _window(c)
        if w is None:
            return (LayerSpec.full(),) * layers
        first = c.count("max_window_layers", default=layers, minimum=0)
        mixed = len(set(types)) > 1 if isinstance(types, list) else first < layers
        if mixed:
            raise UsageError(
                f"{c.path}: sliding window on some layers only (max_window_layers {first} < "
                f"{layers} layers) is refused by vLLM 0.32 (qwen2.py asserts it)"
            )
        c.rules.append(f"{mt}: use_sliding_window: every layer slides, window {w} (vLLM qwen2.py)")
        return (LayerSpec.sliding(w),) * layers
    w = _window(c)
    if types is not None:
        return _from_types(c, types, layers, w)
    if w is None:
        return (LayerSpec.full(),) * layers
    if c.get("sliding_window_pattern") is not None:
        n = c.count("sliding_window_pattern")
        c.rules.append(f"sliding_window_pattern {n}: every {n}th layer full, the others slide")
        return tuple(
            LayerSpec.full() if (i + 1) % n == 0 else LayerSpec.sliding(w) for i in range(layers)
        )
    c.rules.append(f"model-level sliding_window {w} on every layer (vLLM attention.py)")
    return (LayerSpec.sliding(w),) * layers


def _dtype_bytes(c: _Config) -> int:
    name = c.get("torch_dtype", "dtype")
    size = _DTYPE_BYTES.get(str(name).removeprefix("torch.")) if name is not None else None
    if size is None:
        c.rules.append("state dtype: bf16 (config names no dtype)")
        return 2
    if size == 4:
        c.rules.append("state dtype: float32 checkpoint, state in bf16 as vLLM's dtype 'auto'")
        return 2
    return size


def _qwen3_next_kinds(c: _Config, layers: int, elem: int) -> tuple[LayerSpec, ...]:
    types = c.get("layer_types")
    if types is None:
        n = c.count("full_attention_interval", default=4)
        c.rules.append(
            f"qwen3_next: no layer_types; layer i is full when (i + 1) % {n} == 0, else linear "
            "attention (transformers configuration_qwen3_next.py)"
        )
        types = [
            "full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers)
        ]
    if not isinstance(types, list) or len(types) != layers:
        raise UsageError(f"{c.path}: layer_types must list one type per layer ({layers})")
    kernel = c.count("linear_conv_kernel_dim")
    k_heads, v_heads = c.count("linear_num_key_heads"), c.count("linear_num_value_heads")
    k_dim, v_dim = c.count("linear_key_head_dim"), c.count("linear_value_head_dim")
    if v_heads % k_heads:
        raise UsageError(f"{c.path}: linear_num_value_heads must be a multiple of the key heads")
    conv = (kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
    temporal = v_heads * v_dim * k_dim
    state = (conv + temporal) * elem
    c.rules.append(
        f"Gated DeltaNet state per layer: ({kernel} - 1) x (2 x {k_heads} x {k_dim} + {v_heads} x "
        f"{v_dim}) + {v_heads} x {v_dim} x {k_dim} = {conv + temporal:,} elements x {elem} B = "
        f"{state:,} B, split over {k_heads} heads under TP (vLLM mamba_utils.py)"
    )
    out = []
    for t in types:
        if t == "full_attention":
            out.append(LayerSpec.full())
        elif t == "linear_attention":
            out.append(LayerSpec.recurrent(state, k_heads))
        else:
            raise UsageError(f"{c.path}: qwen3_next layer type {t!r} is not supported")
    return tuple(out)


def _llama4_kinds(c: _Config, layers: int) -> tuple[tuple[LayerSpec, ...], int, int]:
    chunk = c.field("attention_chunk_size")
    nope = c.get("no_rope_layers")
    if not nope:
        n = c.count("no_rope_layer_interval", default=4)
        nope = [int((i + 1) % n != 0) for i in range(layers)]
    if not isinstance(nope, list) or len(nope) != layers:
        raise UsageError(f"{c.path}: no_rope_layers must list one flag per layer ({layers})")
    chunked = sum(1 for x in nope if x) if chunk else 0
    if chunked:
        c.rules.append(
            f"llama4: {chunked} of {layers} layers are chunked local attention ({chunk} tokens); "
            "vLLM allocates them as full layers (hybrid KV cache manager off for chunked local "
            "attention by default, config/vllm.py)"
        )
    return (LayerSpec.full(),) * layers, chunked, int(chunk or 0)


def estimate_params(
    c: _Config, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> tuple[int, int]:
    """(total, active) parameters from the config's dimensions; see `kvtier.core.presets`."""
    parts, active = _estimate(c, layers, hidden, heads, kv_heads, head_dim, vocab)
    return parts.total, active


def _estimate(
    c: _Config, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> tuple[ParamParts, int]:
    """The total by kind of weight (`ParamParts`), and the active count."""
    mt = c.model_type
    bias = 1 if c.get("attention_bias") else 0
    if c.get("kv_lora_rank") is not None:
        rank, rope = c.count("kv_lora_rank"), c.count("qk_rope_head_dim")
        nope = c.count("qk_nope_head_dim")
        v_dim = c.count("v_head_dim", default=nope)
        q_rank = c.get("q_lora_rank")
        q = hidden * heads * (nope + rope)
        small = rank  # kv_a_layernorm
        if q_rank:
            q = hidden * q_rank + q_rank * heads * (nope + rope)
            small += q_rank  # q_a_layernorm
        attn_w = q + hidden * (rank + rope) + rank * heads * (nope + v_dim)
        attn_w += heads * v_dim * hidden
    else:
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        gate = q_out if mt == "qwen3_next" else 0  # gated attention: q_proj also emits a gate
        attn_w = hidden * (q_out + gate + 2 * kv_out) + q_out * hidden
        small = bias * (q_out + 2 * kv_out + hidden)
        if mt in ("qwen2", "qwen2_moe"):
            small += q_out + 2 * kv_out  # q, k, v biases (hard-coded in Qwen2)
        if mt in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "gemma3"):
            small += 2 * head_dim  # q_norm, k_norm
        if mt == "gpt_oss":
            small += heads  # attention sinks
    attn = attn_w + small
    norms = (4 if mt in ("gemma2", "gemma3_text", "gemma3") else 2) * hidden
    inter = c.count("intermediate_size", default=4 * hidden)
    experts = c.count("num_local_experts", "num_experts", "n_routed_experts", default=0, minimum=0)
    dense_mlp = 3 * hidden * inter
    linear = _gated_deltanet_params(c, hidden) if mt == "qwen3_next" else 0
    types = _mixer_types(c, layers)
    n_linear = sum(types)
    n_attn = layers - n_linear
    parts = ParamParts(
        linear=n_attn * attn_w + n_linear * linear,
        other=n_attn * small + layers * norms,
    )
    active = 0
    if experts:
        moe_inter = c.count("moe_intermediate_size", default=inter)
        expert_w = 3 * hidden * moe_inter
        per_expert = expert_w + (2 * moe_inter + hidden if mt == "gpt_oss" else 0)
        top_k = c.count("num_experts_per_tok", "experts_per_token")
        shared = c.count("n_shared_experts", default=0, minimum=0) * expert_w
        shared_inter = c.count("shared_expert_intermediate_size", default=0, minimum=0)
        if shared_inter:
            shared += 3 * hidden * shared_inter + hidden
        if mt == "llama4_text":
            shared += 3 * hidden * inter  # one shared expert of intermediate_size
        router = hidden * experts + (experts if mt == "gpt_oss" else 0)
        if c.get("topk_method") == "noaux_tc":
            router += experts
        dense_first = c.count("first_k_dense_replace", default=0, minimum=0)
        dense_inter = c.count("intermediate_size_mlp", default=inter)
        moe_step = c.count("interleave_moe_layer_step", default=1)
        for i in range(layers):
            common = (linear if types[i] else attn) + norms
            if i < dense_first or (mt == "llama4_text" and (i + 1) % moe_step):
                mlp = 3 * hidden * dense_inter if mt == "llama4_text" else dense_mlp
                active += common + mlp
                parts = parts._replace(linear=parts.linear + mlp)
            else:
                active += common + top_k * per_expert + shared + router
                parts = parts._replace(
                    linear=parts.linear + shared,
                    experts=parts.experts + experts * expert_w,
                    other=parts.other + experts * (per_expert - expert_w) + router,
                )
    else:
        active = n_attn * attn + n_linear * linear + layers * (norms + dense_mlp)
        parts = parts._replace(linear=parts.linear + layers * dense_mlp)
    embed = vocab * hidden
    tied = c.field("tie_word_embeddings")
    head = 0 if tied else vocab * hidden
    active += head + hidden if head else embed + hidden
    return parts._replace(embeddings=embed + head, other=parts.other + hidden), active


def _mixer_types(c: _Config, layers: int) -> list[bool]:
    """True for layers whose token mixer is linear attention (Qwen3-Next), per layer."""
    if c.model_type != "qwen3_next":
        return [False] * layers
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [t == "linear_attention" for t in types]
    n = c.count("full_attention_interval", default=4)
    return [(i + 1) % n != 0 for i in range(layers)]


def _gated_deltanet_params(c: _Config, hidden: int) -> int:
    """One Gated DeltaNet layer (transformers Qwen3NextGatedDeltaNet): in_proj_qkvz, in_proj_ba,
    a depthwise conv1d without bias, dt_bias and A_log, a gated RMSNorm over v_dim, out_proj."""
    kernel = c.count("linear_conv_kernel_dim")
    k_heads, v_heads = c.count("linear_num_key_heads"), c.count("linear_num_value_heads")
    k_dim, v_dim = c.count("linear_key_head_dim"), c.count("linear_value_head_dim")
    key, value = k_heads * k_dim, v_heads * v_dim
    conv_dim = 2 * key + value
    return (
        hidden * (2 * key + 2 * value)
        + hidden * 2 * v_heads
        + conv_dim * kernel
        + 2 * v_heads
        + v_dim
        + value * hidden
    )
