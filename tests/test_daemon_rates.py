"""The planner's rates in a real daemon: seeded from `calibration.json` at start (a bad file is a
warning and defaults), exported on /metrics, and moved by engines' ReportPrefill so that the next
Lookup plan prices recompute at the reported rate."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl, ModelCost
from kvtier.core.costmodel import CostModel
from kvtier.daemon.rates.book import DEFAULT_LINKS, DEFAULT_PREFILL_FLOPS_PER_S, Link, LinkRate
from kvtier.daemon.rates.calibrate import (
    CONTROL_RTT_S,
    Calibration,
    calibration_path,
    save_calibration,
)
from tests.daemon_fixture import DaemonProc

BLOCK = 65536
TOKENS = 16
MODEL = ModelCost(8.0e9, 32, 4096)  # Llama-3-8B-like
COST = CostModel.dense("client", 8.0e9, 32, 4096, 0)  # what the daemon builds from MODEL
LAYOUT = LayoutDecl(b"rates-test-layout", BLOCK, TOKENS, model=MODEL,
                    model_id="rates-test-model")


def chain(n: int) -> list[bytes]:
    return [bytes([77, i]) + bytes(30) for i in range(n)]


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (labels in any order)."""
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if not m or m[1] != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
        if got == labels:
            return float(m[3])
    raise AssertionError(f"no sample {name}{labels}")


def start(tmp: Path, calibration: str | Calibration | None) -> DaemonProc:
    d = DaemonProc(tmp / "d")
    path = calibration_path(d.data_dir)
    if isinstance(calibration, Calibration):
        save_calibration(calibration, path)
    elif calibration is not None:
        path.parent.mkdir(parents=True)
        path.write_text(calibration)
    return d.start()


@pytest.fixture
def stopping() -> Iterator[list[DaemonProc]]:
    started: list[DaemonProc] = []
    yield started
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


def test_start_seeds_the_rates_from_the_calibration_file(
    tmp_path: Path, stopping: list[DaemonProc]
) -> None:
    cal = Calibration(
        {Link.DRAM_READ: LinkRate(10e9, 50e-6), Link.SSD_READ: LinkRate(1.5e9, 100e-6)},
        2e14, {"created_utc": "2026-11-29T10:00:00+00:00"},
    )
    d = start(tmp_path, cal)
    stopping.append(d)
    assert re.search(r"planner rates from calibration \S+calibration\.json "
                     r"\(2026-11-29T10:00:00\+00:00\)", d.log())
    text = d.metrics_text()
    bw, lat = "kvtier_rate_bandwidth_bytes_per_second", "kvtier_rate_latency_seconds"
    assert sample(text, bw, tier="dram", direction="read") == 10e9
    assert sample(text, bw, tier="ssd", direction="read") == 1.5e9
    assert sample(text, bw, tier="dram", direction="write") == DEFAULT_LINKS[
        Link.DRAM_WRITE].bytes_per_s  # not measured: the default
    # calibrated latencies get the assumed control-plane round trip (150 us) added
    assert sample(text, lat, tier="dram", direction="read") == pytest.approx(50e-6 + CONTROL_RTT_S)
    assert sample(text, "kvtier_rate_prefill_flops_per_second") == 2e14
    assert sample(text, "kvtier_rate_samples", tier="dram", direction="read") == 0
    with Client(d.socket, layout=LAYOUT) as kv:
        kv.store(chain(8), [np.full(BLOCK, 5, np.uint8)] * 8)
        plan = kv.lookup(chain(8), plan=True).plan
    # 8 DRAM blocks: 200 us latency + 8 x 65536 B / 1e10 B/s = 200 us + 52.4288 us; recompute
    # of their 128 tokens at 2e14 FLOP/s (~10 ms) is what fetching them avoids.
    assert plan is not None and plan.fetch_blocks == 8
    assert plan.predicted_fetch_seconds == pytest.approx(50e-6 + CONTROL_RTT_S + 8 * BLOCK / 10e9)
    assert plan.predicted_recompute_seconds == pytest.approx(COST.prefill_flops(0, 128) / 2e14)


