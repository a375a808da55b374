"""The lookup socket (`<socket>.lookup`, `kvtier.daemon.rpc.local_socket`) against a real daemon:
the clients use it for Lookup and get what gRPC gives (replies, errors, metrics), fall back to
gRPC where it is missing, reconnect after a restart, see a SIGHUP's revoked token, and the
socket is created, claimed and removed like the gRPC socket. (Hostile frames: the lookup-socket
rows of tests/test_service_hostile.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import select
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.async_client import AsyncClient
from kvtier.client.lookup_channel import LookupChannel, Refusal
from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl, ModelCost
from kvtier.core import lookupwire as wire
from kvtier.core.methods import BY_NAME, LOCAL, PROTOCOL_VERSION
from kvtier.core.types import Tier
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.rpc.calls import Call
from kvtier.daemon.rpc.guard import Limits
from kvtier.daemon.rpc.local_socket import LookupServer, _Connection
from tests.daemon_fixture import DaemonProc, daemon, wait_for  # noqa: F401

LOOKUP = BY_NAME["Lookup"].number

LAYOUT = LayoutDecl(b"lookup-socket-layout", 4096, 16, model_id="ls/model",
                    model=ModelCost(1e9, 16, 1024))


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(2, "little") + bytes(29) for i in range(n)]


def lookup_socket(d: DaemonProc) -> Path:
    return Path(str(d.socket) + ".lookup")


def used_socket(kv: Client) -> bool:
    """Whether `kv`'s last Lookup went over the lookup socket (it keeps that connection)."""
    return kv._lookups is not None and len(kv._lookups._idle) == 1


def test_clients_look_up_on_the_socket_with_grpcs_answers(daemon: DaemonProc) -> None:  # noqa: F811
    path = lookup_socket(daemon)
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # like the gRPC socket
    with Client(daemon.socket, layout=LAYOUT) as kv, \
            Client(daemon.socket, layout=LAYOUT, lookup_socket=False) as slow:
        kv.store(keys(1, 5), [bytes([i]) * 4096 for i in range(5)])
        lookups_before = daemon.metric_sum("kvtier_lookups_total")
        fast = kv.lookup(keys(1, 8), prompt_tokens=8 * 16, plan=True)
        assert used_socket(kv)
        grpc_reply = slow.lookup(keys(1, 8), prompt_tokens=8 * 16, plan=True)
        assert slow._lookups is None
        assert fast.hit_blocks == 5 and fast.tiers == [Tier.DRAM] * 5
        assert fast.plan is not None and fast.plan.reason
        assert fast == grpc_reply  # the same handler: the same reply, plan included
        assert kv.lookup(keys(2, 3)).hit_blocks == 0
        # counted like the RPC: both lookups and the miss, per method and code
        assert daemon.metric_sum("kvtier_lookups_total") == lookups_before + 3
        ok = [ln for ln in daemon.metrics_text().splitlines()
              if ln.startswith('kvtier_rpcs_total{code="OK",method="Lookup"}')
              or ln.startswith('kvtier_rpcs_total{method="Lookup",code="OK"}')]
        assert ok and float(ok[0].split()[-1]) >= 3

        # errors: the same code and message as over gRPC
        for bad in (pb.LookupRequest(layout=b"never-registered", keys=bytes(32), key_width=32),
                    pb.LookupRequest(layout=LAYOUT.layout_id, keys=bytes(33), key_width=32)):
            with pytest.raises(KvtierRpcError) as on_socket:
                kv._lookup(bad)
            with pytest.raises(grpc.RpcError) as on_grpc:
                slow._stub.Lookup(bad)
            assert on_socket.value.code is on_grpc.value.code()
            assert on_socket.value.details == on_grpc.value.details()
        assert on_socket.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert kv.lookup(keys(1, 8)).hit_blocks == 5  # the connection still serves


