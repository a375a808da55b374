"""The daemon's KV-event stream (`kvtier serve --kv-events`): a real daemon process, a real ZMQ
subscriber decoding vLLM's KVEventBatch format (ours, and vLLM 0.32's own msgspec classes), vLLM's
replay endpoint, every tier's medium (DRAM, a real LMDB SSD tier, a real redis-server remote tier),
and a subscriber that never reads (dropped at the high-water mark, counted on /metrics, the daemon
unaffected)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core import kv_events as wire
from kvtier.core.types import Tier
from kvtier.daemon.cache.events import BlockEvent
from kvtier.daemon.kv_publisher import KvEventPublisher
from tests.daemon_fixture import ROOT, DaemonProc
from tests.redis_fixture import RedisServer, needs_redis

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"test-layout-kvev-1", block_bytes=BLOCK, block_tokens=16,
                    model_id="test-model-kvev")


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def blocks(n: int) -> list[bytes]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def endpoints(log: str) -> tuple[str, str]:
    m = re.search(r"KV events (tcp://[\d.]+:\d+) \(replay (tcp://[\d.]+:\d+)\)", log)
    assert m, log
    return m.group(1), m.group(2)


def receive(sub: zmq.Socket[bytes], until: object, timeout: float = 10.0
            ) -> list[tuple[bytes, int, wire.EventBatch]]:
    """Messages (topic, sequence, batch) until `until(messages)` holds."""
    got: list[tuple[bytes, int, wire.EventBatch]] = []
    deadline = time.monotonic() + timeout
    while not until(got):  # type: ignore[operator]
        assert time.monotonic() < deadline, got
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, wire.sequence(seq), wire.decode(payload)))
    return got


def flat(msgs: list[tuple[bytes, int, wire.EventBatch]]) -> list[wire.Event]:
    return [e for _, _, b in msgs for e in b.events]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", [
        "--dram-bytes", "2MiB", "--ssd-bytes", "0", "--kv-events", "tcp://127.0.0.1:*",
        "--kv-events-replay", "tcp://127.0.0.1:*", "--kv-events-topic", "kv@node-a@m",
    ]).start()
    try:
        yield d
    finally:
        d.stop()


def stored_hashes(msgs: list[tuple[bytes, int, wire.EventBatch]]) -> list[bytes]:
    return [h for e in flat(msgs) if isinstance(e, wire.BlockStored) for h in e.block_hashes]


def removed_hashes(msgs: list[tuple[bytes, int, wire.EventBatch]]) -> list[bytes]:
    return [h for e in flat(msgs) if isinstance(e, wire.BlockRemoved) for h in e.block_hashes]


def join(sub: zmq.Socket[bytes], kv: Client) -> tuple[list[bytes], int]:
    """Stores one-block probe chains until `sub` receives an event (ZMQ's slow joiner: what the
    publisher sends before the subscription reached it is lost), then drains the rest of the
    probes' events. Returns the probes' keys and the sequence number of the next batch."""
    probes: list[bytes] = []
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        probes.append(bytes([0, len(probes)]) + bytes(30))
        kv.store([probes[-1]], blocks(1))
        if sub.poll(500):
            break
    got = receive(sub, lambda m: probes[-1] in stored_hashes(m))
    seqs = [s for _, s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    return probes, seqs[-1] + 1


def test_stores_and_evictions_reach_a_subscriber_and_replay_resends_them(
        node: DaemonProc) -> None:
    pub, replay = endpoints(node.log())
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    first, second = chain(1, 10), chain(2, 30)  # the pool holds 32 blocks of 64 KiB
    try:
        with Client(node.socket, layout=LAYOUT) as kv:
            probes, base = join(sub, kv)
            kv.store(first, blocks(10))
            live = receive(sub, lambda m: len(stored_hashes(m)) >= 10)
            kv.store(second, blocks(30))
            # every block stored once; those the node no longer holds were removed (leaf-first
            # eviction keeps a prefix of each chain, so a lookup counts what is still held)
            held = (kv.lookup(first).hit_blocks + kv.lookup(second).hit_blocks
                    + sum(kv.lookup([k]).hit_blocks for k in probes))
            evicted = len(first) + len(second) + len(probes) - held
            assert evicted >= 8 + len(probes)  # 40 + probes blocks into 32 slots
            live += receive(sub, lambda m: len(stored_hashes(live + m)) >= 40
                            and len(removed_hashes(live + m)) >= evicted)
        assert {t for t, _, _ in live} == {b"kv@node-a@m"}
        # no batch lost once joined; vLLM's numbering counts batches from 0 (checked on the
        # replay below)
        assert [s for _, s, _ in live] == list(range(base, base + len(live)))
        events = flat(live)
        stored = [e for e in events if isinstance(e, wire.BlockStored)]
        assert stored[0].block_hashes == first and stored[0].parent_block_hash is None
        assert stored_hashes(live) == first + second
        assert {e.medium for e in stored} == {"CPU"} and {e.block_size for e in stored} == {16}
        assert {e.ownership for e in events} == {"kvtier"}
        gone = removed_hashes(live)
        assert len(gone) == evicted and set(gone) <= set(first + second + probes)
        assert {e.medium for e in events if isinstance(e, wire.BlockRemoved)} == {"CPU"}
        with Client(node.socket, layout=LAYOUT) as kv:  # what was removed is really gone
            assert kv.lookup([gone[0]]).hit_blocks == 0

        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000)
            _, topic, seq, payload = req.recv_multipart()
            if wire.sequence(seq) == -1:
                break
            replayed.append((topic, wire.sequence(seq), wire.decode(payload)))
        assert [s for _, s, _ in replayed] == list(range(base + len(live)))
        assert [b.events for _, _, b in replayed[base:]] == [b.events for _, _, b in live]
        head = flat(replayed[:1])[0]  # the first probe's store, batch 0
        assert isinstance(head, wire.BlockStored) and head.block_hashes == probes[:1]
        req.close(0)
        metrics = node.metrics_text()
        published = re.search(r'kvtier_kv_event_blocks_total\{result="published"\} (\S+)',
                              metrics)
        assert published and float(published.group(1)) == sum(
            len(e.block_hashes) for e in flat(replayed))
    finally:
        sub.close(0)
        ctx.term()


def test_bad_kv_events_endpoint_exits_2(tmp_path: Path) -> None:
    for args, says in ((["--kv-events", "http://127.0.0.1:5557"], "kv_events"),
                       (["--kv-events-replay", "tcp://127.0.0.1:5558"], "needs kv_events"),
                       (["--kv-events", "tcp://127.0.0.1:5557", "--kv-events-hwm", "0"],
                        "kv_events_hwm")):
        r = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--socket",
                            str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "data"),
                            *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert not (tmp_path / "s.sock").exists()


def _event(i: int) -> BlockEvent:
    return BlockEvent(i, i, 0.0, "t", b"", True, Tier.DRAM, (i.to_bytes(32, "big"),), b"", 16)


def test_a_subscriber_that_never_reads_is_dropped_at_the_hwm_not_waited_for() -> None:
    ctx = zmq.Context()
    publisher = KvEventPublisher("tcp://127.0.0.1:*", "", "t", hwm=1)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        # until the subscription reached the publisher (before, a send is not to anyone), one
        # event at a time; the subscriber reads these, and nothing after
        probes = 0
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            publisher.offer(_event(0))
            probes += 1
            if sub.poll(200):
                break
        sub.recv_multipart()
        n = 60_000
        t0 = time.perf_counter()
        for i in range(n):
            publisher.offer(_event(i))
            if i % 5000 == 0:
                time.sleep(0.01)  # let the thread drain, so the queue itself does not fill
        offered = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while (publisher.published_blocks + sum(publisher.dropped_blocks.values()) < n + probes
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert publisher.published_blocks + sum(publisher.dropped_blocks.values()) == n + probes
        assert publisher.dropped_blocks["hwm"] > 0  # the subscriber stopped reading
        # The producer was never blocked on the subscriber: one that waited for it would never
        # finish, and one that waited 1 ms per event would take 60 s. 12 pauses of 10 ms and
        # 60,000 deque appends take well under a second even on a loaded machine.
        assert offered < 10.0
    finally:
        sub.close(0)
        ctx.term()
        publisher.close()


def test_a_plain_address_is_a_collectors_to_connect_to_as_in_vllm() -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # llm-d's indexer binds; publishers connect
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}", "", "kv@node@m", hwm=100)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            assert time.monotonic() < deadline
            publisher.offer(_event(1))  # until the connection is up (a PUB drops before)
        topic, seq, payload = sub.recv_multipart()
        (event,) = wire.decode(payload).events
        assert topic == b"kv@node@m" and wire.sequence(seq) >= 0
        assert isinstance(event, wire.BlockStored) and event.block_hashes == [
            (1).to_bytes(32, "big")]
    finally:
        publisher.close()
        sub.close(0)
        ctx.term()


def metric(d: DaemonProc, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", d.metrics_text(), re.M)
    assert m, series
    return float(m.group(1))


PUBLISHED = 'kvtier_kv_event_blocks_total{result="published"}'
DROPPED_HWM = 'kvtier_kv_event_blocks_total{result="dropped_hwm"}'


def subscribe(sub: zmq.Socket[bytes], where: str) -> None:
    """Connects `sub` to the publisher at `where`, subscribed to everything, and returns once
    the connection is up (its ZMTP handshake done, watched on a monitor socket) and a moment
    more for the subscription to reach the publisher: what it publishes before that is lost
    (ZMQ's slow joiner). A fixed sleep instead was too short when a loaded machine was slow
    to connect."""
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(where)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert monitor.poll(30_000), f"no connection to {where} in 30 s"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sub.disable_monitor()
        monitor.close(0)
    time.sleep(0.3)  # the subscription, sent right after the handshake, reaches the publisher


class Stream:
    """A SUB socket on a daemon's KV-event endpoint, and every event it decoded, in order."""

    def __init__(self, d: DaemonProc) -> None:
        self.d = d
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        subscribe(self.sub, endpoint(d.log()))
        self.events: list[wire.Event] = []

    def drain(self, timeout: float = 15.0) -> list[wire.Event]:
        """Reads until every block the daemon has published so far has arrived (its
        `published` counter equals the blocks received) and nothing is pending."""
        deadline = time.monotonic() + timeout
        while True:
            while self.sub.poll(50):
                _, _, payload = self.sub.recv_multipart()
                self.events.extend(wire.decode(payload).events)
            got = sum(len(e.block_hashes) for e in self.events
                      if isinstance(e, wire.BlockStored | wire.BlockRemoved))
            if metric(self.d, PUBLISHED) == got and not self.sub.poll(200):
                return self.events
            assert time.monotonic() < deadline, (metric(self.d, PUBLISHED), got)

    def hashes(self, kind: type, medium: str) -> list[object]:
        return [h for e in self.events if isinstance(e, kind) and e.medium == medium
                for h in e.block_hashes]

    def held(self) -> dict[object, set[str]]:
        """What the stream says the node holds: block -> media (stores minus removals)."""
        out: dict[object, set[str]] = {}
        for e in self.events:
            for h in getattr(e, "block_hashes", ()):
                if isinstance(e, wire.BlockStored):
                    out.setdefault(h, set()).add(str(e.medium))
                else:
                    out[h].discard(str(e.medium))
        return {h: m for h, m in out.items() if m}

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def endpoint(log: str) -> str:
    m = re.search(r"KV events (tcp://[\d.]+:\d+)", log)
    assert m, log
    return m.group(1)


def show(events: list[wire.Event]) -> list[str]:
    return [f"{type(e).__name__} {getattr(e, 'medium', '')} "
            f"{[h[:2].hex() for h in getattr(e, 'block_hashes', ())]}"  # type: ignore[index]
            for e in events]


def store_until(kv: Client, stream: Stream, keys: list[bytes], medium: str) -> None:
    """Stores a chain 8 blocks at a time (the daemons here queue 16 writes), each part once the
    stream has announced the one before in `medium`."""
    for i in range(0, len(keys), 8):
        part = keys[i:i + 8]
        kv.store(part, blocks(len(part)), parent=keys[i - 1] if i else b"")
        deadline = time.monotonic() + 15
        while not set(part) <= set(stream.hashes(wire.BlockStored, medium)):
            assert time.monotonic() < deadline, show(stream.events)
            stream.drain()


def test_an_ssd_tier_is_published_as_storage_and_a_block_leaves_the_node_with_its_last_medium(
        tmp_path: Path) -> None:
    # DRAM holds 32 blocks; the SSD tier (a real LMDB, written at Commit, no write budget in
    # the way) 47 with their headers
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "2MiB", "--ssd-bytes", "3MiB",
                                    "--ssd-admit-after", "1", "--ssd-write-burst-bytes", "64MiB",
                                    "--writeback-queue-bytes", "1MiB",
                                    "--kv-events", "tcp://127.0.0.1:*"]).start()
    stream = Stream(d)
    a, b, c = chain(1, 10), chain(2, 30), chain(3, 16)
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            store_until(kv, stream, a, "STORAGE")
            stored_ssd = [e for e in stream.events
                          if isinstance(e, wire.BlockStored) and e.medium == "STORAGE"]
            assert [h for e in stored_ssd for h in e.block_hashes] == a
            assert stored_ssd[0].parent_block_hash is None  # a's root starts the chain
            assert {(e.locality, e.ownership, e.block_size) for e in stored_ssd} == {
                ("LOCAL", "kvtier", 16)}
            assert stream.hashes(wire.BlockStored, "CPU") == a

            # 40 blocks in a 32-block pool: a's leave DRAM, not SSD
            store_until(kv, stream, b, "STORAGE")
            left_dram = stream.hashes(wire.BlockRemoved, "CPU")
            assert len(left_dram) >= 8 and set(left_dram) <= set(a)
            assert stream.hashes(wire.BlockRemoved, "STORAGE") == []

            # 56 blocks > the SSD tier: the oldest (a's) leave it too (no Lookup before: it
            # would make a's blocks the most recently used)
            store_until(kv, stream, c, "STORAGE")
            left_ssd = stream.hashes(wire.BlockRemoved, "STORAGE")
            assert left_ssd
            # the stream's view (per block, the media stored minus removed) is the daemon's
            held = stream.held()
            assert any(m == {"STORAGE"} for m in held.values())  # left DRAM, still on the node
            best = {"CPU": Tier.DRAM, "STORAGE": Tier.SSD}
            for keys in (a, b, c):
                r = kv.lookup(keys)
                assert [best["CPU" if "CPU" in held[k] else "STORAGE"]
                        for k in keys[:r.hit_blocks]] == r.tiers
                assert not any(k in held for k in keys[r.hit_blocks:]), keys
            gone = [k for k in left_ssd if k not in held]
            assert gone  # left its last medium: the lookup no longer finds it
            for keys in (a, b, c):
                for i, k in enumerate(keys):
                    if k in gone:
                        assert kv.lookup(keys[:i + 1]).hit_blocks <= i
    finally:
        stream.close()
        d.stop()


