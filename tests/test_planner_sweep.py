"""Sweep: the planner's cut against a brute-force search written independently of its closed forms.

The reference prices each cut from scratch: per-token FLOPs summed token by token (no closed
form), bytes summed per block, latency per tier touched, and layer-pipelined overlap simulated
layer by layer (no max formula). Over bandwidth 0.5–60 GB/s, FLOP rate 10–800 TFLOP/s, context
256–128K tokens, tier mixes and every preset, the chosen plan must be within 1% of the best cut
and never worse than always-fetch or always-recompute.
"""

import itertools

import numpy as np
import pytest

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates, Prefix, plan
from kvtier.core.presets import get_preset, list_presets
from kvtier.core.types import Tier


def _token_flops(cm: CostModel, start: int, end: int) -> np.ndarray:
    j = np.arange(start, end, dtype=np.float64)
    out = np.full(len(j), cm.linear_flops_per_token)
    for g in cm.attn:
        keys = j + 1 if g.window == 0 else np.minimum(j + 1, g.window)
        out += g.layers * g.pair_flops * keys
    return out


def _pipeline(lat: float, f: float, c: float, layers: int) -> float:
    """Finish time: copy of layer i (f/L each, back to back) must end before compute i starts."""
    copy_done, comp_done = lat, lat
    for _ in range(layers):
        copy_done += f / layers
        comp_done = max(copy_done, comp_done) + c / layers
    return comp_done


def brute_force(p: Prefix, cm: CostModel, r: PlanRates, suffix: int, overlap: bool) -> np.ndarray:
    n = len(p)
    bounds = p.start + np.concatenate(([0], np.cumsum(p.tokens))).astype(np.int64)
    tok = _token_flops(cm, p.start, int(bounds[-1]) + suffix)
    block_flops = [tok[bounds[i] - p.start : bounds[i + 1] - p.start].sum() for i in range(n)]
    suffix_flops = tok[bounds[-1] - p.start :].sum()
    totals = []
    for k in range(n + 1):
        lat = ssd_s = h2d_s = 0.0
        touched = set()
        for i in range(k):
            t = Tier(int(p.tiers[i]))
            if t is Tier.HBM:
                continue
            touched.add(t)
            h2d_s += p.nbytes[i] / r.h2d_bytes_per_s
            if t is Tier.SSD:
                ssd_s += p.nbytes[i] / r.ssd_bytes_per_s
        if touched:
            lat += r.h2d_latency_s
        if Tier.SSD in touched:
            lat += r.ssd_latency_s
        fetched_tokens = bounds[k] - p.start
        flops = sum(block_flops[k:]) + suffix_flops + cm.fetch_flops_per_token * fetched_tokens
        comp = flops / r.prefill_flops_per_s
        if overlap:
            totals.append(_pipeline(lat + ssd_s, h2d_s, comp, cm.layers))
        else:
            totals.append(lat + ssd_s + h2d_s + comp)
    return np.array(totals)


MIXES = ("dram", "ssd", "dram_then_ssd", "random", "hbm_head")


def _tiers(mix: str, n: int, rng: np.random.Generator) -> list[int]:
    if mix == "dram":
        return [Tier.DRAM] * n
    if mix == "ssd":
        return [Tier.SSD] * n
    if mix == "dram_then_ssd":
        k = int(rng.integers(0, n + 1))
        return [Tier.DRAM] * k + [Tier.SSD] * (n - k)
    if mix == "hbm_head":
        k = int(rng.integers(0, n + 1))
        return [Tier.HBM] * k + list(rng.choice([Tier.DRAM, Tier.SSD], n - k))
    return list(rng.choice([Tier.HBM, Tier.DRAM, Tier.SSD], n, p=[0.1, 0.5, 0.4]))


def _case(preset, bw, ssd_bw, flops, ctx, mix, overlap, rng, lat=(2e-4, 3e-4), suffix=None):
    cm = CostModel.from_spec(get_preset(preset))
    # keep the brute force O(n²) affordable: at most ~96 blocks, at least 16 tokens each
    block_tokens = max(16, -(-ctx // 96))
    n = ctx // block_tokens
    p = Prefix.uniform(_tiers(mix, n, rng), block_tokens, int(block_tokens * cm.kv_bytes_per_token))
    r = PlanRates(bw, lat[0], ssd_bw, lat[1], flops)
    sfx = int(rng.integers(0, 2 * block_tokens)) if suffix is None else suffix
    got = plan(p, cm, r, suffix_tokens=sfx, overlap=overlap)
    ref = brute_force(p, cm, r, sfx, overlap)
    ctx_msg = (preset, bw, ssd_bw, flops, ctx, mix, overlap, sfx, got.cut, int(ref.argmin()))
    # the plan's own prediction agrees with the independent pricing of its cut
    assert got.total_s == pytest.approx(ref[got.cut], rel=1e-9), ctx_msg
    assert got.total_s <= ref.min() * 1.01, ctx_msg
    assert got.total_s <= ref[0] * (1 + 1e-9), ctx_msg  # never worse than recompute-all
    assert got.total_s <= ref[-1] * (1 + 1e-9), ctx_msg  # never worse than fetch-all
    assert got.recompute_all_s == pytest.approx(ref[0], rel=1e-9)
    assert got.fetch_all_s == pytest.approx(ref[-1], rel=1e-9)


@pytest.mark.parametrize("preset", list_presets())
def test_corners_every_preset(preset):
    rng = np.random.default_rng(7)
    for bw, flops, ctx, overlap in itertools.product(
        (0.5e9, 60e9), (10e12, 800e12), (256, 131_072), (False, True)
    ):
        mix = MIXES[int(rng.integers(len(MIXES)))]
        _case(preset, bw, bw / 4, flops, ctx, mix, overlap, rng)


def test_random_sweep():
    rng = np.random.default_rng(2026)
    presets = list_presets()
    for _ in range(60):
        _random_case(rng, presets)


@pytest.mark.slow
def test_random_sweep_long():
    rng = np.random.default_rng(11)
    presets = list_presets()
    for _ in range(1500):
        _random_case(rng, presets)


def _random_case(rng, presets):
    def logu(lo, hi):
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    _case(
        presets[int(rng.integers(len(presets)))],
        logu(0.5e9, 60e9),
        logu(0.5e9, 60e9),
        logu(10e12, 800e12),
        int(logu(256, 131_072)),
        MIXES[int(rng.integers(len(MIXES)))],
        bool(rng.integers(2)),
        rng,
        lat=(logu(1e-6, 5e-3), logu(1e-6, 5e-3)),
    )
