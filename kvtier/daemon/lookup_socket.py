"""The lookup socket: Lookup and the shared-memory lease calls for clients on this machine
without gRPC's per-call machinery.

gRPC costs the daemon about 0.3 ms of CPU per call before a handler runs (docs/benchmarks.md,
issue 25); Lookup is the call engines make most, and a shared-memory store+load is four calls
(Allocate, Commit; Acquire, Release) around its copies. So the daemon also answers them on
`<socket>.lookup` (`kvtier.core.lookupwire`: length-prefixed frames, a hello with the token,
then one `LookupRequest` per frame — or, after a `KVTLK2` hello, one call of `wire.CALLS` per
frame, with the caller's session id), an asyncio server on the daemon's event loop, created with
the same mode and group as the gRPC socket, claimed like it (`kvtier.daemon.sockpath`: only a
stale socket is removed) and removed at shutdown (after the drain: Release, Commit and Abort
work on it while leases drain, as over gRPC).

The semantics are the RPC's, not a copy of them: each request goes through
`KvTierService.lookup` / `KvTierService.call` — the same per-method size limits and non-raising
decoding (`kvtier.daemon.rpc_guard`), the same tenant resolution by the same `Authenticator`,
handler, session binding (the frame's session id stands for the `kvtier-session` metadata),
error codes, metrics and stats.
The token of the hello is checked at once (a wrong one: one UNAUTHENTICATED reply, then the
connection is closed) and again whenever a SIGHUP reload has swapped the authenticator, as every
gRPC call is checked against the tokens of the moment.

Each request runs inside the protocol's `data_received`, without a task: the handler completes
without suspending unless a remote tier is configured, and only then is the rest of it run by a
task (reading from the connection paused meanwhile). A connection holds only its buffer: the
hello must arrive within `HELLO_TIMEOUT_S` and a frame, once begun, within `FRAME_TIMEOUT_S`, or
the connection is closed; no read is ever waited for, so a silent client blocks nobody; a client
that sends requests without reading the replies is read no further once its unread replies pass
the transport's high-water mark (`pause_writing`), so it cannot grow the daemon's memory. At most
`connection_cap()` connections are open at once (a quarter of the daemon's file-descriptor limit):
one more is closed at once, and its client goes on over gRPC — a flood of idle connections cannot
take the descriptors the gRPC socket, LMDB and the pool need.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core import lookupwire as wire
from kvtier.core.errors import UsageError
from kvtier.core.paths import socket_path_problem
from kvtier.daemon import sharing, sockpath
from kvtier.daemon.auth import Authenticator, Tenant, Unauthenticated
from kvtier.daemon.rpc_guard import WARNINGS, Refused, deserializer
from kvtier.daemon.service import Failed, KvTierService

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 2.0
FRAME_TIMEOUT_S = 2.0


def connection_cap() -> int:
    """How many lookup-socket connections may be open: a quarter of the soft RLIMIT_NOFILE
    (at least 16, at most 4,096)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


def _code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value


class LookupServer:
    """Serves `<socket>.lookup` for `service` (see the module docstring)."""

    def __init__(self, socket_path: Path, service: KvTierService, limit: int,
                 group: str = "", call_limits: dict[str, int] | None = None) -> None:
        """`limit`: the largest Lookup request; `call_limits`: each of `wire.CALLS`' (default:
        `limit` for each)."""
        self.path = Path(wire.lookup_socket_path(str(socket_path)))
        self.service = service
        self.limit = limit
        limits = {m: limit for m in wire.CALLS} | (call_limits or {}) | {"Lookup": limit}
        self.decoders = [deserializer(m, getattr(pb, m + "Request"), limits[m])
                         for m in wire.CALLS]
        self.decode = self.decoders[0]
        self.call_limit = max(limits.values()) + 2 + wire.SESSION_MAX  # a KVTLK2 frame
        self._group = group
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[_Connection] = set()
        self.cap = connection_cap()
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
        self.calls = False  # a KVTLK2 connection: frames name their method and session
        self.auth: Authenticator | None = None  # the authenticator `tenant` was checked by
        self.tenant: Tenant | None = None
        self.busy = False  # a request still running (a remote tier's check)
        self.full = False  # the replies not yet taken by the client are over the high-water mark
        self.timer: asyncio.TimerHandle | None = None

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
        self._deadline(None)
        self.transport = None
        self.buf.clear()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    def pause_writing(self) -> None:
        """A client that sends requests and reads no replies: read nothing more from it."""
        self.full = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.full = False
        self._resume()

    def _resume(self) -> None:
        if self.transport is not None and not self.busy and not self.full:
            self.transport.resume_reading()
            self._serve()

    # -- frames -----------------------------------------------------------------------------

    def _serve(self) -> None:
        while self.transport is not None and not self.busy and not self.full:
            limit = (wire.HELLO_MAX if self.token is None else
                     self.server.call_limit if self.calls else self.server.limit)
            try:
                payload = wire.take_frame(self.buf, limit)
            except wire.FrameTooLarge as exc:
                WARNINGS.warn("oversized", f"lookup socket frame of {exc.size} bytes")
                what = "hello" if self.token is None else "Lookup message"
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
        hello = wire.parse_any_hello(payload)
        if hello is None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         "expected the hello 'KVTLK1 <token>' as the first frame")
            return
        self.token, self.calls = hello
        try:
            self._tenant()
        except Unauthenticated as exc:
            self._refuse(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
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
        if not self.calls:
            request = cast("pb.LookupRequest | Refused", self.server.decode(payload))
            coro: Coroutine[Any, Any, bytes] = self.server.service.lookup(request,
                                                                          self._tenant)
        else:
            call = wire.parse_call(payload)
            if call is None:
                self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                             "malformed call frame (method, session id, request)")
                return
            method, session, body = call
            coro = self.server.service.call(
                wire.CALLS[method], cast("Message | Refused", self.server.decoders[method](body)),
                session, self._tenant)
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            self._write(wire.ok_reply(done.value))
            return
        except Failed as failed:
            self._answer_failed(failed)
            return
        # the handler waits (a remote tier's check): the rest of it runs in a task
        self.busy = True
        assert self.transport is not None
        self.transport.pause_reading()
        task = asyncio.ensure_future(_finish(coro, yielded))
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Future[Any]) -> None:
        self.busy = False
        if self.transport is None:
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
            self._write(wire.ok_reply(task.result()))
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
        if self.transport is not None and not self.busy:
            what, limit = ("hello", HELLO_TIMEOUT_S) if self.token is None else ("frame",
                                                                               FRAME_TIMEOUT_S)
            self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no complete {what} within {limit:g} s")

    def close(self) -> None:
        self._deadline(None)
        if self.transport is not None:
            self.transport.close()  # flushes what was written first
            self.transport = None
        self.buf.clear()


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