@needs_redis
def test_the_remote_tier_is_published_as_remote_and_outlives_the_dram_copy(
        tmp_path: Path) -> None:
    pytest.importorskip("redis")
    redis = RedisServer(tmp_path / "redis").start()
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "2MiB", "--ssd-bytes", "0",
                                    "--remote-url", redis.url, "--remote-queue-bytes", "1MiB",
                                    "--kv-events", "tcp://127.0.0.1:*"]).start()
    stream = Stream(d)
    a, b = chain(1, 10), chain(2, 30)
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            store_until(kv, stream, a, "REMOTE")
            remote = [e for e in stream.events
                      if isinstance(e, wire.BlockStored) and e.medium == "REMOTE"]
            assert [h for e in remote for h in e.block_hashes] == a
            assert remote[0].parent_block_hash is None
            assert {(e.locality, e.ownership, e.block_size) for e in remote} == {
                ("REMOTE", "kvtier", 16)}
            assert redis.client().dbsize() == 10  # what the events announce is in the store

            store_until(kv, stream, b, "REMOTE")  # a's leave DRAM; the shared store keeps them
            left = stream.hashes(wire.BlockRemoved, "CPU")
            assert len(left) >= 8 and set(left) <= set(a)
            assert stream.hashes(wire.BlockRemoved, "REMOTE") == []
            hit = kv.lookup(a)
            assert hit.hit_blocks == 10 and Tier.REMOTE in hit.tiers
    finally:
        stream.close()
        d.stop()
        redis.stop()


