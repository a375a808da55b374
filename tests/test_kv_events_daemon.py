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
