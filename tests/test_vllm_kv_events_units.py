"""The connector's tier events (`TierEvents`) following a real daemon's WatchEvents: a remote copy
(a real redis-server) is announced as REMOTE and does not hold back the BlockRemoved of a block
that leaves the node's own tiers; what does not fit the queue between two engine steps is dropped
and reported with the connector's stats, which vLLM exports as
`vllm:kvtier_dropped_tier_events_total`."""

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
from kvtier.core.types import Tier
from tests.daemon_fixture import DaemonProc
from tests.redis_fixture import RedisServer, needs_redis

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtier.integrations.vllm import events  # after the skip: these need vLLM
from kvtier.integrations.vllm.connector import KvtierConnector
from kvtier.integrations.vllm.stats import KvtierPromMetrics

LAYOUT = LayoutDecl(fingerprint=b"test-layout-tierev", block_bytes=4096, block_tokens=16,
                    model_id="test-model-tierev")
BIG = LayoutDecl(fingerprint=b"test-layout-tierev-64k", block_bytes=65536, block_tokens=16,
                 model_id="test-model-tierev")


def key(*tag: int) -> bytes:
    """A 32-byte block key that ends with `tag`: vLLM's integer event hashes keep a key's low
    64 bits (`maybe_convert_block_hash`), so keys that differ only in their first bytes would
    all publish as hash 0 and every wait on one key's event would pass on another's."""
    return bytes(32 - len(tag)) + bytes(tag)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", ["--ssd-bytes", "0"]).start()
    try:
        yield d
    finally:
        d.stop()


def test_dropped_tier_events_are_counted_and_exported_with_the_connector_stats(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    monkeypatch.setattr(events, "MAX_QUEUED", 3)
    tier = events.TierEvents(lambda: Client(daemon.socket, layout=LAYOUT), LAYOUT)
    data = [np.zeros(4096, np.uint8).tobytes()]
    try:
        with Client(daemon.socket, layout=LAYOUT) as kv:
            deadline = time.monotonic() + 60
            n = 0
            while not (probed := tier.take()):  # until the watch stream is up (it starts now)
                assert time.monotonic() < deadline
                kv.store([key(1, n)], data)
                n += 1
                time.sleep(0.1)
            # every probe's event taken: up to the last probe's (a fixed 0.2 s let a late one
            # on a loaded machine take a place in the queue below)
            last = maybe_convert_block_hash(BlockHash(key(1, n - 1)))
            while last not in {h for e in probed for h in e.block_hashes}:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, probed
                time.sleep(0.05)
                probed += tier.take()
            tier.take_dropped()  # what the stats below report starts here
            base = tier.dropped  # (a burst of probes' events can overflow the queue too)
            for i in range(8):  # eight one-block chains: eight BlockStored events
                kv.store([key(2, i)], data)
        deadline = time.monotonic() + 60
        while tier.dropped - base < 5:
            assert time.monotonic() < deadline, tier.dropped - base
            time.sleep(0.05)
        time.sleep(0.2)
        queued = tier.take()
        assert len(queued) == 3 and tier.dropped - base == 5  # three fit, five did not
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


@needs_redis
def test_a_remote_copy_is_announced_and_does_not_keep_the_block_on_this_node(
        tmp_path: Path) -> None:
    pytest.importorskip("redis")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    redis = RedisServer(tmp_path / "redis").start()
    # 16 blocks of DRAM, no SSD, every committed block written to the shared store
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "1MiB", "--ssd-bytes", "0",
                                    "--remote-url", redis.url,
                                    "--remote-queue-bytes", "1MiB"]).start()
    tier = events.TierEvents(lambda: Client(d.socket, layout=BIG), BIG)
    got: list[object] = []
    data = [np.zeros(65536, np.uint8).tobytes()] * 8
    try:
        with Client(d.socket, layout=BIG) as kv:
            deadline = time.monotonic() + 60
            n = 0
            while not tier.take():  # until the watch stream is up (it starts from now)
                assert time.monotonic() < deadline
                kv.store([key(1, n)], data[:1])
                n += 1
                time.sleep(0.1)
            a = [key(2, i) for i in range(8)]
            as_vllm = [maybe_convert_block_hash(BlockHash(k)) for k in a]
            assert len(set(as_vllm)) == len(a)  # each wait below is on its own blocks

            def seen(kind: type, medium: str) -> set[object]:
                return {h for e in got if isinstance(e, kind) and e.medium == medium
                        for h in e.block_hashes}

            kv.store(a, data)
            deadline = time.monotonic() + 60
            while not set(as_vllm) <= seen(BlockStored, "REMOTE"):
                assert time.monotonic() < deadline, got
                got += tier.take()
                time.sleep(0.05)
            remote = [e for e in got if isinstance(e, BlockStored) and e.medium == "REMOTE"]
            assert {(e.locality, e.ownership) for e in remote} == {("REMOTE", "kvtier")}
            for i in range(3):  # 24 more blocks through a 16-block pool: a's leave DRAM
                more = [key(3, i, j) for j in range(8)]
                kv.store(more, data)
                # a block queued for the store stays pinned until written: the next 8 find
                # room only once these are (on a loaded machine redis may lag a store behind)
                want = {maybe_convert_block_hash(BlockHash(k)) for k in more}
                deadline = time.monotonic() + 60
                while not want <= seen(BlockStored, "REMOTE"):
                    assert time.monotonic() < deadline, got
                    got += tier.take()
                    time.sleep(0.05)
            deadline = time.monotonic() + 60
            while not set(as_vllm) <= seen(BlockRemoved, "CPU"):
                assert time.monotonic() < deadline, got
                got += tier.take()
                time.sleep(0.05)
            assert seen(BlockRemoved, "REMOTE") == set()
            assert kv.lookup(a).tiers == [Tier.REMOTE] * 8  # off this node, still in the store
    finally:
        tier.close()
        d.stop()
        redis.stop()
