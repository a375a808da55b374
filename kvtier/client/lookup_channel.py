"""The client's side of the local socket (`kvtier.core.lookupwire`): the daemon's calls of
`kvtier.core.methods.LOCAL` without gRPC's transport when the client reaches the daemon over its
Unix socket.

`LookupChannel.request` (blocking) and `AsyncLookupChannel.call` (asyncio, Lookup) send one call
frame and return the daemon's serialized reply, a `Refusal` (the gRPC status code and message
the daemon answered — the same as over gRPC), or None when the local socket cannot be used (no
socket: a TCP target, or a daemon that has none; it is not listening; the connection was lost
twice in a row): the caller then makes the same call over gRPC, which waits for a restarting
daemon as every call does.

Connections are kept open and reused, one call at a time each; threads (or tasks) calling at
once each take a connection of their own from the idle list, so a client shared by threads stays
safe (a forked child opens its own). A connection that fails mid-call is dropped and a Lookup
retried once on a new one (Lookup changes nothing a client relies on, so a retry is harmless);
another call is sent again only when it could not be sent at all (a kept connection the daemon
closed: its restart), and otherwise answers UNAVAILABLE, as gRPC does for a connection lost
mid-call — an Allocate or Commit is never run twice. The bulk calls (`LookupChannel.write_blocks`,
`read_blocks`: WriteBlocks and ReadBlocks with their payload as raw bytes) likewise; one whose
connection breaks answers UNAVAILABLE and is not sent again.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvtier.core import lookupwire as wire
from kvtier.core.methods import BY_NAME, LOCAL

_LOOKUP = BY_NAME["Lookup"].number
_WRITE, _READ = BY_NAME["WriteBlocks"].number, BY_NAME["ReadBlocks"].number

MAX_REPLY_BYTES = 8 << 20
READ_BYTES = 64 << 10  # the first recv of a reply: a lease call's whole reply, mostly
DEADLINE_EXCEEDED = 4  # grpc.StatusCode.DEADLINE_EXCEEDED
UNAVAILABLE = 14


class Refusal(NamedTuple):
    """The daemon's answer to a refused request: a gRPC status code (its number) and message."""

    code: int
    message: str


class _Lost(Exception):
    """The connection closed or broke mid-call."""


def _answer(payload: bytes) -> bytes | Refusal:
    try:
        body, err = wire.parse_reply(payload)
    except ValueError as exc:
        raise _Lost(str(exc)) from None
    if err is None:
        assert isinstance(body, bytes)
        return body
    assert isinstance(body, int)
    return Refusal(body, err)


