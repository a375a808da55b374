"""What the daemon does with a request before any handler sees it: per-method size limits and
decoding that never raises.

gRPC's own limit (`grpc.max_receive_message_length`) is one number for the whole server; it is set
to the largest message any method legitimately carries (`Limits.largest`: a WriteBlocks chunk or
a chain of `max_blocks_per_request` keys), so anything bigger is refused by gRPC itself before it
is buffered. Every method then has its own, much smaller, limit (`Limits.of`), checked on the raw
bytes before they are parsed into a message — a 4 MiB `Release` is never decoded.

WriteBlocks chunks are read by hand (`kvtier.core.chunkwire`: a `Chunk` whose data is a view of
the received bytes, the payload not copied); any message not in the plain form that reader takes
is decoded by protobuf.

A message that is over its method's limit, or is not valid protobuf (a truncated field, a
`string` field that is not UTF-8), becomes a `Refused` value instead of an exception: the
servicer answers it with RESOURCE_EXHAUSTED or INVALID_ARGUMENT like any other bad request
(`Service.answer` checks for it), and the log gets at most one WARNING line per `WARN_EVERY_S`
with the count of the requests it stands for — never a traceback per request.

Both transports decode with these (`kvtier.daemon.rpc.grpc_server`, `.local_socket`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError, Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core.chunkwire import Chunk, parse_chunk
from kvtier.core.methods import METHODS, Local, Method, Size

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["KvTier"]
SMALL_BYTES = 4 << 10  # every method without keys or payload
SLACK_BYTES = 4 << 10  # the fields beside the keys or the chunk's data
WARN_EVERY_S = 10.0


class Refused(NamedTuple):
    """A request refused before decoding (what the handler gets instead of the message)."""

    code: grpc.StatusCode
    message: str


class Limits(NamedTuple):
    """Largest accepted message per method (`kvtier.core.methods.Size` in bytes, from the
    daemon's key-count limit and chunk size)."""

    per_method: dict[str, int]

    @classmethod
    def for_daemon(cls, max_blocks: int, key_width: int, chunk_bytes: int) -> Limits:
        chain = max_blocks * key_width + SLACK_BYTES
        size = {Size.SMALL: SMALL_BYTES, Size.KEYS: chain, Size.TWO_CHAINS: 2 * chain,
                Size.CHUNK: max(chain, chunk_bytes + SLACK_BYTES)}
        return cls({m.name: size[m.size] for m in METHODS})

    def of(self, method: str) -> int:
        return self.per_method[method]

    def local(self, m: Method) -> int:
        """The largest request of `m` on the local socket (a WriteBlocks there: its header)."""
        return self.of("Allocate") if m.local is Local.BULK_WRITE else self.of(m.name)

    @property
    def largest(self) -> int:
        return max(self.per_method.values())


class _Warnings:
    """One WARNING line per kind per `every` seconds, counting the requests it stands for."""

    def __init__(self, every: float = WARN_EVERY_S) -> None:
        self._every = every
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            held = self._held.get(kind, 0) + 1
            if now - self._last.get(kind, -1e18) < self._every:
                self._held[kind] = held
                return
            self._last[kind], self._held[kind] = now, 0
        log.warning("refused %d %s request(s) in the last %.0f s (latest: %s)", held, kind,
                    self._every, detail)


WARNINGS = _Warnings()


def deserializer(method: str, msg_type: type[Message], limit: int
                 ) -> Callable[[bytes], Message | Chunk | Refused]:
    chunks = method == "WriteBlocks"  # its chunks: parsed by hand, the payload not copied

    def decode(data: bytes) -> Message | Chunk | Refused:
        if len(data) > limit:
            WARNINGS.warn("oversized", f"{method} of {len(data)} bytes")
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{method} message of {len(data)} bytes exceeds this method's limit "
                           f"of {limit} bytes")
        if chunks and (chunk := parse_chunk(data, wrapped=True)) is not None:
            return chunk
        try:
            return msg_type.FromString(data)
        except DecodeError as exc:
            WARNINGS.warn("undecodable", f"{method}: {exc}")
            return Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"undecodable {method} message ({_reason(exc)})")
    return decode


def _reason(exc: DecodeError) -> str:
    text = str(exc)
    return text.rpartition(": ")[2] or "invalid protobuf"


async def decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream's messages; raises `RefusedError` at the first refused one."""
    async for msg in requests:
        if isinstance(msg, Refused):
            raise RefusedError(msg)
        yield msg


class RefusedError(Exception):
    """A refused message inside a client stream (the servicer answers it with its code)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.message)
        self.refused = refused
