"""The DRAM segment's contract: what the daemon writes at the head of its shared-memory pool and
what a client checks before it reads or writes a slot. Pure: formats and checks, no mapping.

Segment layout (all little-endian):

    0                 HEADER_BYTES (4096)       data_offset + p*page_bytes
    | header | pad   | page 0 | page 1 | ... | page n-1 |
      magic b"KVTDRAM\\0", version, state (1 live, 2 closed), generation (random u64),
      slot_size (the smallest slot), slot_stride (it rounded up to 4 KiB), slot_count (slots of
      that size the data area holds), data_offset, page_bytes, page_count

Version 2 (size classes): the data area is pages that size classes take on demand; the blocks of
a class with stride s lie on the grid data_offset + i*s, so a client views one layout's blocks
as the [rows, s] array `slot_array(segment, data_offset, rows, s, s)` and turns the byte offset
the daemon hands out into row (offset - data_offset) // s (`kvtier.tiers.dram_pages`). A client
that finds another version refuses the segment (`StaleSegment` naming both versions).

The daemon (`kvtier.tiers.dram`) creates the file and writes the header once; a client
(`kvtier.client.mapping`) checks magic, version, generation and geometry at attach against the
`SegmentHandle` the daemon sent, and re-reads `state` later: a daemon that closes marks the header
closed before unlinking, and a recreated segment has a new generation, so a stale client never
mistakes a new pool for its old one.

With tenants (a tokens file) the pool has no name: each tenant's client maps its own anonymous
file (`kvtier.tiers.dram_regions`), which carries the same header, at the same offsets. It asks
for it on the fd socket beside the daemon's socket (`fd_socket_path`): one request line
`KVTFD1 <token>\n`, one reply line of JSON (`{"tenant", "generation", "size"}` with the fd as
SCM_RIGHTS ancillary data, or `{"error"}` without any fd) — `fd_request`, `fd_reply`,
`parse_fd_reply`.
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier.core.errors import KvtierError

MAGIC = b"KVTDRAM\0"
VERSION = 2
HEADER_BYTES = 4096
SLOT_ALIGN = 4096
STATE_LIVE = 1
STATE_CLOSED = 2
HEADER = struct.Struct("<8sIIQQQQQQQ")
STATE = struct.Struct("<I")
STATE_OFFSET = 12


FD_SOCKET_SUFFIX = ".fds"
FD_REQUEST = b"KVTFD1 "
FD_MESSAGE_MAX = 4096


def fd_socket_path(socket: str) -> str:
    """Where the daemon listening on Unix socket `socket` hands out tenants' pool fds."""
    return socket + FD_SOCKET_SUFFIX


def fd_request(token: str) -> bytes:
    line = FD_REQUEST + token.encode() + b"\n"
    if len(line) > FD_MESSAGE_MAX or "\n" in token:
        raise ValueError("token too long or not one line")
    return line


def parse_fd_request(line: bytes) -> str | None:
    """The token of a request line; None when it is not one."""
    if not line.startswith(FD_REQUEST) or not line.endswith(b"\n"):
        return None
    try:
        return line[len(FD_REQUEST):-1].decode()
    except UnicodeDecodeError:
        return None


def fd_reply(tenant: str = "", generation: int = 0, size: int = 0, error: str = "") -> bytes:
    body = {"error": error} if error else {"tenant": tenant, "generation": generation,
                                           "size": size}
    return json.dumps(body).encode() + b"\n"


def parse_fd_reply(line: bytes) -> tuple[str, int, int]:
    """(tenant, generation, size) of a reply; StaleSegment naming the daemon's refusal."""
    try:
        body = json.loads(line)
        if "error" in body:
            raise StaleSegment(f"the daemon refused the pool's fd: {body['error']}")
        return str(body["tenant"]), int(body["generation"]), int(body["size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StaleSegment(f"bad reply on the fd socket: {exc}") from None


class DramError(KvtierError):
    """A DRAM pool operation broke the pool's rules (a bug in the caller, not bad user input)."""


class StaleSegment(KvtierError):
    """The segment at this name is not the one the client was told about (recreated or closed)."""


class SegmentHandle(NamedTuple):
    """What a client needs to attach: sent by the daemon (e.g. in a gRPC reply)."""

    name: str
    size: int
    generation: int
    slot_size: int
    slot_stride: int
    slot_count: int
    data_offset: int
    shm_dir: str = "/dev/shm"
    page_bytes: int = 0
    page_count: int = 0


class SegmentHeader(NamedTuple):
    """The header as stored at offset 0 of the segment."""

    magic: bytes
    version: int
    state: int  # STATE_LIVE or STATE_CLOSED
    generation: int
    slot_size: int
    slot_stride: int
    slot_count: int
    data_offset: int
    page_bytes: int = 0
    page_count: int = 0

    @classmethod
    def live(cls, h: SegmentHandle) -> SegmentHeader:
        """The header a live segment described by `h` carries."""
        return cls(MAGIC, VERSION, STATE_LIVE, h.generation, h.slot_size, h.slot_stride,
                   h.slot_count, h.data_offset, h.page_bytes, h.page_count)


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def slot_stride(slot_size: int) -> int:
    return round_up(slot_size, SLOT_ALIGN)


def pack_header(buf: bytearray | memoryview | object, header: SegmentHeader) -> None:
    """Write `header` at offset 0 of a writable buffer (an mmap)."""
    HEADER.pack_into(buf, 0, *header)  # type: ignore[arg-type]


def unpack_header(buf: bytes | memoryview | object) -> SegmentHeader:
    """The header at offset 0 of `buf` (at least `HEADER.size` bytes)."""
    return SegmentHeader(*HEADER.unpack_from(buf, 0))  # type: ignore[arg-type]


def read_state(buf: object) -> int:
    state: int = STATE.unpack_from(buf, STATE_OFFSET)[0]  # type: ignore[arg-type]
    return state


def mark_closed(buf: object) -> None:
    STATE.pack_into(buf, STATE_OFFSET, STATE_CLOSED)  # type: ignore[arg-type]


def check_attach(header: SegmentHeader, handle: SegmentHandle, path: str) -> None:
    """Raise `StaleSegment` unless `header` is the live pool `handle` describes."""
    if header.magic == MAGIC and header.version != VERSION:
        raise StaleSegment(
            f"{path} has DRAM segment format version {header.version}; this client reads "
            f"version {VERSION} (upgrade the daemon and its clients together)")
    if header != SegmentHeader.live(handle):
        raise StaleSegment(f"{path} is not the pool of generation {handle.generation}")


def slot_array(segment: npt.NDArray[np.uint8], data_offset: int, num_slots: int,
               slot_bytes: int, slot_stride: int) -> npt.NDArray[np.uint8]:
    """The [num_slots, slot_bytes] slot buffer over a mapped segment (the DRAM tier's shm):
    slot i starts at data_offset + i * slot_stride. Shares memory with `segment`."""
    if segment.dtype != np.uint8 or segment.ndim != 1:
        raise ValueError("segment must be a 1-D uint8 array")
    if slot_stride < slot_bytes or num_slots <= 0:
        raise ValueError(f"bad slot geometry: {num_slots} slots of {slot_bytes} B every "
                         f"{slot_stride} B")
    end = data_offset + (num_slots - 1) * slot_stride + slot_bytes
    if data_offset < 0 or end > segment.size:
        raise ValueError(f"slots end at byte {end}, past the {segment.size} B segment")
    return np.lib.stride_tricks.as_strided(
        segment[data_offset:], shape=(num_slots, slot_bytes), strides=(slot_stride, 1),
        writeable=bool(segment.flags.writeable))