def rpc_count(d: DaemonProc, method: str) -> float:
    """kvtier_rpcs_total of `method` answered OK (either transport)."""
    return sum(float(ln.split()[-1]) for ln in d.metrics_text().splitlines()
               if ln.startswith("kvtier_rpcs_total{") and f'method="{method}"' in ln
               and 'code="OK"' in ln)


def test_lease_calls_go_over_the_socket_with_grpcs_answers(daemon: DaemonProc) -> None:  # noqa: F811
    """The shared-memory path's Allocate, Commit, Acquire, Release and Abort go over the socket
    (under the client's session), answered as over gRPC: same replies,
    same refusals, the same metrics."""
    with Client(daemon.socket, layout=LAYOUT) as kv, \
            Client(daemon.socket, layout=LAYOUT, lookup_socket=False) as slow:
        assert kv._lookups is not None
        sent: list[tuple[str, str, bool]] = []
        request = kv._lookups.request

        def spy(method: int, session: str, data: bytes, *rest: float) -> object:
            got = request(method, session, data, *rest)
            sent.append((LOCAL[method].name, session, isinstance(got, bytes)))
            return got

        kv._lookups.request = spy  # type: ignore[method-assign]
        before = {m: rpc_count(daemon, m) for m in ("Allocate", "Commit", "Acquire", "Release")}
        blocks = [bytes([i + 1]) * 4096 for i in range(4)]
        assert kv.store(keys(20, 4), blocks) == (4, 0)
        with kv.load(keys(20, 5)) as got:
            assert got.blocks == 4 and [bytes(v) for v in got.views] == blocks
        with pytest.raises(RuntimeError), kv.store_into(keys(21, 2)) as tx:
            assert len(tx.slots) == 2
            raise RuntimeError("the writer failed: Abort")
        session = kv._session_id
        assert len(session) == 32
        assert sent == [("Allocate", session, True), ("Commit", session, True),
                        ("Acquire", session, True), ("Release", session, True),
                        ("Allocate", session, True), ("Abort", session, True)]
        assert used_socket(kv)  # one kept connection for all of them
        calls = {"Allocate": 2, "Commit": 1, "Acquire": 1, "Release": 1}  # counted like RPCs
        assert {m: rpc_count(daemon, m) - n for m, n in before.items()} == calls
        assert slow.lookup(keys(21, 2)).hit_blocks == 0  # aborted: nothing pending or stored
        assert slow.store(keys(21, 2), [bytes(4096)] * 2) == (2, 0)

        # refusals: the same code and message as over gRPC
        bad = [(kv._stub.Release, pb.ReleaseRequest(lease_id="0" * 32)),
               (kv._stub.Commit, pb.CommitRequest()),
               (kv._stub.Acquire, pb.AcquireRequest(layout=b"never-registered",
                                                    keys=bytes(32), key_width=32)),
               (kv._stub.Allocate, pb.AllocateRequest(layout=LAYOUT.layout_id, keys=keys(22, 1)[0],
                                                      key_width=32, parent_key=keys(23, 1)[0]))]
        codes = []
        for method, req in bad:
            with pytest.raises(KvtierRpcError) as on_socket:
                kv._raw(method, req)
            with pytest.raises(KvtierRpcError) as on_grpc:
                slow._raw(getattr(slow._stub, _name(kv, method)), req)
            assert (on_socket.value.code, on_socket.value.details) == (
                on_grpc.value.code, on_grpc.value.details)
            codes.append(on_socket.value.code)
        assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION]
        assert [s[0] for s in sent[6:]] == ["Release", "Commit", "Acquire", "Allocate"]
        assert not any(s[2] for s in sent[6:])  # refusals, not replies
        assert kv.lookup(keys(20, 4)).hit_blocks == 4 and used_socket(kv)


def _name(kv: Client, method: object) -> str:
    return LOCAL[kv._local_calls[method][0]].name


