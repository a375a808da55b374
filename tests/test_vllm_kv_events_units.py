"""The connector's tier-event queue when it overflows: `TierEvents` following a real daemon's
WatchEvents drops what does not fit between two engine steps, and the connector reports the count
with its stats, which vLLM exports as `vllm:kvtier_dropped_tier_events_total`."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.client.sync_client import Client, LayoutDecl
from tests.daemon_fixture import DaemonProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtier.integrations.vllm import events  # after the skip: these need vLLM
from kvtier.integrations.vllm.connector import KvtierConnector
from kvtier.integrations.vllm.stats import KvtierPromMetrics

LAYOUT = LayoutDecl(fingerprint=b"test-layout-tierev", block_bytes=4096, block_tokens=16,
                    model_id="test-model-tierev")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", ["--ssd-bytes", "0"]).start()
    try:
        yield d
    finally:
        d.stop()


def test_dropped_tier_events_are_counted_and_exported_with_the_connector_stats(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_QUEUED", 3)
    tier = events.TierEvents(lambda: Client(daemon.socket, layout=LAYOUT), LAYOUT)
    data = [np.zeros(4096, np.uint8).tobytes()]
    try:
        with Client(daemon.socket, layout=LAYOUT) as kv:
            deadline = time.monotonic() + 15
            n = 0
            while not tier.take():  # until the watch stream is up (it starts from now)
                assert time.monotonic() < deadline
                kv.store([bytes([1, n]) + bytes(30)], data)
                n += 1
                time.sleep(0.1)
            time.sleep(0.2)
            tier.take()
            for i in range(8):  # eight one-block chains: eight BlockStored events
                kv.store([bytes([2, i]) + bytes(30)], data)
        deadline = time.monotonic() + 10
        while tier.dropped < 5:
            assert time.monotonic() < deadline, tier.dropped
            time.sleep(0.05)
        time.sleep(0.2)
        queued = tier.take()
        assert len(queued) == 3 and tier.dropped == 5  # three fit, five did not
        assert [e.medium for e in queued] == ["CPU"] * 3  # type: ignore[attr-defined]

        connector = KvtierConnector.__new__(KvtierConnector)  # the scheduler side's state
        connector.worker, connector.tier_events = None, tier
        stats = connector.get_kv_connector_stats()
        assert stats is not None and stats.data["dropped_tier_events"] == 5
        assert connector.get_kv_connector_stats() is None  # a delta: nothing new since

        registry = CollectorRegistry()
        prom = KvtierPromMetrics(
            SimpleNamespace(kv_transfer_config=None),
            {cls: functools.partial(cls, registry=registry)
             for cls in (Gauge, Counter, Histogram)},
            ["engine"], {0: ["0"]})
        prom.observe(stats.to_dict(), 0)  # what vLLM hands it (SchedulerStats)
        assert registry.get_sample_value("vllm:kvtier_dropped_tier_events_total",
                                         {"engine": "0"}) == 5
    finally:
        tier.close()
