"""Capacity math (kvtier.core.sizing): worked examples, vLLM's window accounting, rounding laws."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.errors import UsageError
from kvtier.core.layout import KVLayout, LayerSpec, alternating
from kvtier.core.presets import get_preset
from kvtier.core.sizing import (
    GpuPool,
    Workload,
    cdiv,
    hybrid_block_tokens,
    kv_groups,
    page_bytes,
    pages_needed,
    plan_workload,
    sequence_pages,
    tier_capacity,
    window_saving,
)

LLAMA8 = get_preset("Llama-3-8B").layout()
OSS20 = get_preset("gpt-oss-20b").layout()


def test_llama3_8b_pool_on_80gib():
    weights = 8_030_261_248 * 2  # bf16 = 16,060,522,496 B
    pool = GpuPool(80 * 2**30, 0.9, weights)
    # 85,899,345,920 * 0.9 = 77,309,411,328; minus weights = 61,248,888,832 B
    assert pool.budget_bytes == 77_309_411_328
    assert pool.usable_bytes == 61_248_888_832
    # floor(61,248,888,832 / 2,097,152) = floor(29205.5...) = 29,205 pages
    assert pool.usable_bytes // page_bytes(LLAMA8) == 29_205


def test_llama3_8b_workload():
    plan = plan_workload(LLAMA8, 29_205, Workload(64, 2048, 512))
    # admission: ceil(2048/16) = 128 pages/seq, x64 = 8,192
    # full growth: ceil(2560/16) = 160 pages/seq, x64 = 10,240
    assert (plan.admission_pages_per_seq, plan.admission_pages) == (128, 8192)
    assert (plan.full_pages_per_seq, plan.full_growth_pages) == (160, 10_240)
    assert plan.admission_fits and plan.full_growth_fits
    # ceiling: floor(29,205 / 160) = 182; left at 64: 29,205 - 10,240 = 18,965
    assert plan.concurrency_ceiling == 182
    assert plan.pages_left_at_cap == 18_965


def test_rounding_is_per_sequence_not_on_the_sum():
    # 3 sequences of 17 tokens, 16-token pages: 2 pages each = 6; ceil(51/16) would say 4
    plan = plan_workload(LLAMA8, 100, Workload(3, 10, 7))
    assert plan.full_growth_pages == 6
    assert plan.full_pages_if_summed == 4


def test_shortfall_and_cap():
    plan = plan_workload(LLAMA8, 1000, Workload(10, 1600, 0, concurrency_cap=20))
    # 100 pages per sequence: 10 fit exactly, 20 would need 2,000 (1,000 short)
    assert plan.full_growth_fits and plan.concurrency_ceiling == 10
    assert plan.pages_left_at_cap == -1000
    assert not plan_workload(LLAMA8, 999, Workload(10, 1600, 0)).full_growth_fits


def test_gpt_oss_groups_and_page():
    groups = kv_groups(OSS20)
    assert [(g.spec.window, g.layers, g.group_size) for g in groups] == [(128, 12, 12), (0, 12, 12)]
    # one page = 16 tokens x 12 layers x (2 * 8 heads * 64 * 2 B = 2,048 B) = 393,216 B
    assert page_bytes(OSS20) == 16 * 12 * 2048 == 393_216


def test_window_caps_only_its_own_layers():
    # gpt-oss-20b, 2,560 tokens in decode: full group ceil(2560/16) = 160 pages;
    # sliding group min(160, ceil((128 - 1 + 1)/16) + 1) = 9 pages; total 169
    assert sequence_pages(OSS20, 2560, in_flight=1) == 169
    # prefill of 2,048 tokens in one step: the window group holds the whole chunk: 128 + 128
    assert sequence_pages(OSS20, 2048, in_flight=2048) == 256
    # with 512-token chunks: min(128, ceil((127 + 512)/16) + 1) = 41 -> 128 + 41
    assert sequence_pages(OSS20, 2048, in_flight=512) == 169
    # Mistral-7B (all layers sliding, 4096): 10,000 tokens in decode hold 257 pages, not 625
    assert sequence_pages(get_preset("Mistral-7B-v0.1").layout(), 10_000) == 257


def test_group_size_heuristic_matches_vllm():
    # 52 sliding + 10 full (Gemma-3-27B-like): 52 >= 1.5 * 10, group size 10 -> 6 + 1 groups;
    # vLLM deals the 52 out as layers[i::6]: 9, 9, 9, 9, 8, 8 (8 padding slots in all)
    layers = (LayerSpec.sliding(1024),) * 52 + (LayerSpec.full(),) * 10
    layout = KVLayout(layers, 16, 128)
    groups = kv_groups(layout)
    assert [g.layers for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    assert {g.group_size for g in groups} == {10}
    # 12 sliding + 13 full: 13 < 1.5 * 12, pad both to 13
    layout = KVLayout((LayerSpec.sliding(128),) * 12 + (LayerSpec.full(),) * 13, 8, 64)
    assert [(g.layers, g.group_size) for g in kv_groups(layout)] == [(12, 13), (13, 13)]


def test_recurrent_state_is_one_page_per_sequence_per_group():
    layers = alternating([LayerSpec.recurrent(4096)] * 3 + [LayerSpec.full()], 8)
    layout = KVLayout(layers, 4, 64)
    # buckets: 6 recurrent, 2 full -> group size 2: 3 recurrent groups + 1 full group;
    # 100 tokens: 3 * 1 + ceil(100/16) = 3 + 7 = 10 pages, whatever the length for the state
    assert sequence_pages(layout, 100) == 10
    assert sequence_pages(layout, 1000) == 3 + 63


def _vllm_window_blocks_held(prompt, output, window, block, chunk):
    """Replays vLLM's SlidingWindowManager: before each step, blocks wholly below
    (computed - window + 1) are freed; then blocks for the step's tokens are allocated.
    Yields (tokens after the step, tokens in flight, blocks held)."""
    computed = 0
    steps = []
    while computed < prompt:
        steps.append(min(chunk, prompt - computed))
        computed += steps[-1]
    steps += [1] * output
    computed = 0
    for step in steps:
        freed = max(0, computed - window + 1) // block
        computed += step
        yield computed, step, cdiv(computed, block) - freed


@given(
    prompt=st.integers(1, 600),
    output=st.integers(0, 200),
    window=st.integers(1, 300),
    block=st.sampled_from([1, 4, 16, 32]),
    chunk=st.integers(1, 700),
)
def test_window_formula_bounds_vllm_replay(prompt, output, window, block, chunk):
    layout = KVLayout((LayerSpec.sliding(window),), 1, 8, block_tokens=block)
    for tokens, in_flight, held in _vllm_window_blocks_held(prompt, output, window, block, chunk):
        assert held <= sequence_pages(layout, tokens, in_flight)


def test_window_formula_is_attained():
    # W = 128, B = 16, 129 tokens in decode: blocks 0..8 are held (token 1 still in window)
    layout = KVLayout((LayerSpec.sliding(128),), 1, 8, block_tokens=16)
    held = list(_vllm_window_blocks_held(128, 1, 128, 16, 128))[-1]
    assert held == (129, 1, 9) and sequence_pages(layout, 129, 1) == 9


lengths = st.lists(st.integers(0, 5000), min_size=1, max_size=50)


@given(lengths=lengths, block=st.integers(1, 64))
def test_per_sequence_pages_at_least_pages_of_sum(lengths, block):
    layout = KVLayout.uniform(2, 2, 16, block_tokens=block)
    assert pages_needed(layout, lengths) >= cdiv(sum(lengths), block)


@given(lengths=lengths, block=st.integers(1, 64))
def test_waste_under_one_block_per_sequence(lengths, block):
    layout = KVLayout.uniform(2, 2, 16, block_tokens=block)
    waste_tokens = pages_needed(layout, lengths) * block - sum(lengths)
    assert 0 <= waste_tokens < len(lengths) * block


@given(lengths=lengths, window=st.integers(1, 4096), in_flight=st.integers(1, 512))
def test_windows_never_need_more_than_full_attention(lengths, window, in_flight):
    full = KVLayout((LayerSpec.full(),) * 4, 2, 16)
    mixed = KVLayout(alternating([LayerSpec.sliding(window), LayerSpec.full()], 4), 2, 16)
    # pages differ in size (2 groups of 2 layers vs 1 group of 4), so compare bytes
    mixed_bytes = pages_needed(mixed, lengths, in_flight) * page_bytes(mixed)
    assert mixed_bytes <= pages_needed(full, lengths, in_flight) * page_bytes(full)


def test_host_tiers():
    # 256 GiB / 2 MiB = 131,072 blocks = 2,097,152 tokens (one rank is the whole model)
    cap = tier_capacity(LLAMA8, 256 * 2**30)
    assert (cap.blocks, cap.tokens) == (131_072, 2_097_152)
    # TP=8: a rank's block is 256 KiB, so 4 TB = 15,258,789 rank-blocks; whole-model tokens:
    # floor(4e12 / (8 * 256 KiB)) = 1,907,348 blocks x 16 = 30,517,568 tokens
    tp8 = get_preset("Llama-3-8B").layout(tp_size=8)
    cap = tier_capacity(tp8, 4 * 10**12)
    assert (cap.blocks, cap.tokens) == (15_258_789, 30_517_568)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GpuPool(80, 0.0, 0), "utilization"),
        (lambda: GpuPool(80, 1.01, 0), "utilization"),
        (lambda: GpuPool(80, 0.5, -1), "weights_bytes"),
        (lambda: Workload(0, 10, 10), "concurrency"),
        (lambda: Workload(1, 10, -1), "max output"),
        (lambda: sequence_pages(LLAMA8, -1), "token counts"),
        (lambda: tier_capacity(LLAMA8, -5), "tier size"),
    ],
)
def test_bad_inputs(make, message):
    with pytest.raises(UsageError, match=message):
        make()


def test_hybrid_block_tokens_qwen3_next():
    # Qwen3-Next: attention page per token and layer 2 x 2 heads x 256 x 2 B = 2,048 B; state
    # page 1,097,728 B. 16 x ceil(1,097,728 / (16 x 2,048)) = 16 x ceil(33.5) = 16 x 34 = 544
    layers = alternating([LayerSpec.recurrent(1_097_728, 16)] * 3 + [LayerSpec.full()], 48)
    layout = KVLayout(layers, 2, 256)
    assert hybrid_block_tokens(layout) == 544
    # a larger block the user asked for is kept when it already holds the state (64 x ... = 576)
    assert hybrid_block_tokens(KVLayout(layers, 2, 256, block_tokens=576)) == 576
    # a = 64: 64 x ceil(1,097,728 / (64 x 2,048)) = 64 x 9 = 576
    assert hybrid_block_tokens(KVLayout(layers, 2, 256, block_tokens=64)) == 576
    # no recurrent layers: unchanged
    assert hybrid_block_tokens(OSS20) == 16


def test_recurrent_state_pages_in_align_mode():
    layers = alternating([LayerSpec.recurrent(4096)] * 3 + [LayerSpec.full()], 8)
    layout = KVLayout(layers, 4, 64)
    # align mode: 2 pages per recurrent group (running state + checkpoint): 3 * 2 + 7 = 13
    assert sequence_pages(layout, 100, state_pages=2) == 13


def test_window_saving_by_hand():
    # gpt-oss-20b at 131,072 tokens: every layer full = 131,072 x 24 x 2,048 B = 6,442,450,944;
    # hybrid: (8,192 full + min(8,192, ceil(128/16) + 1 = 9) window) pages x 393,216 B
    #   = 8,201 x 393,216 = 3,224,764,416 B; saving 1 - 8,201/16,384 = 49.945...%
    s = window_saving(OSS20, 131_072)
    assert (s.all_full_bytes, s.hybrid_bytes) == (6_442_450_944, 3_224_764_416)
    assert s.hybrid_off_bytes == 6_442_450_944  # window promoted to full: saves nothing
    assert s.layer_ratio == 0.5 and round(s.hybrid_saving, 5) == 0.49945
    # Mistral (all sliding, window 4096): with the manager off the window is kept:
    #   min(8,192, ceil(4,096/16) + 1 = 257) pages x 16 x 32 x 4,096 B = 538,968,064 B
    mistral = get_preset("Mistral-7B-v0.1").layout()
    s = window_saving(mistral, 131_072)
    assert s.hybrid_bytes == s.hybrid_off_bytes == 257 * 16 * 32 * 4096 == 538_968_064
    # a recurrent model does not start with the manager off
    rec = KVLayout(alternating([LayerSpec.recurrent(4096), LayerSpec.full()], 4), 2, 64)
    assert window_saving(rec, 1000).hybrid_off_bytes is None
    with pytest.raises(UsageError, match="context"):
        window_saving(OSS20, 0)
