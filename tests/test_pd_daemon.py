"""Prefill/decode hand-off in real daemons: a Lookup that waits (`wait_pending_s`) for blocks
another client has allocated but not committed, and across two daemons sharing a real
redis-server, a producer's hand-off (`allocate(handoff=True)`) that a consumer's daemon waits for
in the store.

Every wait is observed, not timed: the test waits until the daemon reports the Lookup waiting
(`kvtier_pending_waits_active`) before it commits or aborts, and each outcome is read from the
daemon's counters (`kvtier_pending_waits_total{tier, result}`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.types import Tier
from tests.daemon_fixture import DaemonProc, wait_for
from tests.redis_fixture import RedisServer, needs_redis

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"pd-layout-fp-0001", block_bytes=BLOCK, block_tokens=16,
                    model_id="pd-test-model")
LONG = 300.0
"""A wait's bound far beyond anything the tests wait for (the daemons here allow it: `WAIT`): a
wait that ended did so for its reason (commit, abort), never for the bound, even on a machine
that stops for tens of seconds."""
WAIT = ("--max-pending-wait-s", "600", "--remote-timeout-s", "60")


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def metric(d: DaemonProc, name: str, labels: str = "") -> float:
    """The sum of `name`'s series whose label text contains `labels` (0 when none)."""
    total = 0.0
    for line in d.metrics_text().splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and labels in head:
            total += float(value)
    return total


class Waiting:
    """A Lookup with a wait on a thread of its own: `result()` joins it."""

    def __init__(self, kv: Client, keys: list[bytes], wait_s: float = LONG) -> None:
        self.got: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            started = time.monotonic()
            try:
                self.got = kv.lookup(keys, wait_pending_s=wait_s)
            except BaseException as exc:
                self.error = exc
            self.seconds = time.monotonic() - started

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(LONG * 2)  # the client's timeout ends a call at LONG + its own
        assert not self.thread.is_alive(), "the Lookup never answered"
        if self.error is not None:
            raise self.error
        return self.got


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", WAIT).start()
    try:
        yield d
    finally:
        d.stop()


def waiting(d: DaemonProc, n: int = 1) -> None:
    wait_for(lambda: metric(d, "kvtier_pending_waits_active") == n, timeout=LONG)


def fill(kv: Client, keys: list[bytes], data: list[bytes], reply: Any) -> int:
    with kv.store_into(keys, allocated=reply) as tx:
        for i, view in tx.slots:
            view[:] = np.frombuffer(data[i], np.uint8)
    return tx.committed


def test_lookup_waits_for_the_writers_commit(daemon: DaemonProc) -> None:
    keys, data = chain(1, 8), payloads(8, 1)
    with Client(daemon.socket, layout=LAYOUT) as producer, \
            Client(daemon.socket, layout=LAYOUT) as consumer:
        reply = producer.allocate(keys)
        assert len(reply.indices) == 8
        assert consumer.lookup(keys).hit_blocks == 0  # no wait asked: a miss, at once
        w = Waiting(consumer, keys)
        waiting(daemon)
        assert fill(producer, keys, data, reply) == 8
        got = w.result()
        assert got.hit_blocks == 8 and got.tiers == [Tier.DRAM] * 8
        with consumer.load(keys) as loaded:
            assert [bytes(v) for v in loaded.views] == data
        assert consumer.stats().active_leases == 0
    assert metric(daemon, "kvtier_pending_waits_total", 'result="committed"') == 1
    assert metric(daemon, "kvtier_pending_wait_seconds_count") == 1
    assert metric(daemon, "kvtier_pending_waits_active") == 0


