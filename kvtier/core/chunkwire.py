"""The protobuf wire form of a block chunk (`kvtier.v1.BlockChunk`, alone as a ReadBlocks reply or
as the `chunk` of a `WriteBlocksRequest`), written and read by hand so the payload is copied once
at each end instead of three or four times (`bytes` slice, message field, serialization, parse).

    head = chunk_head(index, offset, count, len(data), wrapped=False)
    message = head + data               # one copy of the payload; any buffer as `data`
    c = parse_chunk(message, wrapped=False)   # c.data: a memoryview into `message`, no copy

What is written is ordinary protobuf (fields 1, 2, 4, then 3; zero values left out), so any
protobuf reader decodes it. `parse_chunk` takes only the plain form any encoder writes — each
known field at most once, nothing else — and returns None for anything it does not take (a
repeated or unknown field, a varint past its type, a truncated message): the caller then decodes
the message with protobuf itself, which applies protobuf's rules or refuses it. So a peer that
does not know this module is read exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

_INDEX, _OFFSET, _DATA, _COUNT = 0x08, 0x10, 0x1A, 0x20  # (field number << 3) | wire type
_CHUNK_IN_WRITE = 0x12  # WriteBlocksRequest.chunk: field 2, length-delimited
_U32 = 1 << 32
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class Chunk:
    """A parsed chunk; `data` is a view into the message it was parsed from."""

    index: int
    offset: int
    data: memoryview
    count: int


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_head(index: int, offset: int, count: int, data_len: int, wrapped: bool) -> bytes:
    """The bytes of a chunk message up to its payload (`data_len` bytes, to be appended).
    `wrapped`: as a `WriteBlocksRequest` whose `chunk` it is."""
    head = b"".join((
        (bytes((_INDEX,)) + varint(index)) if index else b"",
        (bytes((_OFFSET,)) + varint(offset)) if offset else b"",
        (bytes((_COUNT,)) + varint(count)) if count else b"",
        bytes((_DATA,)) + varint(data_len) if data_len else b"",
    ))
    if not wrapped:
        return head
    return bytes((_CHUNK_IN_WRITE,)) + varint(len(head) + data_len) + head


def _varint(buf: bytes, at: int, end: int) -> tuple[int, int]:
    """(value, next position); value -1 when it runs past `end` or past 10 bytes."""
    value = shift = 0
    while at < end and shift < 70:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7
    return -1, at


def parse_chunk(buf: bytes, wrapped: bool) -> Chunk | None:
    """The chunk in `buf` (a `BlockChunk`; `wrapped`: a `WriteBlocksRequest` holding one), or
    None when `buf` is not in the plain form (decode it with protobuf then)."""
    end = len(buf)
    at = 0
    if wrapped:
        if not end or buf[0] != _CHUNK_IN_WRITE:
            return None
        size, at = _varint(buf, 1, end)
        if size < 0 or at + size != end:
            return None
    index = offset = count = 0
    data: memoryview | None = None
    seen = 0
    while at < end:
        tag = buf[at]
        at += 1
        if tag == _DATA:
            size, at = _varint(buf, at, end)
            if size < 0 or at + size > end or data is not None:
                return None
            data = memoryview(buf)[at : at + size]
            at += size
            continue
        bit = {_INDEX: 1, _OFFSET: 2, _COUNT: 4}.get(tag, 0)
        if not bit or seen & bit:
            return None
        seen |= bit
        value, at = _varint(buf, at, end)
        if value < 0 or value >= (_U64 if tag == _OFFSET else _U32):
            return None
        if tag == _INDEX:
            index = value
        elif tag == _OFFSET:
            offset = value
        else:
            count = value
    return Chunk(index, offset, data if data is not None else memoryview(b""), count)