def test_a_subscriber_that_never_reads_is_dropped_and_counted_while_the_daemon_serves(
        tmp_path: Path) -> None:
    # --kv-events-hwm 1: one message queued for the subscriber; over ipc:// (a Unix socket) the
    # kernel's buffers on the way hold ~200 KB, where loopback TCP's grow to megabytes
    where = f"ipc://{tmp_path}/kv-events"
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "2MiB", "--ssd-bytes", "0",
                                    "--kv-events", where, "--kv-events-hwm", "1"]).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    subscribe(sub, where)  # and never reads
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            probe = chain(9, 4)
            kv.store(probe, blocks(4))
            before = lookup_s(kv, probe)
            data = blocks(28)
            n = 0

            def store_chains(count: int) -> None:  # 28 new blocks each; the pool evicts 28
                nonlocal n
                for _ in range(count):
                    kv.store([bytes([100, n // 256, n % 256, j]) + bytes(28) for j in range(28)],
                             data)
                    n += 1

            # until the buffers on the way are full (~5,000 blocks here): a round of stores of
            # which nothing is published and something is dropped
            deadline = time.monotonic() + 60
            published, dropped = 0.0, 0.0
            while True:
                assert time.monotonic() < deadline, (published, dropped)
                store_chains(5)
                time.sleep(0.05)
                was = published, dropped
                published, dropped = metric(d, PUBLISHED), metric(d, DROPPED_HWM)
                if published == was[0] and dropped > was[1]:
                    break
            store_chains(20)  # 560 blocks stored, 560 evicted: all go to a full subscriber
            deadline = time.monotonic() + 10
            while metric(d, PUBLISHED) + metric(d, DROPPED_HWM) < published + dropped + 1120:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert metric(d, DROPPED_HWM) - dropped >= 1100  # dropped and counted
            assert metric(d, PUBLISHED) - published <= 28  # one batch at most slips through
            kv.store(probe, blocks(4))
            after = lookup_s(kv, probe)
        assert after < max(5 * before, 0.02), (before, after)  # never waits on the subscriber
        assert d.healthy()
    finally:
        sub.close(0)
        ctx.term()
        d.stop()


def lookup_s(kv: Client, keys: list[bytes]) -> float:
    """Seconds per Lookup (a full hit), the median of 50."""
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        assert kv.lookup(keys).hit_blocks == len(keys)
        times.append(time.perf_counter() - t0)
    return sorted(times)[25]


def test_vllms_own_decoder_reads_the_daemons_stream(node: DaemonProc) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    stream = Stream(node)
    a, b = chain(1, 10), chain(2, 30)
    try:
        with Client(node.socket, layout=LAYOUT) as kv:
            kv.store(a, blocks(10))
            kv.store(b, blocks(30))
        payloads: list[bytes] = []
        deadline = time.monotonic() + 10
        got = 0
        while got < 48:  # 40 stored + at least 8 removed to make room
            assert time.monotonic() < deadline
            if stream.sub.poll(100):
                topic, seq, payload = stream.sub.recv_multipart()
                assert topic == b"kv@node-a@m" and len(seq) == 8
                payloads.append(payload)
                got += sum(len(getattr(e, "block_hashes", ()))
                           for e in wire.decode(payload).events)
        # vLLM 0.32's subscriber decodes with its own KVEventBatch (msgspec, array-like)
        decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        batches = [decoder.decode(p) for p in payloads]
        events = [e for batch in batches for e in batch.events]
        assert all(isinstance(batch.ts, float) and batch.ts > 0 for batch in batches)
        stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
        removed = [e for e in events if isinstance(e, kv_events.BlockRemoved)]
        assert [h for e in stored for h in e.block_hashes] == a + b
        assert stored[0].parent_block_hash is None and stored[0].block_size == 16
        assert stored[0].token_ids == [] and stored[0].lora_id is None
        assert {(e.medium, e.locality, e.ownership) for e in stored + removed} == {
            ("CPU", "LOCAL", "kvtier")}
        assert removed and {h for e in removed for h in e.block_hashes} <= set(a + b)
    finally:
        stream.close()