class _FakeSocket:
    """A local socket that records the frames it gets; with `drop` it closes each connection
    right after reading a request, with `refuse` it refuses every hello as a daemon of another
    protocol version does."""

    def __init__(self, path: Path, drop: bool = False, refuse: bool = False) -> None:
        self.drop = drop
        self.refuse = refuse
        self.hellos: list[bytes] = []
        self.requests: list[bytes] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                buf = bytearray()
                hello = self._frame(conn, buf)
                if hello is None:
                    continue
                self.hellos.append(hello)
                if self.refuse or wire.parse_hello(hello) is None:
                    conn.sendall(wire.error_reply(3, "expected the hello 'KVTLK9 <token>' as "
                                                     "the first frame"))
                    continue
                conn.sendall(wire.ok_reply())
                while (req := self._frame(conn, buf)) is not None:
                    self.requests.append(req)
                    if self.drop:
                        break
                    conn.sendall(wire.ok_reply(b"reply to " + req))

    @staticmethod
    def _frame(conn: socket.socket, buf: bytearray) -> bytes | None:
        while (got := wire.take_frame(buf, 1 << 20)) is None:
            data = conn.recv(65536)
            if not data:
                return None
            buf += data
        return got

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        self.listener.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_daemon_of_another_protocol_version_refuses_the_hello(tmp_path: Path) -> None:
    """Its refusal is the answer (not a fallback to another hello): the client raises it, and
    RegisterLayout's version check has already refused such a daemon at the client's start."""
    other = _FakeSocket(tmp_path / "d.sock.lookup", refuse=True)
    channel = LookupChannel(str(tmp_path / "d.sock"), "tok", 5.0)
    try:
        got = channel.request(LOOKUP, "", b"lookup-1")
        assert isinstance(got, Refusal) and got.code == 3
        assert other.hellos == [wire.HELLO + b"tok"] and not other.requests
    finally:
        channel.close()
        other.close()


def test_a_lease_call_is_never_sent_twice_when_its_connection_drops(tmp_path: Path) -> None:
    """A Commit whose connection closes after the daemon read it answers UNAVAILABLE (it may
    have been applied: it is not sent again); a Lookup is sent again on a new connection."""
    fake = _FakeSocket(tmp_path / "d.sock.lookup", drop=True)
    channel = LookupChannel(str(tmp_path / "d.sock"), "tok", 5.0)
    try:
        got = channel.request(BY_NAME["Commit"].number, "s" * 32, b"commit")
        assert got == Refusal(14, "connection to the daemon lost during Commit")
        commit = b"\x04\x20" + b"s" * 32 + b"commit"
        assert fake.requests == [commit]  # once
        assert channel.request(LOOKUP, "", b"lookup") is None  # lost twice: over gRPC
        assert fake.requests == [commit, b"\x00\x00lookup", b"\x00\x00lookup"]
        assert fake.hellos == [wire.HELLO + b"tok"] * 3
    finally:
        channel.close()
        fake.close()


def test_async_client_looks_up_on_the_socket(daemon: DaemonProc) -> None:  # noqa: F811
    async def go() -> None:
        async with await AsyncClient.connect(daemon.socket, layout=LAYOUT) as kv:
            await kv.store(keys(3, 4), [bytes(4096)] * 4)
            got = await asyncio.gather(*(kv.lookup(keys(3, 6)) for _ in range(5)))
            assert [g.hit_blocks for g in got] == [4] * 5
            assert kv._lookups is not None and len(kv._lookups._idle) >= 1
            with pytest.raises(KvtierRpcError) as exc:
                await kv._lookup(pb.LookupRequest(layout=b"nope", keys=bytes(32), key_width=32))
            assert exc.value.code is grpc.StatusCode.NOT_FOUND
            assert "unknown layout" in exc.value.details

    asyncio.run(go())


