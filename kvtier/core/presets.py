"""Model presets: the layout-relevant part of published configs plus parameter counts.

A `ModelSpec` is what the sizing command and the fetch-vs-recompute planner need to know about a
model; `.layout(...)` turns it into the `KVLayout` of one TP rank. Values come from each model's
published Hugging Face `config.json`; parameter counts are derived from those dimensions and match
the published totals (see tests/test_presets.py, where each count is re-derived by hand).

Parameter-count convention:
- `total_params`: every weight, embeddings included (what is loaded into memory).
- `active_params`: weights one token's forward pass multiplies: the routed experts it uses, the
  shared ones, attention and the output projection, but not the input embedding table (a lookup).
  This is the convention of the published "active" counts of gpt-oss and DeepSeek-V3, applied to
  dense models too (there it is total - vocab x hidden); prefill FLOPs/token ~ 2 x active_params.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.errors import UsageError
from kvtier.core.layout import AttentionKind, DType, KVLayout, LayerSpec, alternating


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's KV-relevant architecture. Pure data; `layout()` validates TP against it.

    `head_dim` is the query/key head dimension (MLA: qk_nope + qk_rope); `v_head_dim` the value
    head dimension (equal to head_dim except for MLA). `intermediate_size` is the MLP width (an
    expert's for MoE) and `active_experts` the experts one token passes through (routed top-k
    plus shared; 0 = dense); they size activations (`kvtier.core.gpumem`), 0 = unknown. For
    FULL/SLIDING layers a token stores K and V of `num_kv_heads` heads of `head_dim`; MLA layers
    carry their own latent dims.
    """

    name: str
    hf_repo: str
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    total_params: int
    active_params: int
    vocab_size: int
    v_head_dim: int = 0
    intermediate_size: int = 0
    active_experts: int = 0

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{field} must be a positive integer, got {value!r}")
        if not self.layers:
            raise UsageError("a model needs at least one layer")
        if self.num_attention_heads % self.num_kv_heads:
            raise UsageError(
                f"{self.num_attention_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.active_params > self.total_params or self.active_params < 0:
            raise UsageError("active parameters must be between 0 and the total")
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return self.active_params < self.total_params - self.vocab_size * self.hidden_size

    @property
    def d_attn(self) -> int:
        """Attention width for the Kaplan term 2·L·d_attn·context (FLOPs/token).

        heads x (qk_dim + v_dim) / 2: QK^T multiplies head_dim per head, AV v_head_dim; for
        ordinary attention this is num_attention_heads x head_dim.
        """
        return self.num_attention_heads * (self.head_dim + self.v_head_dim) // 2

    def layout(
        self,
        dtype: DType = DType.BF16,
        block_tokens: int = 16,
        tp_size: int = 1,
        tp_rank: int = 0,
        fp8_scale_bytes: int = 0,
    ) -> KVLayout:
        """The KV layout of rank `tp_rank` when the model is served with TP `tp_size`.

        Raises `UsageError` when TP cannot split the attention heads (vLLM requires
        num_attention_heads % tp == 0) or the KV heads (see `kvtier.core.layout.shards`).
        """
        if isinstance(tp_size, int) and tp_size >= 1 and self.num_attention_heads % tp_size:
            raise UsageError(
                f"TP size {tp_size} does not divide the {self.num_attention_heads} attention heads "
                f"of {self.name}"
            )
        return KVLayout(
            self.layers,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            block_tokens,
            tp_size,
            tp_rank,
            fp8_scale_bytes,
        )

    def window_of(self, layer: int) -> int | None:
        """Tokens layer `layer` attends to (None = the whole context)."""
        spec = self.layers[layer]
        return spec.window if spec.kind is AttentionKind.SLIDING else None


def _dense(n: int) -> tuple[LayerSpec, ...]:
    return (LayerSpec.full(),) * n


_PRESETS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in (
        ModelSpec(
            name="Llama-3-8B",
            hf_repo="meta-llama/Meta-Llama-3-8B",
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            layers=_dense(32),
            total_params=8_030_261_248,
            active_params=8_030_261_248 - 128_256 * 4096,
            vocab_size=128_256,
            intermediate_size=14336,
        ),
        ModelSpec(
            name="Llama-3-70B",
            hf_repo="meta-llama/Meta-Llama-3-70B",
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            layers=_dense(80),
            total_params=70_553_706_496,
            active_params=70_553_706_496 - 128_256 * 8192,
            vocab_size=128_256,
            intermediate_size=28672,
        ),
        ModelSpec(
            name="Qwen3-8B",
            hf_repo="Qwen/Qwen3-8B",
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            layers=_dense(36),
            total_params=8_190_735_360,
            active_params=8_190_735_360 - 151_936 * 4096,
            vocab_size=151_936,
            intermediate_size=12288,
        ),
        ModelSpec(
            name="Qwen3-32B",
            hf_repo="Qwen/Qwen3-32B",
            hidden_size=5120,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            layers=_dense(64),
            total_params=32_762_123_264,
            active_params=32_762_123_264 - 151_936 * 5120,
            vocab_size=151_936,
            intermediate_size=25600,
        ),
        ModelSpec(
            name="DeepSeek-V3",
            hf_repo="deepseek-ai/DeepSeek-V3",
            hidden_size=7168,
            num_attention_heads=128,
            num_kv_heads=128,
            head_dim=128 + 64,
            v_head_dim=128,
            layers=(LayerSpec.mla(kv_lora_rank=512, rope_dim=64),) * 61,
            total_params=671_026_419_200,
            active_params=36_625_618_432,
            vocab_size=129_280,
            intermediate_size=2048,
            active_experts=9,
        ),
        ModelSpec(
            name="Mistral-7B-v0.1",
            hf_repo="mistralai/Mistral-7B-v0.1",
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            layers=(LayerSpec.sliding(4096),) * 32,
            total_params=7_241_732_096,
            active_params=7_241_732_096 - 32_000 * 4096,
            vocab_size=32_000,
            intermediate_size=14336,
        ),
        ModelSpec(
            name="gpt-oss-20b",
            hf_repo="openai/gpt-oss-20b",
            hidden_size=2880,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=64,
            layers=alternating([LayerSpec.sliding(128), LayerSpec.full()], 24),
            total_params=20_914_757_184,
            active_params=3_608_307_264,
            vocab_size=201_088,
            intermediate_size=2880,
            active_experts=4,
        ),
        ModelSpec(
            name="gpt-oss-120b",
            hf_repo="openai/gpt-oss-120b",
            hidden_size=2880,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=64,
            layers=alternating([LayerSpec.sliding(128), LayerSpec.full()], 36),
            total_params=116_829_156_672,
            active_params=5_132_849_472,
            vocab_size=201_088,
            intermediate_size=2880,
            active_experts=4,
        ),
    )
}


def list_presets() -> list[str]:
    """Preset names in their canonical spelling."""
    return [m.name for m in _PRESETS.values()]


def get_preset(name: str) -> ModelSpec:
    """The preset called `name` (case-insensitive); unknown names raise `UsageError`."""
    try:
        return _PRESETS[name.strip().lower()]
    except KeyError:
        raise UsageError(f"unknown preset {name!r} (known: {', '.join(list_presets())})") from None
