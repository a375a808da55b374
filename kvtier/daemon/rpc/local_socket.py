"""The local socket: the calls engines make most — Lookup and the shared-memory path's lease
calls — and the bulk calls, for clients on this machine, without gRPC's per-call machinery.

gRPC costs the daemon CPU per call before a handler runs (docs/benchmarks.md, Daemon); Lookup
is the call engines make most, and a shared-memory store+load is four calls (Allocate, Commit;
Acquire, Release) around its copies. So the daemon also answers the methods of
`kvtier.core.methods.LOCAL` on `<socket>.lookup` (`kvtier.core.lookupwire`: length-prefixed
frames, a hello with the protocol version and the token, then one call per frame with the
caller's session id), an asyncio server on the daemon's event loop, created with the same mode
and group as the gRPC socket, claimed like it (`kvtier.daemon.sockpath`: only a stale socket is
removed) and removed at shutdown (after the drain: Release, Commit and Abort work on it while
leases drain, as over gRPC).

The dispatcher is built from the method table and the semantics are the RPC's, not a copy of
them: each call goes through `Service.answer` — the same per-method size limits and
non-raising decoding (`kvtier.daemon.rpc.guard`), the same tenant resolution by the same
`Authenticator`, handler, session binding (the frame's session id stands for the
`kvtier-session` metadata), error codes, metrics and stats; the bulk calls through the one bulk
path (`kvtier.daemon.rpc.bulk`), their payload raw after the frames. The token of the hello is
checked at once (a wrong one: one UNAUTHENTICATED reply, then the connection is closed) and
again whenever a SIGHUP reload has swapped the authenticator, as every gRPC call is checked
against the tokens of the moment.

Each call runs inside the protocol's `data_received`, without a task: a handler that does not
wait answers at once, and only one that waits (`Method.waits`: a remote tier's check, a page
move, an SSD read) has the rest of it run by a task, reading from the connection paused
meanwhile. A connection holds only its buffer: the hello must arrive within `HELLO_TIMEOUT_S`
and a frame, once begun, within `FRAME_TIMEOUT_S`, or the connection is closed; no read is ever
waited for, so a silent client blocks nobody; a client that sends requests without reading the
replies is read no further once its unread replies pass the transport's high-water mark
(`pause_writing`), so it cannot grow the daemon's memory. At most `connection_cap()` connections
are open at once (a quarter of the daemon's file-descriptor limit): one more is closed at once,
and its client goes on over gRPC — a flood of idle connections cannot take the descriptors the
gRPC socket, LMDB and the pool need. With tenants, each holds at most `tenant_share` of them (the
cap divided among the tenants): a hello beyond it is closed unanswered (its client goes on over
gRPC), so no tenant can push the others off this socket.

A WriteBlocks' payload is copied into the slots as it arrives, in `data_received`; the
connection waits for no read meanwhile: less than `PROGRESS_BYTES` of it in `FRAME_TIMEOUT_S` (a
pause, or a trickle), a lease that ends, or the connection's end aborts the write (its slots
freed, nothing committed). A ReadBlocks runs as a task, each block copied out under the lock and
written to the transport in pieces, waiting while the client has not taken `pause_writing`'s
worth — at most the lease's TTL per block, then the connection is dropped with what it
buffered (DEADLINE_EXCEEDED counted); a client gone mid-payload ends it quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core import lookupwire as wire
from kvtier.core.errors import Unauthenticated, UsageError
from kvtier.core.methods import BULK_WRITE_HEADER, LOCAL, Local
from kvtier.core.paths import socket_path_problem
from kvtier.core.units import format_bytes
from kvtier.daemon import sharing, sockpath
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.rpc.bulk import BulkRead, BulkWrite
from kvtier.daemon.rpc.calls import Call, Failed
from kvtier.daemon.rpc.guard import WARNINGS, Limits, Refused, deserializer
from kvtier.daemon.rpc.service import Service

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 2.0
FRAME_TIMEOUT_S = 2.0
PROGRESS_BYTES = 64 << 10  # what a bulk write's payload must move in each FRAME_TIMEOUT_S
SEND_PIECE = 1 << 20
SEND_BUFFER = 1 << 20  # SO_SNDBUF of a connection once it reads blocks


def connection_cap() -> int:
    """How many lookup-socket connections may be open: a quarter of the soft RLIMIT_NOFILE
    (at least 16, at most 4,096)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