def test_a_chain_written_in_several_leases_is_waited_for_whole(
        daemon: DaemonProc) -> None:
    """A prefill computed in chunks stores one lease per step: the wait follows the chain from
    one lease to the next until the last is committed."""
    keys, data = chain(2, 9), payloads(9, 2)
    with Client(daemon.socket, layout=LAYOUT) as producer, \
            Client(daemon.socket, layout=LAYOUT) as consumer:
        first = producer.allocate(keys[:3])
        second = producer.allocate(keys[3:6], keys[2])
        third = producer.allocate(keys[6:], keys[5])
        w = Waiting(consumer, keys)
        waiting(daemon)
        fill(producer, keys[:3], data[:3], first)
        fill(producer, keys[3:6], data[3:6], second)
        fill(producer, keys[6:], data[6:], third)
        assert w.result().hit_blocks == 9


def test_an_abort_ends_the_wait_at_once(daemon: DaemonProc) -> None:
    keys = chain(3, 4)
    with Client(daemon.socket, layout=LAYOUT) as producer, \
            Client(daemon.socket, layout=LAYOUT) as consumer:
        reply = producer.allocate(keys)
        w = Waiting(consumer, keys)
        waiting(daemon)
        producer.abort(reply.lease_id)
        assert w.result().hit_blocks == 0
        assert w.seconds < LONG / 2
    assert metric(daemon, "kvtier_pending_waits_total", 'result="aborted"') == 1


def test_a_writer_that_goes_away_ends_the_wait(daemon: DaemonProc) -> None:
    """The producer's client closes (its process died): the daemon ends its session's leases,
    and the wait with them."""
    keys = chain(4, 4)
    with Client(daemon.socket, layout=LAYOUT) as consumer:
        producer = Client(daemon.socket, layout=LAYOUT)
        producer.allocate(keys)
        w = Waiting(consumer, keys)
        waiting(daemon)
        producer.close()
        assert w.result().hit_blocks == 0
    assert metric(daemon, "kvtier_pending_waits_total", 'result="aborted"') == 1


