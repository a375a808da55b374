"""Block header: round trip and every kind of mismatch detected."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from kvtier.tiers import blockfmt
from kvtier.tiers.blockfmt import HEADER_SIZE, BlockCorrupt, Corruption

LAYOUT = blockfmt.layout_digest(b"layout-a")
KEY = b"\x01t" + b"k" * 32


def blob(payload: bytes = b"x" * 1000, key: bytes = KEY) -> bytes:
    return blockfmt.encode_header(key, LAYOUT, payload) + payload


def reason(data: bytes, key: bytes = KEY, layout: bytes = LAYOUT) -> Corruption:
    with pytest.raises(BlockCorrupt) as info:
        blockfmt.verify(key, layout, data)
    return info.value.reason


def test_round_trip_is_zero_copy() -> None:
    payload = os.urandom(4096)
    data = blob(payload)
    assert len(data) == HEADER_SIZE + 4096
    out = blockfmt.verify(KEY, LAYOUT, data)
    assert bytes(out) == payload and out.obj is data


def test_mismatches() -> None:
    assert reason(blob(), layout=blockfmt.layout_digest(b"layout-b")) is Corruption.LAYOUT
    assert reason(blob(), key=b"\x01t" + b"j" * 32) is Corruption.KEY
    assert reason(blob()[:-1]) is Corruption.LENGTH
    assert reason(blob() + b"\0") is Corruption.LENGTH
    assert reason(blob()[:10]) is Corruption.SHORT
    data = bytearray(blob())
    data[-1] ^= 1
    assert reason(bytes(data)) is Corruption.PAYLOAD_CHECKSUM


def resealed(field_offset: int, value: bytes) -> bytes:
    """A header with one field changed and its header checksum recomputed (a 'valid' forgery)."""
    data = bytearray(blob())
    data[field_offset : field_offset + len(value)] = value
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    return bytes(data)


def test_each_header_field_is_checked() -> None:
    assert reason(resealed(0, b"XXXX")) is Corruption.MAGIC
    assert reason(resealed(4, struct.pack("<H", 2))) is Corruption.VERSION


def test_every_single_bit_flip_in_header_and_payload_is_detected() -> None:
    data = blob(os.urandom(256))
    for bit in range(len(data) * 8):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(BlockCorrupt):
            blockfmt.verify(KEY, LAYOUT, bytes(bad))


def test_layout_must_be_a_digest() -> None:
    with pytest.raises(ValueError):
        blockfmt.encode_header(KEY, b"short", b"")