def test_falls_back_to_grpc_and_reconnects_after_a_restart(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(4, 2), [bytes(4096)] * 2)
            assert kv.lookup(keys(4, 2)).hit_blocks == 2 and used_socket(kv)
            d.stop()
            assert not lookup_socket(d).exists()  # removed at shutdown, like the others
            d.start()
            # the kept connection is dead: one reconnect, the layout re-registered on the way;
            # the blocks come back from the SSD tier (flushed at shutdown)
            assert kv.lookup(keys(4, 2)).tiers == [Tier.SSD] * 2
            assert used_socket(kv)
            lookup_socket(d).unlink()  # as an older daemon, without one: gRPC
            kv._lookups.close()  # type: ignore[union-attr]
            assert kv.lookup(keys(4, 2)).hit_blocks == 2
            assert not used_socket(kv)
        with Client(d.socket, layout=LAYOUT) as kv:  # a new client: gRPC too
            assert kv.lookup(keys(4, 2)).hit_blocks == 2 and not used_socket(kv)
    finally:
        d.stop()


def test_a_revoked_token_is_refused_on_a_kept_connection(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.alice]\ntoken = "alice-token-1"\n\n'
                      '[tenants.bob]\ntoken = "bob-token-22"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        assert d.proc is not None
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as alice, \
                Client(d.socket, layout=LAYOUT, token="bob-token-22") as bob:
            alice.store(keys(5, 3), [bytes(4096)] * 3)
            assert alice.lookup(keys(5, 3)).hit_blocks == 3 and used_socket(alice)
            assert bob.lookup(keys(5, 3)).hit_blocks == 0 and used_socket(bob)  # its own keys
            tokens.write_text('[tenants.bob]\ntoken = "bob-token-22"\n')
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "tenants revoked: alice" in d.log())
            with pytest.raises(KvtierRpcError) as exc:
                alice.lookup(keys(5, 3))
            assert exc.value.code is grpc.StatusCode.UNAUTHENTICATED
            assert exc.value.details == "unknown token"  # what gRPC answers it
            assert bob.lookup(keys(5, 3)).hit_blocks == 0 and used_socket(bob)
    finally:
        assert d.stop() == 0


def test_socket_path_is_claimed_like_the_grpc_sockets(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d")
    d.socket.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(lookup_socket(d)))  # a crashed daemon's leftover: nothing listens
    stale.close()
    d.start()
    try:
        assert "removed stale socket " + str(lookup_socket(d)) in d.log()
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.lookup(keys(1, 1)).hit_blocks == 0 and used_socket(kv)
    finally:
        d.stop()
    lookup_socket(d).write_text("a user's file")
    with pytest.raises(RuntimeError, match="regular file is there, not a socket"):
        d.start()
    assert lookup_socket(d).read_text() == "a user's file"  # never removed


