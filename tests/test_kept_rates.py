"""Planner rates kept across a daemon restart (`<data_dir>/rates.json`): a real daemon that
measured a slow prefill keeps planning fetches after a restart instead of falling back to the
defaults' judgement that recomputing is cheaper; the file's edge cases on their own."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.client.sync_client import Client, LayoutDecl, ModelCost
from kvtier.core.costmodel import CostModel
from kvtier.daemon.rates import kept as kept_rates
from kvtier.daemon.rates.book import DEFAULT_PREFILL_FLOPS_PER_S, Link, LinkRate, RateBook
from kvtier.daemon.rates.calibrate import Calibration, calibration_path, save_calibration
from tests.daemon_fixture import DaemonProc
from tests.test_daemon_rates import sample

BLOCK = 65536
TOKENS = 16
MODEL = ModelCost(1.0e8, 12, 768)  # a small model: on an H100's default rate, recompute is cheap
COST = CostModel.dense("client", 1.0e8, 12, 768, 0)
LAYOUT = LayoutDecl(b"kept-rates-layout", BLOCK, TOKENS, model=MODEL, model_id="kept-rates@1")
SLOW = 1e11  # FLOP/s this "engine" reports (a CPU, say)


def chain(n: int) -> list[bytes]:
    return [bytes([91, i]) + bytes(30) for i in range(n)]


def test_measured_rates_survive_a_restart(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(chain(4), [np.full(BLOCK, 3, np.uint8)] * 4)
            before = kv.lookup(chain(4), plan=True).plan
            assert before is not None and before.fetch_blocks == 0  # defaults: recompute
            for _ in range(3):
                kv.report_prefill(tokens=1024, seconds=COST.prefill_flops(0, 1024) / SLOW)
            measured = kv.lookup(chain(4), plan=True).plan
            assert measured is not None and measured.fetch_blocks == 4
        assert d.stop() == 0
        saved = json.loads((d.data_dir / kept_rates.FILE_NAME).read_text())
        assert saved["node"]["prefill_flops_per_s"] == pytest.approx(SLOW)
        assert saved["tenants"]["default"]["prefill_flops_per_s"] == pytest.approx(SLOW)

        d.start()
        first = d.log().split(" serving on unix:")[-1].splitlines()[0]
        assert re.search(r"planner rates from measured before the restart \(\S+rates\.json, "
                         r"saved \d{4}-\d\d-\d\dT[\d:]+Z: dram_write, prefill; "
                         r"per tenant: default\), else defaults", first), first
        text = d.metrics_text()
        assert sample(text, "kvtier_rate_prefill_flops_per_second") == pytest.approx(SLOW)
        assert sample(text, "kvtier_rate_prefill_samples") == 0  # a seed, not a sample
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(chain(4), [np.full(BLOCK, 3, np.uint8)] * 4)
            after = kv.lookup(chain(4), plan=True).plan
            assert after is not None and after.fetch_blocks == 4
    finally:
        if d.proc is not None:
            d.stop()


def test_round_trip_and_only_measured_links(tmp_path: Path) -> None:
    book = RateBook()
    book.observe_transfer(Link.SSD_READ, 1e9, 0.5)
    book.observe_latency(Link.SSD_READ, 1e-4)
    tenant = book.fork()
    tenant.observe_transfer(Link.DRAM_READ, 4e9, 1.0)
    kept_rates.save(tmp_path, book, {"alice": tenant, "idle": book.fork()})
    got = kept_rates.load(tmp_path)
    assert got is not None
    assert got.node.links == {Link.SSD_READ: LinkRate(2e9, 1e-4)}
    assert got.node.prefill_flops_per_s is None
    assert got.tenants.keys() == {"alice"}
    assert got.tenants["alice"].links == {Link.DRAM_READ: LinkRate(4e9, 200e-6)}
    start = kept_rates.start_rates(tmp_path)
    assert start.book.bandwidth(Link.SSD_READ) == 2e9 and start.book.samples(Link.SSD_READ) == 0
    assert start.book.prefill_flops_per_s() == DEFAULT_PREFILL_FLOPS_PER_S
    assert "ssd_read; per tenant: alice" in start.described


def test_nothing_measured_writes_nothing(tmp_path: Path) -> None:
    kept_rates.save(tmp_path, RateBook(), {"a": RateBook()})
    assert not (tmp_path / kept_rates.FILE_NAME).exists()
    assert kept_rates.start_rates(tmp_path).described.startswith("defaults (no calibration")


@pytest.mark.parametrize("text", ["{", '{"version": 9}', '{"version": 1, "node": {"links": '
                                  '{"ssd_read": {"bytes_per_s": -1, "latency_s": 0}}}}',
                                  '{"version": 1, "node": {"links": {"warp": {}}}}'])
def test_a_bad_file_is_a_warning_and_ignored(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / kept_rates.FILE_NAME).write_text(text)
    start = kept_rates.start_rates(tmp_path)
    assert start.book.bandwidth(Link.SSD_READ) == RateBook().bandwidth(Link.SSD_READ)
    assert "ignoring the kept planner rates" in caplog.text


def test_a_newer_calibration_wins(tmp_path: Path) -> None:
    book = RateBook()
    book.observe_transfer(Link.SSD_READ, 1e9, 0.5)
    kept_rates.save(tmp_path, book, {})
    old = time.time() - 60
    os.utime(tmp_path / kept_rates.FILE_NAME, (old, old))
    save_calibration(Calibration({Link.SSD_READ: LinkRate(3e9, 1e-4)}, None,
                                 {"created_utc": "now"}), calibration_path(tmp_path))
    start = kept_rates.start_rates(tmp_path)
    assert start.book.bandwidth(Link.SSD_READ) == 3e9
    assert "newer than the rates kept" in start.described
