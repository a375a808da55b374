"""The connector's background threads against a real daemon, without a vLLM engine: the
scheduler side's Lookups (`common/lookup.py`) and the worker side's loads and background saves
(`worker.py`, `common/saver.py`) over real KV tensors laid out as vLLM's CPU backend lays them."""

from __future__ import annotations

import logging
import random
import time

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtier.integrations.common.link import DaemonLink  # noqa: E402
from kvtier.integrations.common.lookup import Lookups  # noqa: E402
from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

BT, HEADS, HEAD = 32, 1, 64
PAGE = 2 * BT * HEADS * HEAD * 2  # bf16 [2, BT, HEADS * HEAD] per layer
LAYERS = ("l0", "l1")
KV = EngineKV("test/threads@1", "bfloat16", BT, LAYERS, PAGE, HEADS, HEAD, "cpu",
              Shard(0, 1, True))


def settings(d: DaemonProc, **over: object) -> ConnectorSettings:
    return ConnectorSettings(socket=str(d.socket), use_plan=False, retry_after_s=60.0,
                             **over)  # type: ignore[arg-type]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def store(d: DaemonProc, keys: list[bytes]) -> None:
    with Client(d.socket, layout=KV.decl()) as kv:
        kv.store(keys, [bytes([i % 251]) * KV.block_bytes for i in range(len(keys))])


def answer(lk: Lookups, rid: str, keys: list[bytes], timeout: float = 10.0) -> tuple[int, int]:
    """(answer, how many asks returned None first), asking like vLLM's engine loop."""
    deadline, nones = time.monotonic() + timeout, 0
    while (got := lk.fetch_blocks(rid, keys, len(keys) * BT + 1)) is None:
        assert time.monotonic() < deadline
        nones += 1
        time.sleep(0.001)
    return got, nones


def test_background_lookup_answers_none_then_the_same_answer(daemon: DaemonProc) -> None:  # noqa: F811
    keys = block_keys(tokens(1, 40 * BT + 5), BT)
    store(daemon, keys[:30])
    link = DaemonLink(settings(daemon), KV.decl(), "scheduler")
    lk = Lookups([link], use_plan=False, background=True)
    try:
        got, nones = answer(lk, "r1", keys)
        assert got == 30 and nones >= 1  # the first ask never waits for the daemon
        assert [lk.fetch_blocks("r1", keys, 0) for _ in range(3)] == [30] * 3  # side-effect free
        assert answer(lk, "r2", keys[:10])[0] == 10
        lk.forget("r1")
        assert lk.fetch_blocks("r1", keys, 0) is None  # looked up afresh (preempted, say)
        assert answer(lk, "r1", keys)[0] == 30
    finally:
        lk.close()
        link.close()


def test_inline_lookup_answers_at_once(daemon: DaemonProc) -> None:  # noqa: F811
    keys = block_keys(tokens(2, 20 * BT + 1), BT)
    store(daemon, keys[:12])
    link = DaemonLink(settings(daemon), KV.decl(), "scheduler")
    lk = Lookups([link], use_plan=False, background=False)
    try:
        assert lk.fetch_blocks("r", keys, 0) == 12
    finally:
        lk.close()
        link.close()