class _Transport(asyncio.Transport):
    """What the protocol writes and whether it reads (unit test of the protocol alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.reading = True
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True


class _Service:
    """What the protocol asks of `Service` for a Lookup: `answer` (and `auth`)."""

    def __init__(self) -> None:
        self.auth = Authenticator()
        self.calls = 0

    async def answer(self, method: str, request: object, call: Call) -> bytes:
        """The reply in wire form, as `Service.answer` gives Lookup's."""
        assert method == "Lookup" and call.tenant().name == "default"
        assert isinstance(request, pb.LookupRequest)
        self.calls += 1
        return pb.LookupResponse(hit_blocks=len(request.keys) // 32).SerializeToString()


def test_protocol_reads_no_further_while_its_replies_are_not_taken(tmp_path: Path) -> None:
    async def go() -> None:
        service = _Service()
        limits = Limits.for_daemon(1024, 32, 1 << 16)
        server = LookupServer(tmp_path / "s", service, limits)  # type: ignore[arg-type]
        conn, transport = _Connection(server), _Transport()
        conn.connection_made(transport)
        conn.data_received(wire.hello(""))
        assert bytes(transport.written) == wire.ok_reply()
        request = wire.call_frame(LOOKUP, "", pb.LookupRequest(keys=bytes(64), key_width=32)
                                  .SerializeToString())
        conn.data_received(request)
        assert service.calls == 1
        conn.pause_writing()  # the client takes no replies: the transport's buffer is full
        assert not transport.reading
        conn.data_received(request * 3)  # already in flight: kept, not answered
        assert service.calls == 1
        conn.resume_writing()
        assert transport.reading and service.calls == 4
        reply = wire.ok_reply(pb.LookupResponse(hit_blocks=2).SerializeToString())
        assert bytes(transport.written) == wire.ok_reply() + reply * 4
        conn.connection_lost(None)
        assert not server.connections

    asyncio.run(go())


def test_wire_frames() -> None:
    buf = bytearray(wire.frame(b"abc") + wire.frame(b"") + b"\x05\x00")
    assert wire.take_frame(buf, 3) == b"abc"
    assert wire.take_frame(buf, 3) == b""
    assert wire.take_frame(buf, 3) is None and buf == bytearray(b"\x05\x00")
    buf += b"\x00\x00"
    with pytest.raises(wire.FrameTooLarge, match="frame of 5 bytes exceeds the limit of 3"):
        wire.take_frame(buf, 3)
    assert wire.HELLO == b"KVTLK%d " % PROTOCOL_VERSION
    assert wire.parse_hello(wire.HELLO + b"tok") == "tok"
    assert wire.parse_hello(wire.HELLO + b"\xff") is None and wire.parse_hello(b"GET /") is None
    assert wire.parse_hello(b"KVTLK%d tok" % (PROTOCOL_VERSION + 1)) is None  # another version
    assert wire.hello("tok") == bytes((len(wire.HELLO) + 3, 0, 0, 0)) + wire.HELLO + b"tok"
    assert BY_NAME["Release"].number == 2
    release = wire.call_frame(2, "ab", b"req")
    assert release == b"\x07\x00\x00\x00\x02\x02abreq"
    assert wire.parse_call(release[4:]) == (2, "ab", b"req")
    assert wire.parse_call(bytes((len(LOCAL), 0))) is None  # no method of that number
    assert wire.parse_call(b"\x02\x05ab") is None  # the session id overruns the frame
    assert wire.parse_call(b"\x02") is None
    with pytest.raises(ValueError, match="session id of 256 bytes"):
        wire.call_frame(2, "s" * 256, b"")
    assert wire.parse_reply(b"\x00xyz") == (b"xyz", None)
    assert wire.parse_reply(b"\x01\x05no such thing") == (5, "no such thing")
    with pytest.raises(ValueError, match="malformed"):
        wire.parse_reply(b"\x07")


def test_the_client_reads_a_reply_however_it_arrives() -> None:
    """One recv takes a whole reply; one split anywhere (inside the length, inside the body) or
    longer than the first read is put together; bytes past the reply or a closed connection
    are a lost connection, not a reply."""
    from kvtier.client.lookup_channel import READ_BYTES, _Lost

    big = bytes(range(256)) * (READ_BYTES // 128)  # 2 x READ_BYTES: more than one recv
    for pieces in ([b"\x03\x00\x00\x00abc"], [b"\x03\x00", b"\x00\x00ab", b"c"],
                   [b"\x03\x00\x00\x00", b"abc"], [wire.frame(big)]):
        a, b = socket.socketpair()
        with a, b:
            a.settimeout(5)

            def send(parts: list[bytes] = pieces, peer: socket.socket = b) -> None:
                for part in parts:
                    peer.sendall(part)
                    time.sleep(0.02)

            writer = threading.Thread(target=send)
            writer.start()
            assert LookupChannel._read(a) == (big if len(pieces[0]) > 100 else b"abc")
            writer.join()
    a, b = socket.socketpair()
    with a, b:
        b.sendall(wire.frame(b"abc") + b"\x01")
        time.sleep(0.02)
        with pytest.raises(_Lost, match="1 bytes past the reply"):
            LookupChannel._read(a)
    a, b = socket.socketpair()
    with a:
        b.sendall(b"\x03\x00")
        b.close()
        with pytest.raises(_Lost, match="connection closed"):
            LookupChannel._read(a)


def test_lookup_response_in_wire_form_is_what_protobuf_writes() -> None:
    # hit_blocks 3 (field 1), tiers packed (field 2: DRAM=2, DRAM, SSD=3), no plan
    assert wire.lookup_response(b"\x02\x02\x03") == b"\x08\x03\x12\x03\x02\x02\x03"
    assert wire.lookup_response(b"") == b""  # a miss: every field at its zero value
    assert wire.lookup_response(b"", b"") == b"\x1a\x00"  # an empty plan is still present
    plan = pb.Plan(fetch_blocks=2, predicted_fetch_seconds=0.5, reason="fetch_all")
    for codes in (b"\x02" * 200, bytes([1, 2, 3, 4]) * 300, b"\x03"):  # 2-byte lengths too
        for p in (None, plan):
            msg = pb.LookupResponse(hit_blocks=len(codes), tiers=list(codes))
            if p is not None:
                msg.plan.CopyFrom(p)
            got = wire.lookup_response(codes, None if p is None else p.SerializeToString())
            assert got == msg.SerializeToString()
            assert pb.LookupResponse.FromString(got) == msg


NOFILE_128 = [sys.executable, "-c",
              "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)); "
              "os.execvp(sys.argv[1], sys.argv[1:])"]


def test_a_flood_of_connections_takes_no_descriptors_the_daemon_needs(tmp_path: Path) -> None:
    """With 128 descriptors, at most 32 lookup-socket connections are kept: 200 idle ones do not
    exhaust the daemon (gRPC and the pool still work), a client past the cap goes on over gRPC,
    and once the flood closes a new client gets the socket again."""
    d = DaemonProc(tmp_path / "d", launcher=NOFILE_128).start()
    flood: list[socket.socket] = []
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(7, 3), [bytes([i]) * 4096 for i in range(3)])
            assert used_socket(kv)  # its Allocate and Commit went over the socket: one of 32
            for _ in range(200):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(lookup_socket(d)))
                # a good hello, then idle: kept within the cap; past it the daemon closes the
                # connection at accept, which may come before this send (a broken pipe)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    s.sendall(wire.hello(""))
                flood.append(s)
            flooded = time.monotonic()
            # each one answered (the hello's reply) or closed: a fixed sleep counted the ones
            # a loaded daemon had not accepted yet as kept
            deadline = flooded + 60
            while len(select.select(flood, [], [], 0)[0]) < len(flood):
                assert time.monotonic() < deadline, "the daemon never got to the flood"
                time.sleep(0.05)
            # and past the hello deadline: only the cap closes a connection now
            time.sleep(max(0.0, flooded + 3 - time.monotonic()))
            closed = 0
            for s in flood:
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    try:
                        closed += s.recv(64) == b""  # the kept ones have the hello's reply
                    except ConnectionResetError:
                        closed += 1
            assert closed == 200 - 31
            with Client(d.socket, layout=LAYOUT) as late:
                assert late.lookup(keys(7, 3)).hit_blocks == 3  # over gRPC
                assert late.store(keys(8, 2), [bytes(4096)] * 2).stored == 2
            for s in flood:
                s.close()
            flood.clear()

            def served_on_the_socket() -> bool:  # once the daemon saw the flood's ends
                with Client(d.socket, layout=LAYOUT) as again:
                    assert again.lookup(keys(7, 3)).hit_blocks == 3
                    return used_socket(again)

            wait_for(served_on_the_socket, timeout=30)
        assert d.healthy()
    finally:
        for s in flood:
            s.close()
        d.stop()
