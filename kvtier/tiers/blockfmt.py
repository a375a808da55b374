"""The stored block format: a fixed 64-byte header describing every SSD payload. Pure, no I/O.

(`kvtier.tiers.ssd.store` keeps the header in the block's index record and the payload in a slot
file or an LMDB value; `verify` also checks a header immediately followed by its payload in one
buffer.)

    offset  size  field
    0       4     magic b"KVB1"
    4       2     format version (FORMAT_VERSION)
    6       2     flags (0; reserved)
    8       16    layout digest: xxh3-128 of the layout fingerprint
    24      8     payload length in bytes
    32      8     payload checksum: xxh3-64 of the payload
    40      8     key digest: xxh3-64 of (tenant, key) as stored
    48      8     reserved (0)
    56      8     header checksum: xxh3-64 of bytes 0..56

Every read verifies all of it (`verify`): a block is served only if the header checksum, magic,
version, layout digest, key digest, length and payload checksum all match. Any flipped bit in
the header is caught by the header checksum; any flipped bit in the payload by the payload
checksum (xxh3-64 detects every single-bit error; a random corruption escapes with p = 2^-64).
"""

from __future__ import annotations

import enum
import struct
from typing import Final

import xxhash

from kvtier.core.errors import KvtierError

MAGIC: Final = b"KVB1"
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 64
_HEAD = struct.Struct("<4sHH16sQQQQ")
_CHECK = struct.Struct("<Q")
assert _HEAD.size + _CHECK.size == HEADER_SIZE


class Corruption(enum.Enum):
    """Why a stored block was rejected (a metric label; bounded)."""

    SHORT = "short"
    HEADER_CHECKSUM = "header_checksum"
    MAGIC = "magic"
    VERSION = "version"
    LAYOUT = "layout"
    KEY = "key"
    LENGTH = "length"
    PAYLOAD_CHECKSUM = "payload_checksum"


class BlockCorrupt(KvtierError):
    """A stored block failed verification; it must be treated as a miss and deleted."""

    def __init__(self, reason: Corruption) -> None:
        super().__init__(f"stored block rejected: {reason.value}")
        self.reason = reason


def layout_digest(fingerprint: bytes) -> bytes:
    """16-byte digest of a layout fingerprint (any length) as stored in headers."""
    return xxhash.xxh3_128_digest(fingerprint)


def key_digest(stored_key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(stored_key)


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(stored_key: bytes, layout: bytes, payload: bytes | memoryview) -> bytes:
    """The 64-byte header for `payload` stored under `stored_key` with layout digest `layout`."""
    if len(layout) != 16:
        raise ValueError("layout must be a 16-byte layout_digest()")
    head = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        layout,
        memoryview(payload).nbytes,
        payload_checksum(payload),
        key_digest(stored_key),
        0,
    )
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def check_header(
    stored_key: bytes, layout: bytes, blob: bytes | bytearray | memoryview, total_len: int
) -> int:
    """Verify the header at the start of `blob` for a stored value of `total_len` bytes
    (header + payload); return the expected payload checksum.

    The caller then checksums the payload bytes it actually serves (e.g. after copying them out),
    so what is served is exactly what was verified.
    """
    view = memoryview(blob)
    if len(view) < HEADER_SIZE or total_len < HEADER_SIZE:
        raise BlockCorrupt(Corruption.SHORT)
    head = view[: _HEAD.size]
    (check,) = _CHECK.unpack_from(view, _HEAD.size)
    if xxhash.xxh3_64_intdigest(head) != check:
        raise BlockCorrupt(Corruption.HEADER_CHECKSUM)
    magic, version, _flags, digest, length, csum, kdig, _res = _HEAD.unpack(head)
    if magic != MAGIC:
        raise BlockCorrupt(Corruption.MAGIC)
    if version != FORMAT_VERSION:
        raise BlockCorrupt(Corruption.VERSION)
    if digest != layout:
        raise BlockCorrupt(Corruption.LAYOUT)
    if kdig != key_digest(stored_key):
        raise BlockCorrupt(Corruption.KEY)
    if length != total_len - HEADER_SIZE:
        raise BlockCorrupt(Corruption.LENGTH)
    return int(csum)


def verify(stored_key: bytes, layout: bytes, blob: bytes | memoryview) -> memoryview:
    """Check header + payload of a stored value; return the payload view or raise BlockCorrupt.

    The returned view aliases `blob` (zero-copy): it is valid exactly as long as `blob` is.
    """
    csum = check_header(stored_key, layout, blob, len(blob))
    payload = memoryview(blob)[HEADER_SIZE:]
    if payload_checksum(payload) != csum:
        raise BlockCorrupt(Corruption.PAYLOAD_CHECKSUM)
    return payload
