"""The local socket's wire: the daemon's calls without gRPC's transport, for clients on its host.

The daemon listening on Unix socket `S` also listens on `S.lookup` (`lookup_socket_path`). On a
connection every message is a frame: a 4-byte little-endian length, then that many bytes. The
first frame the client sends is the hello, `KVTLK<PROTOCOL_VERSION> <token>` (the token empty
without a tokens file); the daemon answers it with an OK reply (empty body) or an error reply,
after which it closes the connection (a hello of another protocol version: INVALID_ARGUMENT).

Then each client frame is a call (`call_frame`): the method's number (one byte: `Method.number`
of `kvtier.core.methods.LOCAL`), the length of the session id (one byte) and the session id
(ASCII: the `kvtier-session` the client would send as gRPC metadata; empty without one), then
the serialized request. Each daemon frame is the reply to one: status byte 0 and the serialized
response, or status byte 1, the gRPC status code (one byte) and the UTF-8 message — the code and
message the same request gets over gRPC. One call at a time per connection (no pipelining).

A frame longer than the receiver's limit (the daemon: the size gRPC allows the largest of these
methods, see `kvtier.daemon.rpc.guard.Limits`; `HELLO_MAX` for the hello) is refused before it
is read: the daemon answers RESOURCE_EXHAUSTED and closes the connection.

The bulk calls carry their payload as raw bytes after the frames:
- WriteBlocks (`Local.BULK_WRITE`): the request is a serialized `kvtier.v1.WriteHeader`. The
  daemon answers OK with an empty body (slots claimed: send the payload) or an error (nothing
  claimed). After the OK the client sends exactly `count × block_bytes` raw bytes (count =
  len(keys) / key_width, block_bytes the layout's), the blocks in key order; the daemon then
  answers OK with a serialized `WriteBlocksResponse`, or an error and closes the connection. The
  payload must arrive without a pause of `FRAME_TIMEOUT_S`; a connection that ends before all
  of it arrived has nothing committed and its slots freed.
- ReadBlocks (`Local.BULK_READ`): the request is a serialized `kvtier.v1.ReadBlocksRequest`. The
  daemon answers OK with the number of cached blocks (`COUNT`, 4 bytes little-endian) or an
  error; after the OK follow `count × block_bytes` raw bytes. A read that fails once its bytes
  have begun ends with the connection closed (the client sees a short payload).
"""

from __future__ import annotations

import struct

from kvtier.core.chunkwire import varint
from kvtier.core.methods import LOCAL, PROTOCOL_VERSION

LOOKUP_SOCKET_SUFFIX = ".lookup"
HELLO = b"KVTLK%d " % PROTOCOL_VERSION
HELLO_MAX = 4096
COUNT = struct.Struct("<I")
SESSION_MAX = 255
HEAD = struct.Struct("<I")
OK, ERROR = 0, 1


class FrameTooLarge(ValueError):
    """A frame's length prefix is over the receiver's limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size


def lookup_socket_path(socket: str) -> str:
    """Where the daemon listening on Unix socket `socket` answers Lookups without gRPC."""
    return socket + LOOKUP_SOCKET_SUFFIX


_HIT_BLOCKS, _TIERS, _PLAN = 0x08, 0x12, 0x1A  # LookupResponse's fields: (number << 3) | type


def lookup_response(tier_codes: bytes, plan: bytes | None = None) -> bytes:
    """A `kvtier.v1.LookupResponse` in wire form, as protobuf writes it (fields in number order,
    zero values left out), without a message object: `hit_blocks` = len(tier_codes), `tiers`
    packed from `tier_codes` (`kvtier.v1.Tier` values, 1..4: one byte each), and `plan` when
    given (a serialized `kvtier.v1.Plan`, present even when empty). Building the message and
    serializing it cost ~40 us for 1,024 tiers; this, one copy of the codes."""
    n = len(tier_codes)
    parts = []
    if n:
        parts = [bytes((_HIT_BLOCKS,)) + varint(n), bytes((_TIERS,)) + varint(n), tier_codes]
    if plan is not None:
        parts += (bytes((_PLAN,)) + varint(len(plan)), plan)
    return b"".join(parts)


def frame(payload: bytes) -> bytes:
    return HEAD.pack(len(payload)) + payload


def hello(token: str) -> bytes:
    """The first frame of a connection."""
    return frame(HELLO + token.encode())


def parse_hello(payload: bytes) -> str | None:
    """The token of a hello of this protocol version; None when `payload` is not one."""
    if not payload.startswith(HELLO):
        return None
    try:
        return payload[len(HELLO):].decode()
    except UnicodeDecodeError:
        return None


def call_frame(method: int, session: str, request: bytes) -> bytes:
    """A client frame: method `LOCAL[method]` under `session`."""
    sid = session.encode("ascii")
    if len(sid) > SESSION_MAX:
        raise ValueError(f"a session id of {len(sid)} bytes (at most {SESSION_MAX})")
    return HEAD.pack(len(request) + 2 + len(sid)) + bytes((method, len(sid))) + sid + request


def parse_call(payload: bytes) -> tuple[int, str, bytes] | None:
    """(method number, session id, request bytes) of a client frame; None when it is not one
    (too short, no method of that number, a session id that is not ASCII)."""
    if len(payload) < 2 or payload[0] >= len(LOCAL) or len(payload) < 2 + payload[1]:
        return None
    end = 2 + payload[1]
    try:
        session = payload[2:end].decode("ascii")
    except UnicodeDecodeError:
        return None
    return payload[0], session, payload[end:]


def ok_reply(body: bytes = b"") -> bytes:
    return HEAD.pack(len(body) + 1) + b"\0" + body


def error_reply(code: int, message: str) -> bytes:
    return frame(bytes((ERROR, code)) + message.encode("utf-8", "replace")[:HELLO_MAX])


def parse_reply(payload: bytes) -> tuple[bytes, None] | tuple[int, str]:
    """(body, None) for an OK reply, (code, message) for an error; ValueError for neither."""
    if payload[:1] == b"\0":
        return payload[1:], None
    if len(payload) >= 2 and payload[0] == ERROR:
        return payload[1], payload[2:].decode("utf-8", "replace")
    raise ValueError("malformed reply on the lookup socket")


def take_frame(buf: bytearray, limit: int) -> bytes | None:
    """Removes and returns the first complete frame of `buf`; None while it is incomplete.
    Raises FrameTooLarge as soon as the length prefix is over `limit`."""
    if len(buf) < HEAD.size:
        return None
    (size,) = HEAD.unpack_from(buf)
    if size > limit:
        raise FrameTooLarge(size, limit)
    end = HEAD.size + size
    if len(buf) < end:
        return None
    payload = bytes(buf[HEAD.size:end])
    del buf[:end]
    return payload
