"""Block chunks in hand-written wire form (`kvtier.core.chunkwire`) on the streaming byte path:
the bytes, what falls back to protobuf, and a real daemon with old (generated-stub) and new
clients on both ReadBlocks and WriteBlocks, including chunks it must refuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import Assembler, Client, KvtierRpcError, LayoutDecl
from kvtier.core.chunkwire import chunk_head, parse_chunk
from tests.daemon_fixture import DaemonProc

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"test-stream-wire-1", block_bytes=BLOCK, block_tokens=16,
                    model_id="test-model-wire")
WRITE = "/kvtier.v1.KvTier/WriteBlocks"


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


# -- the wire form ---------------------------------------------------------------------------

def test_heads_are_the_protobuf_bytes_worked_out_by_hand() -> None:
    # field 1 (index) varint 1: 08 01; field 3 (data) length 3: 1a 03
    assert chunk_head(1, 0, 0, 3, wrapped=False) == bytes([0x08, 0x01, 0x1A, 0x03])
    # offset 300 = varint ac 02 (field 2: 10); count 5 (field 4: 20 05); data length 4
    assert chunk_head(2, 300, 5, 4, wrapped=False) == bytes(
        [0x08, 0x02, 0x10, 0xAC, 0x02, 0x20, 0x05, 0x1A, 0x04])
    # as WriteBlocksRequest.chunk (field 2, length-delimited: 12), 4 head bytes + 3 data bytes
    assert chunk_head(1, 0, 0, 3, wrapped=True) == bytes([0x12, 0x07, 0x08, 0x01, 0x1A, 0x03])
    assert chunk_head(0, 0, 0, 0, wrapped=False) == b""  # all zero: an empty message


def test_protobuf_reads_what_is_written_and_the_hand_reader_reads_protobuf() -> None:
    data = bytes(range(200))
    for index, offset, count in [(0, 0, 7), (3, 4 << 20, 0), (4095, (1 << 40) + 5, 1)]:
        msg = chunk_head(index, offset, count, len(data), wrapped=False) + data
        assert pb.BlockChunk.FromString(msg) == pb.BlockChunk(
            index=index, offset=offset, data=data, count=count)
        wrapped = chunk_head(index, offset, 0, len(data), wrapped=True) + data
        assert pb.WriteBlocksRequest.FromString(wrapped).chunk == pb.BlockChunk(
            index=index, offset=offset, data=data)
        theirs = pb.BlockChunk(index=index, offset=offset, data=data, count=count)
        c = parse_chunk(theirs.SerializeToString(), wrapped=False)
        assert c is not None and (c.index, c.offset, bytes(c.data), c.count) == (
            index, offset, data, count)
        c = parse_chunk(pb.WriteBlocksRequest(chunk=theirs).SerializeToString(), wrapped=True)
        assert c is not None and (c.index, c.offset, bytes(c.data)) == (index, offset, data)


@pytest.mark.parametrize("msg", [
    bytes([0x1A, 0x01, 0x61, 0x1A, 0x01, 0x62]),  # data twice (protobuf: the last wins)
    bytes([0x08, 0x01, 0x08, 0x02]),  # index twice
    bytes([0x28, 0x01]),  # an unknown field (5)
    bytes([0x1A, 0x05, 0x61]),  # data longer than the message
    bytes([0x08]),  # a varint cut off
    bytes([0x08, 0x80, 0x80, 0x80, 0x80, 0x10]),  # index 2**32: past uint32
    bytes([0x10]) + bytes([0xFF] * 10) + bytes([0x01]),  # an 11-byte varint
])
def test_anything_but_the_plain_form_is_left_to_protobuf(msg: bytes) -> None:
    assert parse_chunk(msg, wrapped=False) is None


def test_wrapped_form_must_be_exactly_one_chunk() -> None:
    inner = bytes([0x08, 0x01, 0x1A, 0x01, 0x61])
    assert parse_chunk(bytes([0x12, 0x05]) + inner, wrapped=True) is not None
    assert parse_chunk(bytes([0x12, 0x05]) + inner + b"\x00", wrapped=True) is None  # trailing
    assert parse_chunk(bytes([0x12, 0x06]) + inner, wrapped=True) is None  # length past the end
    assert parse_chunk(bytes([0x0A, 0x00]), wrapped=True) is None  # a header, not a chunk
    assert parse_chunk(b"", wrapped=True) is None


def test_data_is_a_view_into_the_message_not_a_copy() -> None:
    msg = chunk_head(0, 0, 1, 4, wrapped=False) + b"abcd"
    c = parse_chunk(msg, wrapped=False)
    assert c is not None and c.data.obj is msg and bytes(c.data) == b"abcd"


def test_assembler_takes_hand_read_chunks_at_offsets() -> None:
    asm = Assembler(8)
    messages = [chunk_head(index, offset, count, len(data), wrapped=False) + data
                for index, offset, count, data in [(0, 0, 2, b"abcd"), (0, 4, 0, b"efgh"),
                                                   (1, 0, 0, b"ijklmnop")]]
    for msg in messages:
        c = parse_chunk(msg, wrapped=False)
        assert c is not None and asm.add(c)
    got = asm.result()
    assert got.blocks == 2 and [v.tobytes() for v in got.views] == [b"abcdefgh", b"ijklmnop"]
    assert not any(v.flags.writeable for v in got.views)  # read-only, as shm views are
    assert got.views[1].base.obj is messages[2]  # a block in one chunk: the message's bytes


def test_assembler_refuses_gaps_and_truncation() -> None:
    asm = Assembler(8)
    assert asm.add(pb.BlockChunk(index=0, offset=0, data=b"abcd", count=1))
    with pytest.raises(KvtierRpcError, match="out-of-order"):
        asm.add(pb.BlockChunk(index=0, offset=6, data=b"gh"))
    with pytest.raises(KvtierRpcError, match="truncated"):
        asm.result()


# -- a real daemon ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wired(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("wire"), ["--ssd-bytes", "0"]).start()
    try:
        yield d
    finally:
        d.stop()


def _header(keys: list[bytes]) -> pb.WriteBlocksRequest:
    return pb.WriteBlocksRequest(header=pb.WriteHeader(
        layout=LAYOUT.layout_id, keys=b"".join(keys), key_width=LAYOUT.key_width))


def _raw_write(sock: Path, messages: list[bytes]) -> pb.WriteBlocksResponse:
    """WriteBlocks with messages sent exactly as given (no serializer)."""
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        call = ch.stream_unary(WRITE, request_serializer=lambda b: b,
                               response_deserializer=pb.WriteBlocksResponse.FromString)
        reply: pb.WriteBlocksResponse = call(iter(messages), timeout=30)
        return reply


def test_old_clients_stream_both_ways_through_the_generated_stub(wired: DaemonProc) -> None:
    keys, data = chain(1, 3), payloads(3, 1)
    with Client(wired.socket, layout=LAYOUT, streaming=True) as kv:  # registers the layout
        with grpc.insecure_channel(f"unix:{wired.socket}") as ch:
            stub = pb_grpc.KvTierStub(ch)  # type: ignore[no-untyped-call]
            reqs = [_header(keys)] + [pb.WriteBlocksRequest(chunk=pb.BlockChunk(
                index=i, offset=0, data=d)) for i, d in enumerate(data)]
            assert stub.WriteBlocks(iter(reqs), timeout=30).stored == 3  # protobuf's chunks
            chunks = list(stub.ReadBlocks(pb.ReadBlocksRequest(  # protobuf reads ours
                layout=LAYOUT.layout_id, keys=b"".join(keys), key_width=LAYOUT.key_width),
                timeout=30))
        assert [(c.index, c.offset, c.count) for c in chunks] == [(0, 0, 3), (1, 0, 0), (2, 0, 0)]
        assert [c.data for c in chunks] == data
        with kv.load(keys) as got:  # the new client, both directions
            assert got.blocks == 3 and [v.tobytes() for v in got.views] == data
        more = chain(2, 2)
        assert kv.store(more, payloads(2, 2)).stored == 2
        with kv.load(more) as got:
            assert [v.tobytes() for v in got.views] == payloads(2, 2)


def test_a_chunk_protobuf_decodes_differently_is_stored_as_protobuf_reads_it(
    wired: DaemonProc,
) -> None:
    keys = chain(3, 1)
    want = payloads(1, 3)[0]
    junk = bytes(BLOCK)
    # data twice, then index 0 spelled out: not the plain form, so protobuf decodes it (the
    # last data wins); the hand reader taking the first would store the zeros
    inner = (bytes([0x1A]) + _varint(BLOCK) + junk + bytes([0x1A]) + _varint(BLOCK) + want
             + bytes([0x08, 0x00]))
    msg = bytes([0x12]) + _varint(len(inner)) + inner
    with Client(wired.socket, layout=LAYOUT, streaming=True) as kv:
        assert _raw_write(wired.socket, [_header(keys).SerializeToString(), msg]).stored == 1
        with kv.load(keys) as got:
            assert got.views[0].tobytes() == want


@pytest.mark.parametrize("chunk", [
    bytes([0x12, 0x04, 0x1A, 0x7F, 0x00, 0x00]),  # data runs past its message: undecodable
    bytes([0x12, 0x02, 0x08, 0x05]),  # a chunk of block 5 of 1, and no data
    # review (issue 25 fast path): each refused, none written outside the slot
    chunk_head(0, 0, 1, BLOCK + 1, wrapped=True) + bytes(BLOCK + 1),  # more than the slot
    bytes([0x12, 0x00]),  # an empty chunk
    bytes([0x12, 0x02, 0x1A, 0x00]),  # zero-length data
    chunk_head(0, 1 << 63, 0, 4, wrapped=True) + bytes(4),  # offset 2**63
    chunk_head(0, BLOCK - 2, 0, 4, wrapped=True) + bytes(4),  # starts mid-block, runs past it
    chunk_head((1 << 32) - 1, 0, 0, 4, wrapped=True) + bytes(4),  # block 2**32 - 1
    bytes([0x12]) + bytes([0xFF] * 10) + bytes([0x01]),  # a length varint past 64 bits
    bytes([0x12, 0x03, 0x1B, 0x00, 0x00]),  # field 3 as a group start: undecodable
])
def test_a_bad_chunk_is_refused_and_changes_nothing(wired: DaemonProc, chunk: bytes) -> None:
    keys = chain(4, 1)
    with Client(wired.socket, layout=LAYOUT, streaming=True) as kv:
        before = kv.stats()
        with pytest.raises(grpc.RpcError) as exc:
            _raw_write(wired.socket, [_header(keys).SerializeToString(), chunk])
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert kv.lookup(keys).hit_blocks == 0
        after = kv.stats()
        assert after.active_leases == 0
        assert after.tiers[0].blocks == before.tiers[0].blocks
        assert after.tiers[0].used_bytes == before.tiers[0].used_bytes


def test_a_second_chunk_past_the_block_is_refused(wired: DaemonProc) -> None:
    keys = chain(6, 1)
    first = chunk_head(0, 0, 1, BLOCK - 8, wrapped=True) + bytes(BLOCK - 8)
    past = chunk_head(0, BLOCK - 8, 0, 16, wrapped=True) + bytes(16)  # 8 bytes past the slot
    with Client(wired.socket, layout=LAYOUT, streaming=True) as kv:
        with pytest.raises(grpc.RpcError) as exc:
            _raw_write(wired.socket, [_header(keys).SerializeToString(), first, past])
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert kv.lookup(keys).hit_blocks == 0 and kv.stats().active_leases == 0


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from([
    b"\x08", b"\x10", b"\x1a", b"\x20", b"\x12", b"\x09", b"\x0a", b"\x28", b"\x1b",
    b"\x00", b"\x01", b"\x7f", b"\x80", b"\xff", b"\x04", b"abcd",
]), max_size=24), st.booleans())
def test_whatever_the_hand_reader_takes_protobuf_reads_the_same(parts: list[bytes],
                                                                wrapped: bool) -> None:
    msg = b"".join(parts)
    c = parse_chunk(msg, wrapped)
    if c is None:
        return  # protobuf decodes it (or refuses it)
    theirs = (pb.WriteBlocksRequest.FromString(msg).chunk if wrapped
              else pb.BlockChunk.FromString(msg))  # never refused when the hand reader took it
    assert (c.index, c.offset, bytes(c.data), c.count) == (
        theirs.index, theirs.offset, theirs.data, theirs.count)


def test_a_chunk_before_the_header_is_refused(wired: DaemonProc) -> None:
    data = payloads(1, 5)[0]
    with Client(wired.socket, layout=LAYOUT, streaming=True), pytest.raises(
            grpc.RpcError) as exc:
        _raw_write(wired.socket, [chunk_head(0, 0, 0, BLOCK, wrapped=True) + data])
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "first WriteBlocks message must be a header" in (exc.value.details() or "")


def test_keys_and_blocks_of_the_wrong_size_are_refused_by_the_client(wired: DaemonProc) -> None:
    with Client(wired.socket, layout=LAYOUT, streaming=True) as kv:
        with pytest.raises(ValueError, match="a block has 65535 bytes, the layout 65536"):
            kv.store(chain(6, 1), [bytes(BLOCK - 1)])
        with pytest.raises(ValueError, match="key of 31 bytes; this layout's keys have 32"):
            kv.lookup([bytes(32), bytes(31)])
        assert kv.lookup(chain(6, 1)).hit_blocks == 0


def _varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)