def tenant_share(cap: int, tenants: int) -> int:
    """The connections one tenant may hold of `cap`, shared by `tenants` tenants (at least 1)."""
    return max(1, cap // max(1, tenants))


def _code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value


class LookupServer:
    """Serves `<socket>.lookup` for `service` (see the module docstring)."""

    def __init__(self, socket_path: Path, service: Service, limits: Limits,
                 group: str = "") -> None:
        """`limits`: each method's largest request (a WriteBlocks here: its header's)."""
        self.path = Path(wire.lookup_socket_path(str(socket_path)))
        self.service = service
        self.decoders = [  # by method number, from the table
            deserializer(m.name + " header" if m.local is Local.BULK_WRITE else m.name,
                         getattr(pb, BULK_WRITE_HEADER if m.local is Local.BULK_WRITE
                                 else m.request), limits.local(m))
            for m in LOCAL]
        self.limit = max(limits.local(m) for m in LOCAL) + 2 + wire.SESSION_MAX  # a frame
        self._group = group
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[_Connection] = set()
        self.cap = connection_cap()
        self.held: dict[str, int] = {}  # tenant -> its connections past the hello
        self.refused = 0  # connections refused at the hello, for a bad frame or over the cap

    async def start(self) -> bool:
        """Listens; False (logged) when the path is too long for a Unix socket — the gRPC
        socket's path fits, `.lookup` does not — and Lookups then go over gRPC only."""
        problem = socket_path_problem(self.path)
        if problem:
            log.warning("no lookup socket, Lookups go over gRPC: %s", problem)
            return False
        removed = sockpath.claim(self.path)
        if removed:
            log.warning("%s", removed)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(sharing.socket_umask(self._group))  # 0600 (0660: group)
        try:
            self._server = await loop.create_unix_server(
                lambda: _Connection(self), str(self.path), backlog=128)
        except OSError as exc:
            raise UsageError(f"lookup socket {self.path}: {exc}") from None
        finally:
            os.umask(old_umask)
        sharing.share_socket(self.path, self._group)
        return True

    async def close(self) -> None:
        """Stops listening, closes every connection, removes the socket."""
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.close()
            await self._server.wait_closed()
            self._server = None
        self.path.unlink(missing_ok=True)


class _Connection(asyncio.Protocol):
    def __init__(self, server: LookupServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.token: str | None = None  # after the hello
        self.auth: Authenticator | None = None  # the authenticator `tenant` was checked by
        self.tenant: Tenant | None = None
        self.busy = False  # a request still running (a remote tier's check)
        self.full = False  # the replies not yet taken by the client are over the high-water mark
        self.timer: asyncio.TimerHandle | None = None
        self.writing: BulkWrite | None = None  # a bulk WriteBlocks taking its payload
        self.reading: asyncio.Task[None] | None = None  # a bulk ReadBlocks sending its payload
        self.sent_head = False  # the running ReadBlocks has answered OK (its bytes follow)
        self.big_buffer = False  # the socket's send buffer was raised for a ReadBlocks
        self.resumed: asyncio.Future[None] | None = None  # set when the client took replies
        self.holder = ""  # the tenant whose share of the connections this one counts in
        self.armed_at = 0  # the running write's `received` when its stall deadline was set

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if len(self.server.connections) >= self.server.cap:
            self.server.refused += 1
            WARNINGS.warn("lookup-cap", f"lookup socket: {self.server.cap} connections open, "
                          "one more closed (its client goes on over gRPC)")
            transport.close()
            return
        self.transport = transport
        self.server.connections.add(self)
        self._deadline(HELLO_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.holder:
            self.server.held[self.holder] -= 1
            self.holder = ""
        self._deadline(None)
        self.transport = None
        self.buf.clear()
        self._end_bulk()

    def data_received(self, data: bytes) -> None:
        if self.writing is not None and not self.buf:
            took = self._feed(memoryview(data))
            if took == len(data):
                return
            data = data[took:]
        self.buf += data
        self._serve()

    def pause_writing(self) -> None:
        """A client that sends requests and reads no replies: read nothing more from it."""
        self.full = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.full = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self._resume()

    def _resume(self) -> None:
        if self.transport is not None and not self.busy and not self.full:
            self.transport.resume_reading()
            self._serve()

    # -- frames -----------------------------------------------------------------------------

    def _serve(self) -> None:
        while self.transport is not None and not self.busy and not self.full:
            if self.writing is not None:
                if self.buf:  # payload sent ahead of the go-ahead, in with the header
                    data = bytes(self.buf)
                    self.buf.clear()
                    took = self._feed(memoryview(data))
                    if self.transport is not None:
                        self.buf[:0] = data[took:]
                if self.writing is not None:
                    return
                continue
            limit = wire.HELLO_MAX if self.token is None else self.server.limit
            try:
                payload = wire.take_frame(self.buf, limit)
            except wire.FrameTooLarge as exc:
                WARNINGS.warn("oversized", f"lookup socket frame of {exc.size} bytes")
                what = "hello" if self.token is None else "call frame"
                self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{what} of {exc.size} bytes exceeds the limit of {limit} bytes")
                return
            if payload is None:
                if self.token is not None:  # between requests a connection may idle; a frame
                    if not self.buf:  # once begun must end within FRAME_TIMEOUT_S
                        self._deadline(None)
                    elif self.timer is None:
                        self._deadline(FRAME_TIMEOUT_S)
                return
            if self.token is None:
                self._hello(payload)
            else:
                self._deadline(None)
                self._request(payload)

    def _hello(self, payload: bytes) -> None:
        token = wire.parse_hello(payload)
        if token is None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         f"expected the hello '{wire.HELLO.decode()}<token>' as the first frame "
                         "(a client of another protocol version?)")
            return
        self.token = token
        try:
            tenant = self._tenant()
        except Unauthenticated as exc:
            self._refuse(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        auth, held = self.server.service.auth, self.server.held
        if auth.required:
            share = tenant_share(self.server.cap, len(auth.tenants()))
            if held.get(tenant.name, 0) >= share:  # unanswered: its client goes over gRPC
                self.server.refused += 1
                WARNINGS.warn("lookup-share", f"lookup socket: tenant {tenant.name!r} holds "
                              f"its share of {share} connections, one more closed (its client "
                              "goes on over gRPC)")
                self.close()
                return
            self.holder = tenant.name
            held[tenant.name] = held.get(tenant.name, 0) + 1
        self._deadline(None)
        self._write(wire.ok_reply())

    def _tenant(self) -> Tenant:
        """The tenant of the hello's token, checked again after a reload swapped the
        authenticator (Unauthenticated when the token is no longer known)."""
        auth = self.server.service.auth
        if auth is not self.auth or self.tenant is None:
            metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
            self.tenant = auth.authenticate(metadata)
            self.auth = auth
        return self.tenant

    def _request(self, payload: bytes) -> None:
        call = wire.parse_call(payload)
        if call is None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         "malformed call frame (method, session id, request)")
            return
        number, session, body = call
        m = LOCAL[number]
        request = cast("Message | Refused", self.server.decoders[number](body))
        who = Call(self._tenant, session)
        if m.local is Local.BULK_READ:
            self._read(self.server.service.begin_read(
                cast("pb.ReadBlocksRequest | Refused", request), who))
            return
        if m.local is Local.BULK_WRITE:
            coro: Coroutine[Any, Any, Any] = self.server.service.begin_write(
                cast("pb.WriteHeader | Refused", request), who)
        else:
            coro = self.server.service.answer(m.name, request, who)
        self._step(coro)

    def _step(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs a handler to its first wait, the rest (if any) in a task; answers its result."""
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            self._done(done.value)
            return
        except Failed as failed:
            self._answer_failed(failed)
            return
        # the handler waits (a remote tier's check, a page move): the rest of it runs in a task
        self.busy = True
        assert self.transport is not None
        self.transport.pause_reading()
        task = asyncio.ensure_future(_finish(coro, yielded))
        task.add_done_callback(self._finished)

    def _done(self, result: Message | bytes | BulkWrite) -> None:
        if isinstance(result, bytes):
            self._write(wire.ok_reply(result))
            return
        if not isinstance(result, BulkWrite):
            self._write(wire.ok_reply(result.SerializeToString()))
            return
        if self.transport is None:  # gone while the slots were claimed
            result.abort()
            return
        self.writing = result
        self._write(wire.ok_reply())  # send the payload
        if result.complete:  # none to send (no keys)
            self._feed(memoryview(b""))
        else:
            self.armed_at = 0
            self._deadline(FRAME_TIMEOUT_S)

    # -- bulk calls -------------------------------------------------------------------------

    def _read(self, read: BulkRead) -> None:
        self.busy = True
        self.sent_head = False
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        if sock is not None and not self.big_buffer:  # the kernel takes a piece at once
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            self.big_buffer = True
        self.transport.pause_reading()
        self.reading = asyncio.ensure_future(self._send_blocks(read))
        self.reading.add_done_callback(self._read_done)

    async def _send_blocks(self, read: BulkRead) -> None:
        """The held blocks' count, then each block (copied under the lock while the lease
        lives) in pieces; raises `Failed` (recorded), after the count: the connection ends."""
        async with read:
            self.sent_head = True
            self._write(wire.ok_reply(wire.COUNT.pack(read.count)))
            ttl = read.stream.ttl_s if read.stream else 0.0
            for block in read.pieces(read.stream.block_bytes if read.stream else 0,
                                     chunked=False):
                # a client that takes no block for the lease's TTL could not go on (nothing
                # renewed its lease): it holds nothing longer
                try:
                    await asyncio.wait_for(self._send(block), ttl or None)
                except TimeoutError:
                    raise read.expired() from None

    def _feed(self, data: memoryview) -> int:
        """Gives `data` to the running write; how many bytes it took. Answers and ends it once
        complete; a failure answers and closes the connection (the rest of the payload is not
        read)."""
        write = self.writing
        assert write is not None
        try:
            took = write.feed(data)
            if not write.complete:
                if write.received - self.armed_at >= PROGRESS_BYTES:  # moving: a new deadline
                    self.armed_at = write.received
                    self._deadline(FRAME_TIMEOUT_S)
                return took
            self.writing = None
            self._deadline(None)
            self._write(wire.ok_reply(write.finish().SerializeToString()))
        except Failed as failed:
            self.writing = None
            self._write(wire.error_reply(_code(failed.code), failed.message))
            self.close()
            return len(data)
        return took

    async def _send(self, data: bytes) -> None:
        """Writes `data` (a copy the daemon owns) in pieces of `SEND_PIECE` bytes, each once
        the client has taken the one before (the transport's buffer drops what it sent from
        its front: a whole block there would be moved again at each send)."""
        view = memoryview(data)
        for at in range(0, len(view), SEND_PIECE):
            if self.transport is None or self.transport.is_closing():
                raise ConnectionResetError("the client went away mid-payload")
            self.transport.write(view[at : at + SEND_PIECE])
            while self.full and self.transport is not None:
                self.resumed = asyncio.get_running_loop().create_future()
                await self.resumed

    def _read_done(self, task: asyncio.Future[None]) -> None:
        self.reading = None
        self.busy = False
        self.resumed = None
        exc = task.exception() if not task.cancelled() else None  # retrieved, even if gone
        if self.transport is None:
            return
        if task.cancelled() or (exc is not None and self.sent_head):
            self.close(abort=True)  # its bytes had begun: they end short, the unsent dropped
            return
        if isinstance(exc, Failed):
            self._answer_failed(exc)
        elif exc is not None:
            log.error("lookup socket ReadBlocks failed", exc_info=exc)
            self.close()
            return
        self._resume()

    def _end_bulk(self) -> None:
        """The connection ended: a write taking its payload is aborted, a read stopped."""
        if self.writing is not None:
            self.writing.abort()
            self.writing = None
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)  # its next `_send` finds the transport gone

    def _finished(self, task: asyncio.Future[Any]) -> None:
        self.busy = False
        if self.transport is None:
            if not task.cancelled() and task.exception() is None and isinstance(
                    task.result(), BulkWrite):
                task.result().abort()  # gone while its slots were claimed
            return
        exc = task.exception() if not task.cancelled() else None
        if task.cancelled():
            self.close()
            return
        if isinstance(exc, Failed):
            self._answer_failed(exc)
        elif exc is not None:
            log.error("lookup socket request failed", exc_info=exc)
            self.close()
            return
        else:
            self._done(task.result())
        self._resume()

    def _answer_failed(self, failed: Failed) -> None:
        self._write(wire.error_reply(_code(failed.code), failed.message))
        if failed.code is grpc.StatusCode.UNAUTHENTICATED:  # its token is no longer known
            self.server.refused += 1
            self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        """One error reply, then the connection is closed."""
        self.server.refused += 1
        self._write(wire.error_reply(_code(code), message))
        self.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _deadline(self, seconds: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if seconds is not None and self.transport is not None:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _expired(self) -> None:
        self.timer = None
        if self.writing is not None:
            write, self.writing = self.writing, None
            failed = write.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"WriteBlocks payload: {write.received} of {write.total} "
                                 f"bytes, then less than {format_bytes(PROGRESS_BYTES)} "
                                 f"more in {FRAME_TIMEOUT_S:g} s")
            self.server.refused += 1
            self._write(wire.error_reply(_code(failed.code), failed.message))
            self.close()
            return
        if self.transport is not None and not self.busy:
            what, limit = ("hello", HELLO_TIMEOUT_S) if self.token is None else ("frame",
                                                                               FRAME_TIMEOUT_S)
            self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no complete {what} within {limit:g} s")

    def close(self, abort: bool = False) -> None:
        """Closes the connection: what was written is flushed first, or with `abort` dropped
        (a client that reads nothing would hold it for ever)."""
        self._deadline(None)
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
            self.transport = None
        self.buf.clear()
        self._end_bulk()


async def _finish(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Runs the rest of a coroutine already stepped once by hand, as a task would have: it
    yielded `yielded` (a future it waits on, or None for a bare yield)."""
    while True:
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                yielded._asyncio_future_blocking = False
                await yielded
        except BaseException as exc:  # handed to the coroutine, as a task does
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            return done.value
