"""kvtier size's model of vLLM 0.32 checked against vLLM's own code (imported, no engine): the
Gated DeltaNet state, the KV cache group split, align-mode state pages and the hybrid manager's
promotion of windows when it is off. Skipped where vLLM is not installed."""

from types import SimpleNamespace

import pytest

from kvtier.core.hfconfig import spec_from_config
from kvtier.core.layout import AttentionKind, KVLayout, LayerSpec
from kvtier.core.sizing import kv_groups, window_saving
from tests.test_hfconfig import GEMMA3_27B, QWEN3_NEXT, merged

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    _get_kv_cache_groups_uniform_page_size,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def vllm_specs(layout: KVLayout) -> dict:
    out = {}
    for i, layer in enumerate(layout.layers):
        common = {
            "block_size": layout.block_tokens,
            "num_kv_heads": layout.kv_heads_per_rank,
            "head_size": layout.head_dim,
            "dtype": torch.bfloat16,
        }
        if layer.kind is AttentionKind.SLIDING:
            out[f"layers.{i}"] = SlidingWindowSpec(**common, sliding_window=layer.window)
        else:
            out[f"layers.{i}"] = FullAttentionSpec(**common)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_deltanet_state_matches_vllm(tp):
    spec = spec_from_config(QWEN3_NEXT)
    ours = spec.layout(tp_size=tp)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto")
    theirs = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=16)
    rec = next(x for x in ours.layers if x.kind is AttentionKind.RECURRENT)
    assert ours.layer_state_bytes(rec) == theirs.page_size_bytes
    # align mode holds 2 state pages per request (kvtier's state_pages=2), none holds 1
    align = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="align"))
    none = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    assert theirs.max_memory_usage_bytes(align) == 2 * theirs.page_size_bytes
    assert theirs.max_memory_usage_bytes(none) == theirs.page_size_bytes


@pytest.mark.parametrize(
    "layers",
    [
        # Gemma-3-27B (52 sliding + 10 full), gpt-oss-20b (12 + 12), 12 sliding + 13 full
        tuple(spec_from_config(merged(GEMMA3_27B)).layers),
        tuple([LayerSpec.sliding(128), LayerSpec.full()] * 12),
        (LayerSpec.sliding(128),) * 12 + (LayerSpec.full(),) * 13,
    ],
)
def test_group_split_matches_vllm(layers):
    layout = KVLayout(layers, 8, 128)
    groups = _get_kv_cache_groups_uniform_page_size(vllm_specs(layout))
    theirs = sorted(
        (isinstance(g.kv_cache_spec, SlidingWindowSpec), len(g.layer_names)) for g in groups
    )
    ours = sorted((g.spec.kind is AttentionKind.SLIDING, g.layers) for g in kv_groups(layout))
    assert ours == theirs


def test_hybrid_manager_off_promotes_mixed_windows_only():
    mixed = KVLayout((LayerSpec.sliding(128), LayerSpec.full()) * 4, 8, 64)
    specs = vllm_specs(mixed)
    unify_hybrid_kv_cache_specs(specs)
    assert not any(isinstance(s, SlidingWindowSpec) for s in specs.values())
    assert window_saving(mixed, 4096).hybrid_off_bytes == window_saving(mixed, 4096).all_full_bytes
    sliding = KVLayout((LayerSpec.sliding(128),) * 8, 8, 64)
    specs = vllm_specs(sliding)
    unify_hybrid_kv_cache_specs(specs)
    assert all(isinstance(s, SlidingWindowSpec) for s in specs.values())
    s = window_saving(sliding, 4096)
    assert s.hybrid_off_bytes == s.hybrid_bytes < s.all_full_bytes
