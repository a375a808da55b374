"""The daemon's KV-event stream (`kvtier serve --kv-events`): a real daemon process, a real ZMQ
subscriber decoding vLLM's KVEventBatch format, vLLM's replay endpoint, and the publisher's
behaviour with a subscriber that never reads."""

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

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core import kv_events as wire
from kvtier.core.types import Tier
from kvtier.daemon.events import BlockEvent
from kvtier.daemon.kv_publisher import KvEventPublisher
from tests.daemon_fixture import ROOT, DaemonProc

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


def test_stores_and_evictions_reach_a_subscriber_and_replay_resends_them(
        node: DaemonProc) -> None:
    pub, replay = endpoints(node.log())
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # the subscription reaches the publisher
    first, second = chain(1, 10), chain(2, 30)  # the pool holds 32 blocks of 64 KiB
    try:
        with Client(node.socket, layout=LAYOUT) as kv:
            kv.store(first, blocks(10))
            live = receive(sub, lambda m: sum(
                len(e.block_hashes) for e in flat(m) if isinstance(e, wire.BlockStored)) >= 10)
            kv.store(second, blocks(30))
            live += receive(sub, lambda m: any(isinstance(e, wire.BlockRemoved)
                                               for e in flat(m)))
            time.sleep(0.3)
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                live.append((topic, wire.sequence(seq), wire.decode(payload)))
        assert {t for t, _, _ in live} == {b"kv@node-a@m"}
        assert [s for _, s, _ in live] == list(range(len(live)))  # vLLM's: batches from 0
        events = flat(live)
        stored = [e for e in events if isinstance(e, wire.BlockStored)]
        assert stored[0].block_hashes == first and stored[0].parent_block_hash is None
        assert {e.medium for e in stored} == {"CPU"} and {e.block_size for e in stored} == {16}
        assert {e.ownership for e in events} == {"kvtier"}
        gone = [h for e in events if isinstance(e, wire.BlockRemoved) for h in e.block_hashes]
        assert gone and set(gone) <= set(first + second)
        assert {e.medium for e in events if isinstance(e, wire.BlockRemoved)} == {"CPU"}
        with Client(node.socket, layout=LAYOUT) as kv:  # what was removed is really gone
            assert kv.lookup([gone[0]]).hit_blocks == 0

        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000)
            _, topic, seq, payload = req.recv_multipart()
            if wire.sequence(seq) == -1:
                break
            replayed.append((topic, wire.sequence(seq), wire.decode(payload)))
        assert [(s, b.events) for _, s, b in replayed] == [(s, b.events) for _, s, b in live[1:]]
        req.close(0)
        metrics = node.metrics_text()
        published = re.search(r'kvtier_kv_event_blocks_total\{result="published"\} (\S+)',
                              metrics)
        assert published and float(published.group(1)) == sum(
            len(e.block_hashes) for e in events)
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
    time.sleep(0.3)
    try:
        n = 60_000
        t0 = time.perf_counter()
        for i in range(n):
            publisher.offer(_event(i))
            if i % 5000 == 0:
                time.sleep(0.01)  # let the thread drain, so the queue itself does not fill
        offered = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while (publisher.published_blocks + sum(publisher.dropped_blocks.values()) < n
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert publisher.published_blocks + sum(publisher.dropped_blocks.values()) == n
        assert publisher.dropped_blocks["hwm"] > 0  # the subscriber never read
        assert offered < 10.0  # the producer was never blocked on the subscriber
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
