"""The streaming byte path's bulk calls on the lookup socket (`kvtier.core.lookupwire.BULK`:
WriteBlocks and ReadBlocks with raw payloads) against a real daemon: a streaming client stores
and loads through them with the RPC's results, and hostile peers — a truncated or stalled
payload, a disconnect mid-write or mid-read, an oversized frame, bytes past the payload, another
tenant's layout, too many keys — get the RPC's codes, leave no lease behind and commit nothing."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core import lookupwire as wire
from kvtier.core.methods import BY_NAME
from tests.daemon_fixture import DaemonProc, wait_for

BLOCK = 64 << 10  # the fixture's slot size
LAYOUT = LayoutDecl(b"bulk-stream-layout", BLOCK, 16, model_id="bulk/model")
BOB_LAYOUT = LayoutDecl(b"bulk-stream-bob-only", BLOCK, 16, model_id="bulk/model")
ALICE, BOB = "alice-bulk-token-1", "bob-bulk-token-22"
WRITE, READ = BY_NAME["WriteBlocks"].number, BY_NAME["ReadBlocks"].number


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    work = tmp_path_factory.mktemp("bulk")
    tokens = work / "tokens.toml"
    tokens.write_text(f'[tenants.alice]\ntoken = "{ALICE}"\n\n[tenants.bob]\ntoken = "{BOB}"\n')
    d = DaemonProc(work / "d", ["--tokens-file", str(tokens), "--max-blocks-per-request",
                                "16"]).start()
    try:
        with Client(d.socket, layout=BOB_LAYOUT, token=BOB):
            pass  # bob's layout, registered
        yield d
    finally:
        d.stop()


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, 0xB5]) + i.to_bytes(2, "little") + bytes(28) for i in range(n)]


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def connect(d: DaemonProc, token: str = ALICE) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(str(d.socket) + ".lookup")
    conn.sendall(wire.hello(token))
    assert reply(conn) == (b"", None)
    return conn


def reply(conn: socket.socket) -> tuple[bytes, None] | tuple[int, str]:
    head = recv_exactly(conn, 4)
    return wire.parse_reply(recv_exactly(conn, int.from_bytes(head, "little")))


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def header(k: list[bytes], layout: bytes = LAYOUT.layout_id) -> bytes:
    return pb.WriteHeader(layout=layout, keys=b"".join(k), key_width=32).SerializeToString()


def hits(d: DaemonProc, k: list[bytes]) -> int:
    with Client(d.socket, layout=LAYOUT, token=ALICE) as kv:
        return kv.lookup(k).hit_blocks


def leases(d: DaemonProc) -> int:
    with Client(d.socket, layout=LAYOUT, token=ALICE) as kv:
        return int(kv.stats().active_leases)


def test_a_streaming_client_stores_and_loads_through_the_bulk_calls(daemon: DaemonProc) -> None:
    data = blocks(6, 1)
    with Client(daemon.socket, layout=LAYOUT, token=ALICE, streaming=True) as kv:
        assert not kv.uses_shm
        stored = kv.store(keys(1, 6), data)
        assert kv._lookups is not None and kv._lookups._idle  # over the socket (kept)
        assert (stored.stored, stored.skipped) == (6, 0)
        again = kv.store(keys(1, 4), data[:4])  # cached already: skipped, bytes not stored
        assert (again.stored, again.skipped) == (0, 4)
        with kv.load([*keys(1, 6), *keys(2, 2)]) as got:  # the cached prefix: 6 blocks
            assert got.blocks == 6 and len(got.views) == 6
            for view, want in zip(got.views, data, strict=True):
                assert np.array_equal(view, want)
                assert not view.flags.writeable
        with kv.load(keys(3, 2)) as none:
            assert none.blocks == 0 and none.views == []
        # the same blocks over shared memory (another client): what was stored is what is read
        with Client(daemon.socket, layout=LAYOUT, token=ALICE) as shm, shm.load(keys(1, 6)) as g:
            assert shm.uses_shm and g.blocks == 6
            assert all(np.array_equal(v, w) for v, w in zip(g.views, data, strict=True))
    assert leases(daemon) == 0


def test_a_truncated_payload_then_a_disconnect_commits_nothing(daemon: DaemonProc) -> None:
    conn = connect(daemon)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(10, 4))))
    assert reply(conn) == (b"", None)  # slots claimed: send the payload
    assert leases(daemon) == 1
    conn.sendall(bytes(BLOCK * 2 + 1000))  # 2 blocks and a bit of 4
    time.sleep(0.2)
    conn.close()
    wait_for(lambda: leases(daemon) == 0)  # the slots freed at once, not by TTL
    assert hits(daemon, keys(10, 4)) == 0  # nothing committed, not even the 2 whole blocks


def test_a_stalled_payload_is_refused_and_aborted(daemon: DaemonProc) -> None:
    conn = connect(daemon)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(11, 2))))
    assert reply(conn) == (b"", None)
    conn.sendall(bytes(BLOCK + 5))
    started = time.monotonic()
    assert reply(conn) == (4, f"WriteBlocks payload: {BLOCK + 5} of {2 * BLOCK} bytes, then "
                              "less than 64 KiB more in 2 s")  # DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10
    assert closed(conn)
    conn.close()
    assert leases(daemon) == 0
    assert hits(daemon, keys(11, 2)) == 0


def test_bytes_past_the_payload_are_a_new_frame_and_land_in_no_slot(daemon: DaemonProc) -> None:
    data = [*blocks(2, 2), np.full(BLOCK, 0xFF, np.uint8)]
    conn = connect(daemon)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(12, 2))))
    assert reply(conn) == (b"", None)
    for b in data:  # one block more than the header claimed
        conn.sendall(b.tobytes())
    done, err = reply(conn)
    assert err is None and isinstance(done, bytes)
    got = pb.WriteBlocksResponse.FromString(done)
    assert (got.stored, got.skipped) == (2, 0)
    # the third block's first 4 bytes read as a frame length (0xFFFFFFFF): refused, closed
    code, message = reply(conn)
    assert code == 8  # RESOURCE_EXHAUSTED
    assert str(message).startswith(f"call frame of {0xFFFFFFFF} bytes exceeds the limit")
    assert closed(conn)
    conn.close()
    assert hits(daemon, keys(12, 3)) == 2
    with Client(daemon.socket, layout=LAYOUT, token=ALICE, streaming=True) as kv, \
            kv.load(keys(12, 3)) as loaded:
        assert loaded.blocks == 2
        assert all(np.array_equal(v, w) for v, w in zip(loaded.views, data[:2], strict=True))
    assert leases(daemon) == 0


def test_an_oversized_frame_is_refused_before_it_is_read(daemon: DaemonProc) -> None:
    conn = connect(daemon)
    conn.sendall(wire.HEAD.pack(1 << 30) + bytes([WRITE, 0]))
    code, message = reply(conn)
    assert code == 8 and "exceeds the limit" in str(message)  # RESOURCE_EXHAUSTED
    assert closed(conn)
    conn.close()
    assert leases(daemon) == 0


def test_another_tenants_layout_and_too_many_keys_are_refused_before_the_payload(
        daemon: DaemonProc) -> None:
    conn = connect(daemon)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(13, 2), BOB_LAYOUT.layout_id)))
    code, message = reply(conn)
    assert code == 5 and "unknown layout" in str(message)  # NOT_FOUND, as over gRPC
    conn.sendall(wire.call_frame(READ, "", pb.ReadBlocksRequest(
        layout=BOB_LAYOUT.layout_id, keys=b"".join(keys(13, 2)), key_width=32
    ).SerializeToString()))
    code, message = reply(conn)
    assert code == 5 and "unknown layout" in str(message)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(14, 17))))  # over the 16-block limit
    code, message = reply(conn)
    assert code in (3, 8), message  # INVALID_ARGUMENT / RESOURCE_EXHAUSTED, nothing claimed
    assert leases(daemon) == 0
    # the connection goes on: a write after the refusals is taken
    conn.sendall(wire.call_frame(WRITE, "", header(keys(15, 1))))
    assert reply(conn) == (b"", None)
    conn.sendall(bytes(BLOCK))
    done, err = reply(conn)
    assert err is None and isinstance(done, bytes)
    assert pb.WriteBlocksResponse.FromString(done).stored == 1
    conn.close()
    assert hits(daemon, keys(13, 2)) == 0


def test_a_reader_that_goes_away_mid_payload_leaves_no_lease(daemon: DaemonProc) -> None:
    with Client(daemon.socket, layout=LAYOUT, token=ALICE) as kv:
        kv.store(keys(16, 12), blocks(12, 3))
    conn = connect(daemon)
    conn.sendall(wire.call_frame(READ, "", pb.ReadBlocksRequest(
        layout=LAYOUT.layout_id, keys=b"".join(keys(16, 12)), key_width=32
    ).SerializeToString()))
    body, err = reply(conn)
    assert err is None and body == wire.COUNT.pack(12)
    recv_exactly(conn, BLOCK + 7)  # a block and a bit, then away
    conn.close()
    wait_for(lambda: leases(daemon) == 0)
    assert hits(daemon, keys(16, 12)) == 12  # still cached, and readable again
    with Client(daemon.socket, layout=LAYOUT, token=ALICE, streaming=True) as kv, \
            kv.load(keys(16, 12)) as loaded:
        assert loaded.blocks == 12


def test_a_payload_sent_with_its_header_is_taken_and_a_failed_one_frees_the_slots(
        daemon: DaemonProc) -> None:
    """A client that does not wait for the go-ahead: the bytes already in with the header are
    the payload; a header refused (another tenant's layout) leaves them to be read as frames."""
    data = blocks(2, 4)
    conn = connect(daemon)
    conn.sendall(wire.call_frame(WRITE, "", header(keys(17, 2))) + b"".join(
        b.tobytes() for b in data))
    assert reply(conn) == (b"", None)
    done, err = reply(conn)
    assert err is None and isinstance(done, bytes)
    assert pb.WriteBlocksResponse.FromString(done).stored == 2
    conn.sendall(wire.call_frame(WRITE, "", header(keys(18, 1), BOB_LAYOUT.layout_id))
                 + b"\xff" * 64)
    assert reply(conn)[0] == 5  # NOT_FOUND: nothing claimed, the bytes then are a bad frame
    assert reply(conn)[0] == 8  # RESOURCE_EXHAUSTED (a 0xFFFFFFFF-byte frame), then closed
    assert closed(conn)
    conn.close()
    assert leases(daemon) == 0
    assert hits(daemon, keys(17, 2)) == 2 and hits(daemon, keys(18, 1)) == 0