@pytest.mark.parametrize("content", [
    "{ not json",
    '{"version": 1, "links": {"dram_read": {"bytes_per_s": -5, "latency_s": 0}}}',
    '{"version": 99, "links": {}}',
])
def test_a_bad_calibration_file_is_a_warning_and_defaults(
    tmp_path: Path, stopping: list[DaemonProc], content: str
) -> None:
    d = start(tmp_path, content)
    stopping.append(d)
    log = d.log()
    warnings = [ln for ln in log.splitlines() if "WARNING" in ln and "calibration" in ln]
    assert len(warnings) == 1 and "ignoring the calibration file" in warnings[0]
    assert "Traceback" not in log
    assert "planner rates from defaults (calibration" in log and "unreadable)" in log
    text = d.metrics_text()
    assert sample(text, "kvtier_rate_bandwidth_bytes_per_second", tier="dram",
                  direction="read") == DEFAULT_LINKS[Link.DRAM_READ].bytes_per_s
    assert sample(text, "kvtier_rate_prefill_flops_per_second") == DEFAULT_PREFILL_FLOPS_PER_S


def test_report_prefill_moves_the_rate_and_the_next_plan(
    tmp_path: Path, stopping: list[DaemonProc]
) -> None:
    d = start(tmp_path, None)
    stopping.append(d)
    assert "planner rates from defaults (no calibration" in d.log()
    flops_2k = COST.prefill_flops(0, 2048)
    with Client(d.socket, layout=LAYOUT) as kv:
        kv.store(chain(8), [np.full(BLOCK, 6, np.uint8)] * 8)
        # an engine reports 2,048 tokens prefilled from scratch at exactly 1e14 FLOP/s
        kv.report_prefill(tokens=2048, seconds=flops_2k / 1e14, context_tokens=0)
        assert sample(d.metrics_text(), "kvtier_rate_prefill_flops_per_second") == (
            pytest.approx(1e14))
        plan = kv.lookup(chain(8), plan=True).plan
        assert plan is not None and plan.fetch_blocks == 8
        assert plan.predicted_recompute_seconds == pytest.approx(COST.prefill_flops(0, 128) / 1e14)
        # two reports at 5e16 FLOP/s (context 4,096 exercises the attention term): the median of
        # {1e14, 5e16, 5e16} is 5e16, so the 8 blocks' 128 tokens recompute in
        # ~2.05e12 / 5e16 = 41 us — under the 200 us fetch latency alone: recompute them all.
        for _ in range(2):
            kv.report_prefill(tokens=512, seconds=COST.prefill_flops(4096, 512) / 5e16,
                              context_tokens=4096)
        # a report no GPU could make (1e18 FLOP/s) is refused as noise and changes nothing
        kv.report_prefill(tokens=2048, seconds=flops_2k / 1e18)
        text = d.metrics_text()
        assert sample(text, "kvtier_rate_prefill_flops_per_second") == pytest.approx(
            statistics.median([1e14, 5e16, 5e16]))
        assert sample(text, "kvtier_rate_prefill_samples") == 3
        assert sample(text, "kvtier_rate_samples_rejected_total") == 1
        flipped = kv.lookup(chain(8), plan=True).plan
        assert flipped is not None and flipped.fetch_blocks == 0
        assert flipped.reason == "recompute_all_fixed_latency"
        with pytest.raises(KvtierRpcError) as err:
            kv.report_prefill(tokens=0, seconds=1.0)
        assert err.value.code.name == "INVALID_ARGUMENT"
    text = d.metrics_text()
    assert sample(text, "kvtier_plan_decisions_total", action="fetch_dram") == 8
    assert sample(text, "kvtier_plan_decisions_total", action="recompute") == 8
    assert sample(text, "kvtier_plans_total", reason="recompute_all_fixed_latency") == 1


def test_loads_report_the_copy_into_rates_and_the_error_histogram(
    tmp_path: Path, stopping: list[DaemonProc]
) -> None:
    d = start(tmp_path, None)
    stopping.append(d)
    with Client(d.socket, layout=LAYOUT) as kv:
        kv.store(chain(4), [np.full(BLOCK, 7, np.uint8)] * 4)
        for _ in range(3):
            with kv.load(chain(4)) as got:
                assert got.blocks == 4
                out = np.empty(4 * BLOCK, np.uint8)
                for i, v in enumerate(got.views):
                    out[i * BLOCK:(i + 1) * BLOCK] = v
    text = d.metrics_text()
    assert sample(text, "kvtier_plan_fetch_time_ratio_count", link="dram_read") == 3
    assert sample(text, "kvtier_plan_fetch_time_ratio_sum", link="dram_read") > 0
    assert sample(text, "kvtier_rate_samples", tier="dram", direction="read") == 3
    assert sample(text, "kvtier_rate_bandwidth_bytes_per_second", tier="dram",
                  direction="read") != DEFAULT_LINKS[Link.DRAM_READ].bytes_per_s