def test_lookup_with_the_daemon_gone_answers_zero_with_one_warning(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    keys = block_keys(tokens(3, 8 * BT + 1), BT)
    store(daemon, keys)
    link = DaemonLink(settings(daemon, timeout_s=0.5), KV.decl(), "scheduler")
    lk = Lookups([link], use_plan=False, background=True)
    try:
        assert answer(lk, "a", keys)[0] == 8
        daemon.kill()
        with caplog.at_level(logging.WARNING, "kvtier.integrations"):
            assert answer(lk, "b", keys)[0] == 0
            assert lk.fetch_blocks("c", keys, 0) == 0  # down: answered at once, no Lookup
        assert sum("daemon unavailable" in r.message for r in caplog.records) == 1
    finally:
        lk.close()
        link.close()


def kv_caches(blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((blocks, 2, BT, HEADS * HEAD), generator=g).to(torch.bfloat16)
            for n in LAYERS}


@pytest.mark.parametrize("background", [True, False])
def test_saves_then_loads_round_trip_the_pages(daemon: DaemonProc, background: bool) -> None:  # noqa: F811
    keys = block_keys(tokens(4, 6 * BT + 1), BT)
    src = kv_caches(16, 0)
    w1 = WorkerSide(settings(daemon, async_save=background, save_buffer_mib=0.05), KV, 0)
    w1.register_kv_caches(src)
    other = block_keys(tokens(40, BT + 1), BT)
    store(daemon, other)
    with torch.inference_mode():  # as vLLM's worker runs
        # a load first maps the slots (within inference mode), then the save thread writes them
        w1.start_load_kv(KvtierMetadata(loads=[LoadJob("o", [15], other, 0)]))
        assert w1.take_load_errors() == set()
        # two jobs of one chain, the second after the first: 0.05 MiB holds one job at a time
        w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [3, 5, 7], keys[:3], b""),
                                               SaveJob("r", [9, 2, 4], keys[3:6], keys[2])]))
    assert w1.saver.idle(10)
    assert w1.stats.take()["stored_blocks"] == 6
    w1.close()
    dst = kv_caches(16, 1)
    w2 = WorkerSide(settings(daemon), KV, 0)
    w2.register_kv_caches(dst)
    w2.start_load_kv(KvtierMetadata(loads=[LoadJob("q", [10, 11, 12, 13, 14], keys[:6], 1)]))
    assert w2.take_load_errors() == set()
    for n in LAYERS:
        assert torch.equal(dst[n][[10, 11, 12, 13, 14]], src[n][[5, 7, 9, 2, 4]])
    with Client(daemon.socket, layout=KV.decl()) as kv:
        assert kv.stats().active_leases == 0  # the load released its lease
    # blocks the daemon does not have are load errors (vLLM recomputes them)
    more = block_keys(tokens(4, 9 * BT + 1), BT)
    w2.start_load_kv(KvtierMetadata(loads=[LoadJob("q2", [1, 2, 3, 4], more[:8], 4)]))
    assert w2.take_load_errors() == {3, 4}
    w2.close()


def test_daemon_killed_during_saves_is_one_warning(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    src = kv_caches(64, 2)
    w = WorkerSide(settings(daemon, timeout_s=0.5), KV, 0)
    w.register_kv_caches(src)
    keys = block_keys(tokens(5, 60 * BT + 1), BT)
    with caplog.at_level(logging.WARNING, "kvtier.integrations"):
        w.wait_for_save(KvtierMetadata(saves=[SaveJob("r", list(range(4)), keys[:4], b"")]))
        assert w.saver.idle(10)
        daemon.kill()
        for i in range(4, 60, 4):  # saves queued behind a dead daemon: none raises
            w.wait_for_save(KvtierMetadata(saves=[
                SaveJob("r", list(range(i, i + 4)), keys[i:i + 4], keys[i - 1])]))
        assert w.saver.idle(20)
        w.start_load_kv(KvtierMetadata(loads=[LoadJob("q", [1, 2], keys[:2], 0)]))
        assert w.take_load_errors() == {1, 2}
    assert sum("daemon unavailable" in r.message for r in caplog.records) == 1
    w.close()


def test_prefill_clock_reports_at_a_bounded_rate_and_retries() -> None:
    from kvtier.integrations.common.saver import PrefillClock

    clock = PrefillClock(every_s=30.0)
    assert clock.due() is None  # nothing timed yet
    clock.start()
    time.sleep(0.01)
    clock.stop(512, 64)
    tokens, seconds, context = clock.due() or (0, 0.0, 0)
    assert (tokens, context) == (512, 64) and 0.01 <= seconds < 5
    clock.start()
    clock.stop(256, 0)
    assert clock.due() is None  # within every_s of the last report
    clock.retry(tokens, seconds, context)  # that report failed: due again, the newer sample
    newer = clock.due()
    assert newer is not None and (newer[0], newer[2]) == (256, 0)
    clock.retry(*newer)  # failed again, nothing newer: that same sample, at once
    assert clock.due() == newer
    assert clock.due() is None
    off = PrefillClock(every_s=0.0)  # prefill_report_s = 0: never
    off.start()
    off.stop(512, 0)
    assert off.due() is None



def test_worker_stats_change_only_under_their_lock() -> None:
    """Loads count on vLLM's worker thread, stores on the save thread, and vLLM takes the deltas
    on the worker thread: every counter changes under `WorkerStats.lock`, so a `take` sees each
    update whole (a load's blocks, bytes and seconds together) and none twice."""
    import threading

    from kvtier.integrations.vllm.worker import WorkerStats

    stats = WorkerStats()
    updates = [lambda: stats.loaded(2, 10, 0.5), lambda: stats.failed(1),
               lambda: stats.stored(3, 0.25)]
    started = [threading.Event() for _ in updates]

    def run(i: int) -> None:
        started[i].set()
        updates[i]()

    with stats.lock:  # held: no update can land
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(updates))]
        for t in threads:
            t.start()
        assert all(e.wait(5) for e in started)
        for t in threads:
            t.join(0.5)  # an update not taking the lock would be done by now
        assert all(t.is_alive() for t in threads)  # each waits for the lock
        assert (stats.loaded_blocks, stats.failed_blocks, stats.stored_blocks) == (0, 0, 0)
    for t in threads:
        t.join(5)
    assert stats.take() == {"loaded_blocks": 2, "loaded_bytes": 10, "load_failed_blocks": 1,
                            "stored_blocks": 3, "load_seconds": 0.5, "store_seconds": 0.25,
                            "verified_blocks": 0, "verify_mismatched_blocks": 0}
    assert set(stats.take().values()) == {0}  # taken once
    assert stats.totals()["loaded_blocks"] == 2