def test_the_daemon_bounds_the_wait(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--max-pending-wait-s", "0.3"]).start()
    try:
        keys = chain(5, 4)
        with Client(d.socket, layout=LAYOUT) as producer, \
                Client(d.socket, layout=LAYOUT) as consumer:
            reply = producer.allocate(keys)
            w = Waiting(consumer, keys, wait_s=LONG)  # asks for more than the daemon allows
            assert w.result().hit_blocks == 0
            assert w.seconds < LONG / 2
            producer.abort(reply.lease_id)
        assert metric(d, "kvtier_pending_waits_total", 'result="timeout"') == 1
    finally:
        d.stop()


def test_nothing_pending_answers_at_once(daemon: DaemonProc) -> None:
    """A wait asked for blocks nobody writes costs nothing: no wait is counted."""
    keys, data = chain(6, 4), payloads(4, 6)
    with Client(daemon.socket, layout=LAYOUT) as kv:
        kv.store(keys[:2], data[:2])
        assert kv.lookup(keys, wait_pending_s=LONG).hit_blocks == 2
    assert metric(daemon, "kvtier_pending_waits_total") == 0


def test_another_tenants_writes_are_never_waited_for(tmp_path: Path) -> None:
    """Tenant B cannot see (nor be slowed by) tenant A's blocks being written under the same
    key bytes: its namespace is its own."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.a]\ntoken = "' + "a" * 32 + '"\n'
                      '[tenants.b]\ntoken = "' + "b" * 32 + '"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens), *WAIT]).start()
    try:
        keys = chain(7, 4)
        with Client(d.socket, layout=LAYOUT, token="a" * 32) as a, \
                Client(d.socket, layout=LAYOUT, token="b" * 32) as b:
            reply = a.allocate(keys)
            w = Waiting(b, keys)
            assert w.result().hit_blocks == 0
            assert w.seconds < LONG / 2
            a.abort(reply.lease_id)
        assert metric(d, "kvtier_pending_waits_total") == 0
    finally:
        d.stop()


# -- across two daemons sharing a real redis-server -------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    r = RedisServer(tmp_path / "redis").start()
    try:
        yield r
    finally:
        r.stop()


def node(tmp: Path, name: str, url: str, *args: str) -> DaemonProc:
    return DaemonProc(tmp / name, ["--remote-url", url, "--ssd-bytes", "0", *WAIT,
                                   *args]).start()


@pytest.fixture
def nodes(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A producer's daemon whose background copies to the store are throttled to nothing
    (1 byte/s after one block, and only at a block's 5th access), and a consumer's."""
    a = node(tmp_path, "a", redis_server.url, "--remote-admit-after", "5",
             "--remote-write-bytes-per-s", "1B", "--remote-write-burst-bytes", "64KiB")
    b = node(tmp_path, "b", redis_server.url)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def markers(r: RedisServer) -> int:
    return len(r.client().keys("kvtier:pending:*"))


@needs_redis
def test_handoff_reaches_the_other_node_ahead_of_background_copies(
        nodes: tuple[DaemonProc, DaemonProc], redis_server: RedisServer) -> None:
    a, b = nodes
    db = redis_server.client()
    keys, data = chain(10, 8), payloads(8, 10)
    background = chain(11, 4)
    with Client(a.socket, layout=LAYOUT) as producer, \
            Client(b.socket, layout=LAYOUT) as consumer:
        producer.store(background, payloads(4, 11))  # a background copy: never admitted
        reply = producer.allocate(keys, handoff=True)
        assert markers(redis_server) == 8  # marked before the Allocate returned
        w = Waiting(consumer, keys)
        waiting(b)
        assert fill(producer, keys, data, reply) == 8
        got = w.result()
        assert got.hit_blocks == 8 and got.tiers == [Tier.REMOTE] * 8
        with consumer.load(keys) as loaded:
            assert [bytes(v) for v in loaded.views] == data
        assert consumer.lookup(background).hit_blocks == 0
    wait_for(lambda: markers(redis_server) == 0)  # each deleted with its block's write
    assert db.dbsize() == 8
    assert metric(a, "kvtier_remote_blocks_written_total") == 8
    assert metric(b, "kvtier_pending_waits_total", 'result="committed",tier="remote"') == 1


@needs_redis
def test_an_aborted_handoff_ends_the_other_nodes_wait(
        nodes: tuple[DaemonProc, DaemonProc], redis_server: RedisServer) -> None:
    a, b = nodes
    keys = chain(12, 4)
    with Client(a.socket, layout=LAYOUT) as producer, \
            Client(b.socket, layout=LAYOUT) as consumer:
        reply = producer.allocate(keys, handoff=True)
        w = Waiting(consumer, keys)
        waiting(b)
        producer.abort(reply.lease_id)
        assert w.result().hit_blocks == 0
        assert w.seconds < LONG / 2
    assert markers(redis_server) == 0
    assert metric(b, "kvtier_pending_waits_total", 'result="aborted",tier="remote"') == 1


@needs_redis
def test_handoff_sends_cached_blocks_the_store_lacks(
        nodes: tuple[DaemonProc, DaemonProc], redis_server: RedisServer) -> None:
    """The producer's daemon already held the prefix (stored earlier, never copied to the
    store): the hand-off's Allocate allocates nothing, and still sends those blocks."""
    a, b = nodes
    keys, data = chain(13, 6), payloads(6, 13)
    with Client(a.socket, layout=LAYOUT) as producer, \
            Client(b.socket, layout=LAYOUT) as consumer:
        producer.store(keys, data)
        assert redis_server.client().dbsize() == 0
        reply = producer.allocate(keys, handoff=True)
        assert not reply.lease_id
        got = consumer.lookup(keys, wait_pending_s=LONG)
        assert got.hit_blocks == 6 and got.tiers == [Tier.REMOTE] * 6
        with consumer.load(keys) as loaded:
            assert [bytes(v) for v in loaded.views] == data
    wait_for(lambda: markers(redis_server) == 0)