class LookupChannel:
    """Blocking calls on `<socket>.lookup` (see the module docstring)."""

    def __init__(self, socket_path: str, token: str, timeout: float) -> None:
        self.path = wire.lookup_socket_path(socket_path)
        self._token = token
        self._timeout = timeout
        self._idle: list[socket.socket] = []
        self._pid = os.getpid()

    def request(self, method: int, session: str, request: bytes, extra_s: float = 0.0
                ) -> bytes | Refusal | None:
        """One call of `LOCAL[method]` under `session`; None when it must go over gRPC (no
        local socket). A connection lost before the request was sent is replaced and the call
        sent again; one lost after it was sent answers UNAVAILABLE, as gRPC does — except a
        Lookup's, sent again once (it changes nothing a client relies on). `extra_s`
        lengthens this call's timeout (a Lookup's `wait_pending_ms`: how long the daemon may
        wait before it answers)."""
        if os.getpid() != self._pid:  # a forked child: the parent's connections are not its own
            self._idle, self._pid = [], os.getpid()
        for _ in (0, 1):
            try:
                conn = self._idle.pop()
            except IndexError:
                try:
                    got = self._connect()
                except _Lost:
                    return None
                except TimeoutError:
                    return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
                if isinstance(got, Refusal):
                    return got
                conn = got
            try:
                conn.sendall(wire.call_frame(method, session, request))
            except TimeoutError:
                conn.close()
                return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
            except OSError:
                conn.close()  # the daemon closed it (restarted, or dropped it): not sent
                continue
            try:
                if extra_s:
                    conn.settimeout(self._timeout + extra_s)
                reply = _answer(self._read(conn))
                if extra_s:
                    conn.settimeout(self._timeout)
            except TimeoutError:
                conn.close()
                return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
            except (OSError, _Lost):
                conn.close()
                if method == _LOOKUP:
                    continue
                return Refusal(UNAVAILABLE, f"connection to the daemon lost during "
                               f"{LOCAL[method].name}")
            self._idle.append(conn)
            return reply
        return None

    def write_blocks(self, header: bytes, blocks: Sequence[Any]) -> bytes | Refusal | None:
        """A WriteBlocks (`header`: a serialized `WriteHeader`; `blocks`: buffers of the layout's
        block size, one per key) with the payload sent as raw bytes: the serialized
        `WriteBlocksResponse`, a `Refusal`, or None when it must go over gRPC."""
        conn = self._bulk_conn(_WRITE, header)
        if conn is None or isinstance(conn, Refusal):
            return conn
        try:
            for block in blocks:
                conn.sendall(block)
        except TimeoutError:
            conn.close()
            return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
        except OSError:
            pass  # the daemon refused the payload and closed: its answer may be waiting
        reply = self._finish(conn, "WriteBlocks")
        if isinstance(reply, Refusal) and conn in self._idle:
            self._idle.remove(conn)  # refused mid-payload: the daemon closes the connection
            conn.close()
        return reply

    def read_blocks(self, request: bytes, block_bytes: int
                    ) -> list[np.ndarray[Any, np.dtype[np.uint8]]] | Refusal | None:
        """A ReadBlocks (`request`: a serialized `ReadBlocksRequest`), its blocks received as
        raw bytes into arrays of their own; a `Refusal`, or None when it must go over gRPC."""
        conn = self._bulk_conn(_READ, request)
        if conn is None or isinstance(conn, Refusal):
            return conn
        try:
            head = _answer(self._read(conn, exact=True))  # the blocks' bytes follow it
            if isinstance(head, Refusal):
                self._idle.append(conn)
                return head
            if len(head) != wire.COUNT.size:
                raise _Lost("malformed ReadBlocks answer")
            (count,) = wire.COUNT.unpack(head)
            blocks = []
            for _ in range(count):
                block = np.empty(block_bytes, np.uint8)
                _into(conn, block.data)
                blocks.append(block)
        except TimeoutError:
            conn.close()
            return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
        except (OSError, _Lost):
            conn.close()
            return Refusal(UNAVAILABLE, "connection to the daemon lost during ReadBlocks")
        self._idle.append(conn)
        return blocks

    def _bulk_conn(self, method: int, request: bytes) -> socket.socket | Refusal | None:
        """A connection that has sent bulk call `LOCAL[method]`, its first answer taken when
        the call is a write (the go-ahead: a `Refusal` when the daemon refused it)."""
        if os.getpid() != self._pid:
            self._idle, self._pid = [], os.getpid()
        for _ in (0, 1):
            try:
                conn = self._idle.pop()
            except IndexError:
                try:
                    got = self._connect()
                except _Lost:
                    return None
                except TimeoutError:
                    return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
                if isinstance(got, Refusal):
                    return got
                conn = got
            try:
                conn.sendall(wire.call_frame(method, "", request))
            except TimeoutError:
                conn.close()
                return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
            except OSError:
                conn.close()  # the daemon closed it (restarted, or dropped it): not sent
                continue
            if method == _READ:
                return conn
            try:
                go = _answer(self._read(conn))
            except TimeoutError:
                conn.close()
                return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
            except (OSError, _Lost):
                conn.close()
                return Refusal(UNAVAILABLE, "connection to the daemon lost during WriteBlocks")
            if isinstance(go, Refusal):
                self._idle.append(conn)  # refused before any payload: the connection goes on
                return go
            if go:
                conn.close()
                return Refusal(UNAVAILABLE, "malformed WriteBlocks answer")
            return conn
        return None

    def _finish(self, conn: socket.socket, method: str) -> bytes | Refusal:
        """The daemon's answer on `conn`; the connection kept when it may be used again."""
        try:
            reply = _answer(self._read(conn))
        except TimeoutError:
            conn.close()
            return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
        except (OSError, _Lost):
            conn.close()
            return Refusal(UNAVAILABLE, f"connection to the daemon lost during {method}")
        self._idle.append(conn)
        return reply

    def _connect(self) -> socket.socket | Refusal:
        """A connection past its hello; raises _Lost when the socket cannot be used."""
        if not os.path.exists(self.path):
            raise _Lost("no lookup socket")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self._timeout)
        try:
            conn.connect(self.path)
            conn.sendall(wire.hello(self._token))
            answer = _answer(self._read(conn))
        except TimeoutError:
            conn.close()
            raise
        except (OSError, _Lost):
            conn.close()
            raise _Lost("lookup socket unusable") from None
        if isinstance(answer, Refusal):
            conn.close()
            return answer
        return conn

    @staticmethod
    def _read(conn: socket.socket, exact: bool = False) -> bytes:
        """One reply frame's payload, read with one recv when it has all arrived (a reply is the
        only thing the daemon sends after a request, so no byte past it can be there); `exact`
        for a reply that raw bytes follow (a ReadBlocks' count): no byte past it is taken."""
        if exact:
            (size,) = wire.HEAD.unpack(_exactly(conn, wire.HEAD.size))
            if size > MAX_REPLY_BYTES:
                raise _Lost(f"reply of {size} bytes")
            return _exactly(conn, size)
        got = conn.recv(READ_BYTES)
        if len(got) < wire.HEAD.size:
            if not got:
                raise _Lost("connection closed")
            got += _exactly(conn, wire.HEAD.size - len(got))
        (size,) = wire.HEAD.unpack_from(got)
        if size > MAX_REPLY_BYTES:
            raise _Lost(f"reply of {size} bytes")
        end = wire.HEAD.size + size
        if len(got) > end:
            raise _Lost(f"{len(got) - end} bytes past the reply")
        if len(got) < end:
            return got[wire.HEAD.size:] + _exactly(conn, end - len(got))
        return got[wire.HEAD.size:]

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


