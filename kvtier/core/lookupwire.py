"""The lookup socket's wire: Lookup without gRPC's transport, for a client on the daemon's machine.

The daemon listening on Unix socket `S` also listens on `S.lookup` (`lookup_socket_path`). On a
connection every message is a frame: a 4-byte little-endian length, then that many bytes. The
first frame the client sends is the hello, `KVTLK1 <token>` (the token empty without a tokens
file); the daemon answers it with an OK reply (empty body) or an error reply, after which it
closes the connection. Then each client frame is one serialized `kvtier.v1.LookupRequest` and each
daemon frame the reply to it: status byte 0 and a serialized `LookupResponse`, or status byte 1,
the gRPC status code (one byte) and the UTF-8 message — the code and message the same request
gets over gRPC. One request at a time per connection (no pipelining).

A frame longer than the receiver's limit (the daemon: the size gRPC allows a Lookup, see
`kvtier.daemon.rpc.guard.Limits`; `HELLO_MAX` for the hello) is refused before it is read: the
daemon answers RESOURCE_EXHAUSTED and closes the connection.

Calls (issue 25, the shared-memory data path): a connection opened with the hello
`KVTLK2 <token>` carries, besides Lookup, the lease calls of that path — Acquire, Release,
Allocate, Commit, Abort (`CALLS`) — each client frame being `call_frame`'s: the method's number
(one byte, its index in `CALLS`), the length of the session id (one byte) and the session id
(ASCII: the `kvtier-session` the client would send as gRPC metadata; empty without one), then
the serialized request of that method. The replies are as above. An older daemon refuses the
`KVTLK2` hello (INVALID_ARGUMENT) and its clients keep to `KVTLK1` and gRPC.

Bulk calls (issue 25, the streaming byte path for clients that cannot map the pool): a daemon
that takes them answers the `KVTLK2` hello with the OK body `BULK_HELLO` (an older one: an empty
body, which older clients ignore), and then also takes method numbers `len(CALLS) + i` for
`BULK[i]`, whose payload travels as raw bytes after the frames:
- WriteBlocks: the request is a serialized `kvtier.v1.WriteHeader`. The daemon answers OK with
  an empty body (slots claimed: send the payload) or an error (nothing claimed). After the OK the
  client sends exactly `count × block_bytes` raw bytes (count = len(keys) / key_width,
  block_bytes the layout's), the blocks in key order; the daemon then answers OK with a
  serialized `WriteBlocksResponse`, or an error and closes the connection. The payload must
  arrive without a pause of `FRAME_TIMEOUT_S`; a connection that ends before all of it arrived
  has nothing committed and its slots freed.
- ReadBlocks: the request is a serialized `kvtier.v1.ReadBlocksRequest`. The daemon answers OK
  with the number of cached blocks (`COUNT`, 4 bytes little-endian) or an error; after the OK
  follow `count × block_bytes` raw bytes. A read that fails once its bytes have begun ends with
  the connection closed (the client sees a short payload).
"""

from __future__ import annotations

import struct

from kvtier.core.chunkwire import varint

LOOKUP_SOCKET_SUFFIX = ".lookup"
HELLO = b"KVTLK1 "
HELLO_CALLS = b"KVTLK2 "
HELLO_MAX = 4096
CALLS = ("Lookup", "Acquire", "Release", "Allocate", "Commit", "Abort")
"""The methods of a `KVTLK2` connection, by number."""
BULK = ("WriteBlocks", "ReadBlocks")
"""The bulk calls, by number after `CALLS` (`len(CALLS) + i`)."""
BULK_HELLO = b"bulk"
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


def hello(token: str, calls: bool = False) -> bytes:
    """The first frame of a connection (`calls`: one that carries `CALLS`, `KVTLK2`)."""
    return frame((HELLO_CALLS if calls else HELLO) + token.encode())


def parse_hello(payload: bytes) -> str | None:
    """The token of a `KVTLK1` hello; None when `payload` is not one."""
    got = parse_any_hello(payload)
    return got[0] if got is not None and not got[1] else None


def parse_any_hello(payload: bytes) -> tuple[str, bool] | None:
    """(token, whether the connection carries `CALLS`) of a hello; None when `payload` is not
    one."""
    calls = payload.startswith(HELLO_CALLS)
    if not calls and not payload.startswith(HELLO):
        return None
    try:
        return payload[len(HELLO):].decode(), calls
    except UnicodeDecodeError:
        return None


def call_frame(method: int, session: str, request: bytes) -> bytes:
    """A client frame of a `KVTLK2` connection: method `CALLS[method]` under `session`."""
    sid = session.encode("ascii")
    if len(sid) > SESSION_MAX:
        raise ValueError(f"a session id of {len(sid)} bytes (at most {SESSION_MAX})")
    return HEAD.pack(len(request) + 2 + len(sid)) + bytes((method, len(sid))) + sid + request


def parse_call(payload: bytes, methods: int = len(CALLS)) -> tuple[int, str, bytes] | None:
    """(method number, session id, request bytes) of a `KVTLK2` frame; None when it is not
    one (too short, a method number from `methods` on, a session id that is not ASCII)."""
    if len(payload) < 2 or payload[0] >= methods or len(payload) < 2 + payload[1]:
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