def test_a_pin_hint_pins_the_chain_once_its_saves_commit(daemon: DaemonProc) -> None:  # noqa: F811
    """A request's pin hint rides its save jobs: the save thread pins the chain from the first
    block after committing each job, so a block stored after the request finished is pinned."""
    from kvtier.client.control import Control

    keys = block_keys(tokens(60, 5 * BT + 1), BT)
    w = WorkerSide(settings(daemon, save_buffer_mib=0.05), KV, 0)
    w.register_kv_caches(kv_caches(16, 3))
    try:
        with torch.inference_mode():
            w.wait_for_save(KvtierMetadata(saves=[
                SaveJob("p", [1, 2, 3], keys[:3], b"", (), 300.0, keys[:3]),
                SaveJob("p", [4, 5], keys[3:5], keys[2], (), 300.0, keys[:5])]))
        assert w.saver.idle(10)
        with Control(daemon.socket) as ops:
            pins = ops.pins()
            assert [(p.model_id, p.blocks) for p in pins] == [(KV.model_id, 5)]
            assert 200 < pins[0].first_expiry_seconds <= 300
            assert ops.unpin() == 5
    finally:
        w.close()


def test_a_prefetch_hint_promotes_before_the_lookup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On a daemon whose pool holds 8 blocks: a prompt of 6 on SSD only after a flood; the
    Lookup with `prefetch` finds it in DRAM (the prefetch ran first, on the same thread)."""
    pool = str(8 * KV.block_bytes)
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", pool, "--slot-bytes", str(KV.block_bytes),
                                    "--writeback-queue-bytes", pool, "--ssd-admit-after", "1",
                                    "--policy", "lru"]).start()
    link = DaemonLink(settings(d), KV.decl(), "scheduler")
    lk = Lookups([link], use_plan=False, background=True)
    try:
        keys = block_keys(tokens(70, 6 * BT + 1), BT)
        store(d, keys)
        with Client(d.socket, layout=KV.decl()) as kv:
            def written(n: int) -> None:  # written back, so no longer held: evictable
                deadline = time.monotonic() + 30
                while kv.stats().tiers[1].blocks < n:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)

            written(6)
            for i in range(4):
                store(d, block_keys(tokens(80 + i, 4 * BT + 1), BT))
                written(6 + 4 * (i + 1))
            assert [int(t) for t in kv.lookup(keys).tiers] == [2] * 6  # SSD only
            while (got := lk.fetch_blocks("r", keys, len(keys) * BT + 1, prefetch=True)) is None:
                time.sleep(0.001)
            assert got == 6
            assert [int(t) for t in kv.lookup(keys).tiers] == [1] * 6  # DRAM now
            assert kv.stats().active_leases == 0
    finally:
        lk.close()
        link.close()
        d.stop()
