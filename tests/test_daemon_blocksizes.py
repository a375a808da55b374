"""Block sizes real models use, in one real daemon (real shm, real SSD store, real restart): a
Llama-3-8B CPU block (32 tokens x 128 KiB = 4 MiB) and a small model's 32 KiB block side by side;
eviction between the two size classes in the policy's order at page granularity; the largest
block and the refusal above it; the segment format a client checks."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.shm import segment_handle
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.segment import StaleSegment
from kvtier.core.types import Tier
from tests.daemon_fixture import DaemonProc, wait_ssd_blocks
from tests.redis_fixture import RedisServer, needs_redis

KiB, MiB = 1 << 10, 1 << 20
BIG = LayoutDecl(b"llama-3-8b-cpu-block-32", 4 * MiB, 32, model_id="meta-llama/Llama-3-8B")
SMALL = LayoutDecl(b"small-model-block-32k", 32 * KiB, 16, model_id="org/small-1b")
# 64 MiB of DRAM = 32 pages of 2 MiB (the automatic page of a 64 MiB pool): a page holds 64
# small blocks; a big block spans 2 adjacent pages, an 8 MiB one 4. LRU, so that
# "the policy's order" is oldest first (the default kvtier policy keeps re-used blocks longer).
ARGS = ["--dram-bytes", "64MiB", "--slot-bytes", "16KiB", "--ssd-bytes", "128MiB",
        "--policy", "lru"]


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i >> 8, i & 255]) + bytes(29) for i in range(n)]


def roots(tag: int, n: int) -> list[list[bytes]]:
    """`n` one-block chains (each its own root: any of them is a leaf the policy may evict)."""
    return [[bytes([tag, i >> 8, i & 255, 1]) + bytes(28)] for i in range(n)]


def payload(layout: LayoutDecl, key: bytes) -> bytes:
    return (key[:4] * (layout.block_bytes // 4))[: layout.block_bytes]


def dram(kv: Client) -> pb.TierStats:
    return next(t for t in kv.stats().tiers if t.tier == pb.TIER_DRAM)


@pytest.fixture
def daemon(tmp_path: Path) -> DaemonProc:
    d = DaemonProc(tmp_path / "d", ARGS).start()
    yield d  # type: ignore[misc]
    d.stop()


@pytest.mark.parametrize("streaming", [False, True], ids=["shm", "streaming"])
def test_a_4mib_and_a_32kib_layout_store_and_load_side_by_side(
        daemon: DaemonProc, streaming: bool) -> None:
    with Client(daemon.socket, layout=BIG, streaming=streaming) as big, \
            Client(daemon.socket, layout=SMALL, streaming=streaming) as small:
        bk, sk = chain(1, 6), chain(2, 300)
        assert big.store(bk, [payload(BIG, k) for k in bk]).stored == 6
        assert small.store(sk, [payload(SMALL, k) for k in sk]).stored == 300
        with big.load(bk) as got:
            assert got.blocks == 6 and [bytes(v) for v in got.views] == [payload(BIG, k)
                                                                        for k in bk]
        with small.load(sk) as got:
            assert got.blocks == 300
            assert all(bytes(v) == payload(SMALL, k) for v, k in zip(got.views, sk, strict=True))
        if not streaming:  # the zero-copy rows an engine copies through are the same blocks
            with big.load(bk) as got:
                buf = big.slot_buffer()
                assert buf is not None and buf.slot_bytes == 4 * MiB
                rows = buf.array()
                assert all(bytes(rows[s]) == payload(BIG, k)
                           for s, k in zip(got.slots, bk, strict=True))
        # Nothing lost to rounding: both strides divide the page, so DRAM used = KV held.
        d = dram(small)
        assert d.used_bytes == 6 * 4 * MiB + 300 * 32 * KiB and d.capacity_bytes == 64 * MiB
        assert d.blocks == 306


def test_big_blocks_evict_small_ones_oldest_first_a_page_at_a_time(daemon: DaemonProc) -> None:
    with Client(daemon.socket, layout=BIG) as big, Client(daemon.socket, layout=SMALL) as small:
        small_chains = roots(3, 2048)  # fills all 32 pages
        for i in range(0, 2048, 256):
            keys = [c[0] for c in small_chains[i:i + 256]]
            for k in keys:
                assert small.store([k], [payload(SMALL, k)]).stored == 1
        assert dram(small).used_bytes == 64 * MiB
        bk = chain(4, 4)  # needs 8 pages: 512 small blocks go, the oldest first
        assert big.store(bk, [payload(BIG, k) for k in bk]).stored == 4
        with big.load(bk) as got:
            assert [bytes(v) for v in got.views] == [payload(BIG, k) for k in bk]
        hit = [small.lookup(c).hit_blocks for c in small_chains]
        assert hit == [0] * 512 + [1] * (2048 - 512)
        d = dram(small)
        assert d.used_bytes == 64 * MiB and d.blocks == 4 + 2048 - 512
        # and the other way: small blocks take the big blocks' pages back when those go cold
        more = roots(5, 512)
        for c in more:
            assert small.store(c, [payload(SMALL, c[0])]).stored == 1
        assert big.lookup(bk).hit_blocks == 0
        assert all(small.lookup(c).hit_blocks == 1 for c in more)


def test_an_emptied_page_is_reused_by_another_class_without_eviction(
        daemon: DaemonProc) -> None:
    with Client(daemon.socket, layout=BIG) as big, Client(daemon.socket, layout=SMALL) as small:
        bk = [c[0] for c in roots(6, 16)]  # 16 x 4 MiB = the whole pool
        for k in bk:
            assert big.store([k], [payload(BIG, k)]).stored == 1
        assert dram(big).used_bytes == 64 * MiB
        sk = chain(7, 256)  # four pages of small blocks: exactly the two oldest big blocks go
        assert small.store(sk, [payload(SMALL, k) for k in sk]).stored == 256
        assert [big.lookup([k]).hit_blocks for k in bk] == [0, 0] + [1] * 14
        assert dram(big).used_bytes == 14 * 4 * MiB + 256 * 32 * KiB


def test_the_largest_block_fits_and_one_byte_more_is_refused(daemon: DaemonProc) -> None:
    top = LayoutDecl(b"largest-block-8mib-01", 8 * MiB, 32, model_id="org/wide")
    with Client(daemon.socket, layout=top) as kv:
        k = chain(8, 1)
        assert kv.store(k, [payload(top, k[0])]).stored == 1
        with kv.load(k) as got:
            assert bytes(got.views[0]) == payload(top, k[0])
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch, \
            pytest.raises(grpc.RpcError) as err:
        pb_grpc.KvTierStub(ch).RegisterLayout(pb.RegisterLayoutRequest(
            layout=b"too-large-block-8mib+1", block_bytes=8 * MiB + 1, block_tokens=32,
            key_width=32, model_id="org/too-wide"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1..8388608" in str(err.value.details()) and "max_block_bytes" in str(
        err.value.details())


def test_both_sizes_are_written_back_to_ssd_and_served_after_a_restart(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", [*ARGS, "--ssd-admit-after", "1"]).start()
    bk, sk = chain(9, 3), chain(10, 40)
    try:
        with Client(d.socket, layout=BIG) as big, Client(d.socket, layout=SMALL) as small:
            assert big.store(bk, [payload(BIG, k) for k in bk]).stored == 3
            assert small.store(sk, [payload(SMALL, k) for k in sk]).stored == 40
            wait_ssd_blocks(small, 43)
    finally:
        assert d.stop() == 0
    d.start()
    try:
        with Client(d.socket, layout=BIG) as big, Client(d.socket, layout=SMALL) as small:
            assert big.lookup(bk).tiers == [Tier.SSD] * 3
            with big.load(bk) as got:
                assert [bytes(v) for v in got.views] == [payload(BIG, k) for k in bk]
            with small.load(sk) as got:
                assert got.blocks == 40
                assert all(bytes(v) == payload(SMALL, k)
                           for v, k in zip(got.views, sk, strict=True))
    finally:
        d.stop()


def test_a_segment_of_another_format_is_refused_with_a_clear_error() -> None:
    old = pb.SegmentInfo(name="kvtier-x", size=1 << 20, generation=5, slot_bytes=2 * MiB,
                         slot_stride=2 * MiB, slot_count=1, data_offset=4096)  # format 1
    with pytest.raises(StaleSegment, match="format 1; this client reads format 2"):
        segment_handle(old)


@needs_redis
def test_both_sizes_go_through_the_remote_tier(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    r = RedisServer(tmp_path / "redis").start()
    # a 16 MiB write queue holds both sizes' writes at once, so none is dropped as queue_full
    # while an earlier one is still being sent (under load the test raced that)
    nodes = [DaemonProc(tmp_path / n, [*ARGS, "--ssd-bytes", "0", "--remote-url", r.url,
                                       "--remote-queue-bytes", "16MiB"])
             for n in ("a", "b")]
    try:
        a, b = (d.start() for d in nodes)
        bk, sk = chain(11, 2), chain(12, 24)
        def stored(n: int) -> None:
            deadline = time.monotonic() + 30
            while r.client().dbsize() < n and time.monotonic() < deadline:
                time.sleep(0.05)

        with Client(a.socket, layout=BIG) as big, Client(a.socket, layout=SMALL) as small:
            assert big.store(bk, [payload(BIG, k) for k in bk]).stored == 2
            stored(2)
            assert small.store(sk, [payload(SMALL, k) for k in sk]).stored == 24
            stored(26)
        with Client(b.socket, layout=BIG) as big, Client(b.socket, layout=SMALL) as small:
            for kv, lay, keys in ((big, BIG, bk), (small, SMALL, sk)):
                with kv.load(keys) as got:
                    assert got.tiers == [Tier.REMOTE] * len(keys)
                    assert [bytes(v) for v in got.views] == [payload(lay, k) for k in keys]
    finally:
        for d in nodes:
            d.stop()
        r.stop()


def test_a_pool_of_one_size_keeps_the_ssd_slot_file(tmp_path: Path) -> None:
    one = LayoutDecl(b"one-size-pool-64k-001", 64 * KiB, 16, model_id="org/one")
    d = DaemonProc(tmp_path / "d", ["--max-block-bytes", "64KiB", "--ssd-admit-after", "1"])
    keys = chain(13, 5)
    d.start()
    try:
        assert (d.data_dir / "ssd" / "slots.dat").exists()  # slots of 64 KiB, as before
        with Client(d.socket, layout=one) as kv:
            assert kv.store(keys, [payload(one, k) for k in keys]).stored == 5
            wait_ssd_blocks(kv, 5)
    finally:
        assert d.stop() == 0
    d.start()
    try:
        with Client(d.socket, layout=one) as kv, kv.load(keys) as got:
            assert got.tiers == [Tier.SSD] * 5
            assert [bytes(v) for v in got.views] == [payload(one, k) for k in keys]
    finally:
        d.stop()


def test_mrc_and_policy_count_blocks_of_the_registered_sizes(tmp_path: Path) -> None:
    """The MRC's "now" point (and the policy's mini caches) count DRAM in blocks of the
    registered layouts, not in smallest slots: 64 MiB holds ~15 blocks of 4 MiB, not 4,096."""
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "64MiB", "--slot-bytes", "16KiB"]).start()
    try:
        with Client(d.socket, layout=BIG) as big:
            reserved = dram(big).capacity_bytes
            now = big.stats().mrc[0]
            assert now.scaled == "none"
            assert now.dram_blocks == reserved // (4 * MiB), (now.dram_blocks, reserved)
            # a second size moves the mean block (4 MiB and 32 KiB: ~2 MiB): re-sized
            with Client(d.socket, layout=SMALL) as small:
                mean = (4 * MiB + 32 * KiB) / 2
                assert small.stats().mrc[0].dram_blocks == int(reserved // mean)
        assert d.log().count("capacity in blocks for the MRC") == 2
    finally:
        d.stop()


def moved_total(d: DaemonProc) -> float:
    line = next(x for x in d.metrics_text().splitlines()
                if x.startswith("kvtier_dram_moved_blocks_total "))
    return float(line.split()[1])


WIDE = LayoutDecl(b"wide-block-8mib-4pages", 8 * MiB, 32, model_id="org/wide-8m")


@pytest.mark.parametrize("layout", [BIG, WIDE], ids=["2-pages", "4-pages"])
def test_blocks_moved_to_empty_a_page_are_counted_on_metrics_and_still_read_back(
        daemon: DaemonProc, layout: LayoutDecl) -> None:
    # a 4 MiB block takes a row of 2 adjacent pages, an 8 MiB one a row of 4: cleared by moving
    # the small blocks left on it (`DramPool.clear_row`) or by emptying pages (evacuation)
    with Client(daemon.socket, layout=layout) as big, \
            Client(daemon.socket, layout=SMALL) as small:
        assert moved_total(daemon) == 0
        keys = [c[0] for c in roots(8, 2048)]  # all 32 pages of small blocks
        for k in keys:
            assert small.store([k], [payload(SMALL, k)]).stored == 1
        # every other block is looked up again: the cold half is spread over all pages, so
        # no page empties by eviction alone and a page is emptied by moving its blocks
        for k in keys[1::2]:
            assert small.lookup([k]).hit_blocks == 1
        bk = chain(9, 2)
        assert big.store(bk, [payload(layout, k) for k in bk]).stored == 2
        moved = moved_total(daemon)
        assert moved > 0
        held = [k for k in keys if small.lookup([k]).hit_blocks == 1]
        assert dram(small).blocks == 2 + len(held)
        # no more went than the two blocks' bytes: the moves left no free slot stranded
        assert len(held) == 2048 - 2 * layout.block_bytes // SMALL.block_bytes
        for k in held:  # the moved blocks among them: their bytes went with them
            with small.load([k]) as got:
                assert bytes(got.views[0]) == payload(SMALL, k)
        with big.load(bk) as got:
            assert [bytes(v) for v in got.views] == [payload(layout, k) for k in bk]


def test_page_moves_beside_leases_and_concurrent_stores_keep_every_byte(
        daemon: DaemonProc) -> None:
    # the moves' copies run on a worker thread without the cache lock (`Cache.allocate_async`):
    # a reader holding a lease keeps its block at its offset, and small stores running beside
    # the big ones get slots no move is using
    with Client(daemon.socket, layout=BIG) as big, \
            Client(daemon.socket, layout=SMALL) as small:
        keys = [c[0] for c in roots(8, 2048)]  # all 32 pages of small blocks
        for k in keys:
            assert small.store([k], [payload(SMALL, k)]).stored == 1
        for k in keys[1::2]:
            assert small.lookup([k]).hit_blocks == 1
        leased = keys[1:1024:64]  # a hot block on each of pages 0-15, leased throughout
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(small.load([k])) for k in leased]
            before = [bytes(h.views[0]) for h in held]
            errors: list[BaseException] = []

            def small_stores() -> None:
                try:
                    with Client(daemon.socket, layout=SMALL) as other:
                        for k in [c[0] for c in roots(7, 64)]:
                            other.store([k], [payload(SMALL, k)])
                except BaseException as exc:  # reported below
                    errors.append(exc)

            t = threading.Thread(target=small_stores)
            t.start()
            bk = chain(9, 4)
            for k in bk:
                big.store([k], [payload(BIG, k)])
            t.join()
            assert not errors
            assert [bytes(h.views[0]) for h in held] == before == [
                payload(SMALL, k) for k in leased]
        assert moved_total(daemon) > 0
        for k in keys + [c[0] for c in roots(7, 64)]:  # whatever is still cached is right
            if small.lookup([k]).hit_blocks:
                with small.load([k]) as got:
                    assert bytes(got.views[0]) == payload(SMALL, k)
        for k in leased:
            assert small.lookup([k]).hit_blocks == 1  # never evicted nor lost while leased
        stored = [k for k in bk if big.lookup([k]).hit_blocks]
        assert stored
        for k in stored:
            with big.load([k]) as got:
                assert bytes(got.views[0]) == payload(BIG, k)