def _exactly(conn: socket.socket, n: int) -> bytes:
    got = conn.recv(n)
    if len(got) == n:
        return got
    parts = [got]
    left = n - len(got)
    while left:
        if not got:
            raise _Lost("connection closed")
        got = conn.recv(left)
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _into(conn: socket.socket, view: memoryview) -> None:
    """Fills `view` from `conn`."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise _Lost("connection closed")
        got += n


_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AsyncLookupChannel:
    """`LookupChannel` for one event loop."""

    def __init__(self, socket_path: str, token: str, timeout: float) -> None:
        self.path = wire.lookup_socket_path(socket_path)
        self._hello = wire.hello(token)
        self._timeout = timeout
        self._idle: list[_Stream] = []

    async def call(self, request: bytes) -> bytes | Refusal | None:
        """One Lookup (`request` a serialized `LookupRequest`), sent again once on a new
        connection when its connection was lost."""
        data = wire.call_frame(_LOOKUP, "", request)
        for _ in (0, 1):
            try:
                async with asyncio.timeout(self._timeout):
                    conn = self._idle.pop() if self._idle else await self._connect()
                    if conn is None:
                        return None
                    if isinstance(conn, Refusal):
                        return conn
                    try:
                        conn[1].write(data)
                        reply = _answer(await self._read(conn[0]))
                    except (OSError, _Lost, asyncio.IncompleteReadError):
                        conn[1].close()
                        continue
                    except BaseException:
                        conn[1].close()
                        raise
            except TimeoutError:
                return Refusal(DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._idle.append(conn)
            return reply
        return None

    async def _connect(self) -> _Stream | Refusal | None:
        if not os.path.exists(self.path):
            return None
        try:
            reader, writer = await asyncio.open_unix_connection(
                self.path, limit=MAX_REPLY_BYTES + wire.HEAD.size)
        except OSError:
            return None
        try:
            writer.write(self._hello)
            answer = _answer(await self._read(reader))
        except (OSError, _Lost, asyncio.IncompleteReadError):
            writer.close()
            return None
        except BaseException:
            writer.close()
            raise
        if isinstance(answer, Refusal):
            writer.close()
            return answer
        return reader, writer

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> bytes:
        (size,) = wire.HEAD.unpack(await reader.readexactly(wire.HEAD.size))
        if size > MAX_REPLY_BYTES:
            raise _Lost(f"reply of {size} bytes")
        return await reader.readexactly(size)

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()
