"""Malformed and hostile requests against a real daemon with two tenants: each gets its status
code, changes nothing, and the daemon keeps serving. Plus tenant isolation end to end."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.types import Tier
from tests.daemon_fixture import DaemonProc

BLOCK = 65536
FP = b"hostile-layout-01"
MODEL = "hostile/model-a"
LAYOUT = LayoutDecl(FP, BLOCK, 16, model_id=MODEL)
LID = LAYOUT.layout_id  # what data requests name: H(model id, fingerprint)
ALICE = (("authorization", "Bearer alice-secret-token"),)
BOB = (("authorization", "Bearer bob-secret-token-2"),)
Code = grpc.StatusCode


def key(tag: int, i: int) -> bytes:
    return bytes([tag]) + i.to_bytes(2, "little") + bytes(29)


def keys(tag: int, n: int) -> bytes:
    return b"".join(key(tag, i) for i in range(n))


class Env:
    def __init__(self, d: DaemonProc) -> None:
        self.d = d
        self.channel = grpc.insecure_channel(f"unix:{d.socket}")
        self.stub = pb_grpc.KvTierStub(self.channel)  # type: ignore[no-untyped-call]
        reg = pb.RegisterLayoutRequest(layout=FP, block_bytes=BLOCK, block_tokens=16, key_width=32,
                                       model_id=MODEL)
        assert self.stub.RegisterLayout(reg, metadata=ALICE).layout_id == LID
        assert self.stub.RegisterLayout(reg, metadata=BOB).layout_id == LID  # layouts: per tenant
        self.bob_store(keys(9, 1))
        self.bob_read = self.stub.Acquire(
            pb.AcquireRequest(layout=LID, keys=keys(9, 1), key_width=32), metadata=BOB).lease_id
        self.bob_write = self.stub.Allocate(
            pb.AllocateRequest(layout=LID, keys=keys(8, 1), key_width=32), metadata=BOB).lease_id
        self.alice_store(keys(7, 1))
        self.alice_read = self.stub.Acquire(
            pb.AcquireRequest(layout=LID, keys=keys(7, 1), key_width=32), metadata=ALICE).lease_id
        self.alice_write = self.stub.Allocate(
            pb.AllocateRequest(layout=LID, keys=keys(6, 1), key_width=32), metadata=ALICE).lease_id

    def bob_store(self, k: bytes) -> None:
        a = self.stub.Allocate(pb.AllocateRequest(layout=LID, keys=k, key_width=32), metadata=BOB)
        self.stub.Commit(pb.CommitRequest(lease_id=a.lease_id), metadata=BOB)

    def alice_store(self, k: bytes) -> None:
        a = self.stub.Allocate(pb.AllocateRequest(layout=LID, keys=k, key_width=32),
                               metadata=ALICE)
        self.stub.Commit(pb.CommitRequest(lease_id=a.lease_id), metadata=ALICE)

    def snapshot(self) -> tuple[Any, ...]:
        a = self.stub.Stats(pb.StatsRequest(), metadata=ALICE)
        b = self.stub.Stats(pb.StatsRequest(), metadata=BOB)
        return (a.tenant_dram_bytes, b.tenant_dram_bytes, a.active_leases,
                a.tiers[0].used_bytes, a.tiers[0].blocks, a.layouts)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("hostile")
    tokens = work / "tokens.toml"
    tokens.write_text(
        '[tenants.alice]\ntoken = "alice-secret-token"\ndram_quota = "512KiB"\n\n'
        '[tenants.bob]\ntoken = "bob-secret-token-2"\n'
    )
    d = DaemonProc(work / "d", ["--tokens-file", str(tokens), "--max-blocks-per-request",
                                "512", "--max-lease-ttl-s", "60"]).start()
    e = Env(d)
    try:
        yield e
    finally:
        e.channel.close()
        d.stop()


def _chunks(*items: pb.WriteBlocksRequest) -> Iterator[pb.WriteBlocksRequest]:
    yield from items


def _header(k: bytes) -> pb.WriteBlocksRequest:
    return pb.WriteBlocksRequest(header=pb.WriteHeader(layout=LID, keys=k, key_width=32))


def _chunk(index: int, offset: int, data: bytes) -> pb.WriteBlocksRequest:
    return pb.WriteBlocksRequest(chunk=pb.BlockChunk(index=index, offset=offset, data=data))


Case = tuple[str, Callable[[Env], Any], Code]
CASES: list[Case] = [
    ("no token", lambda e: e.stub.Lookup(pb.LookupRequest(layout=LID)), Code.UNAUTHENTICATED),
    ("wrong token", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=LID), metadata=(("authorization", "Bearer nope-nope-nope"),)),
     Code.UNAUTHENTICATED),
    ("not a bearer token", lambda e: e.stub.Stats(
        pb.StatsRequest(), metadata=(("authorization", "Basic YWxpY2U="),)),
     Code.UNAUTHENTICATED),
    ("unknown layout", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=b"never-registered", keys=keys(1, 1), key_width=32),
        metadata=ALICE), Code.NOT_FOUND),
    ("fingerprint too short", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"abc", block_bytes=BLOCK, block_tokens=16, key_width=32, model_id=MODEL),
        metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("key width 20", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"layout-width-20", block_bytes=BLOCK, block_tokens=16, key_width=20,
        model_id=MODEL),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("zero block bytes", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"layout-zero-bytes", block_bytes=0, block_tokens=16, key_width=32,
        model_id=MODEL),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("block larger than a slot", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"layout-too-large", block_bytes=BLOCK + 1, block_tokens=16, key_width=32,
        model_id=MODEL),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("layout re-registered with another shape", lambda e: e.stub.RegisterLayout(
        pb.RegisterLayoutRequest(layout=FP, block_bytes=4096, block_tokens=16, key_width=32,
                                 model_id=MODEL),
        metadata=ALICE), Code.FAILED_PRECONDITION),
    ("layout without a model id", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"layout-no-model", block_bytes=4096, block_tokens=16, key_width=32),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("model id longer than 256 bytes", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=FP, block_bytes=BLOCK, block_tokens=16, key_width=32, model_id="m" * 257),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("model id of 129 two-byte characters", lambda e: e.stub.RegisterLayout(
        pb.RegisterLayoutRequest(layout=FP, block_bytes=BLOCK, block_tokens=16, key_width=32,
                                 model_id="é" * 129), metadata=ALICE), Code.INVALID_ARGUMENT),
    ("model id with a control character", lambda e: e.stub.RegisterLayout(
        pb.RegisterLayoutRequest(layout=FP, block_bytes=BLOCK, block_tokens=16, key_width=32,
                                 model_id="model\x00a"), metadata=ALICE), Code.INVALID_ARGUMENT),
    ("data request naming the bare fingerprint", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=FP, keys=keys(7, 1), key_width=32), metadata=ALICE),
     Code.NOT_FOUND),
    ("negative model parameters", lambda e: e.stub.RegisterLayout(pb.RegisterLayoutRequest(
        layout=b"layout-bad-model", block_bytes=4096, block_tokens=16, key_width=32,
        model_id=MODEL,
        model=pb.ModelCost(active_params=-1, num_layers=2, attn_dim=8)), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("keys not a multiple of the width", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=LID, keys=bytes(33), key_width=32), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("key width differs from the layout", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=LID, keys=bytes(32), key_width=16), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("too many keys", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=LID, keys=bytes(32 * 513), key_width=32), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("duplicate keys in a chain", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=key(1, 0) * 2, key_width=32), metadata=ALICE), Code.INVALID_ARGUMENT),
    ("parent not cached", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=keys(1, 1), key_width=32, parent_key=key(2, 0)), metadata=ALICE),
     Code.FAILED_PRECONDITION),
    ("parent of the wrong width", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=keys(1, 1), key_width=32, parent_key=b"short"), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("lease TTL beyond the maximum", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=keys(1, 1), key_width=32, lease_ttl_ms=3_600_000), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("beyond the tenant's DRAM quota", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=keys(3, 9), key_width=32), metadata=ALICE), Code.RESOURCE_EXHAUSTED),
    ("beyond the DRAM pool", lambda e: e.stub.Allocate(pb.AllocateRequest(
        layout=LID, keys=keys(4, 300), key_width=32), metadata=BOB), Code.RESOURCE_EXHAUSTED),
    ("commit of an unknown lease", lambda e: e.stub.Commit(
        pb.CommitRequest(lease_id="0" * 32), metadata=ALICE), Code.NOT_FOUND),
    ("commit without a lease id", lambda e: e.stub.Commit(
        pb.CommitRequest(), metadata=ALICE), Code.INVALID_ARGUMENT),
    ("commit of a read lease", lambda e: e.stub.Commit(
        pb.CommitRequest(lease_id=e.alice_read), metadata=ALICE), Code.FAILED_PRECONDITION),
    ("release of a write lease", lambda e: e.stub.Release(
        pb.ReleaseRequest(lease_id=e.alice_write), metadata=ALICE), Code.FAILED_PRECONDITION),
    ("release of another tenant's lease", lambda e: e.stub.Release(
        pb.ReleaseRequest(lease_id=e.bob_read), metadata=ALICE), Code.PERMISSION_DENIED),
    ("abort of another tenant's allocation", lambda e: e.stub.Abort(
        pb.AbortRequest(lease_id=e.bob_write), metadata=ALICE), Code.PERMISSION_DENIED),
    ("commit of another tenant's allocation", lambda e: e.stub.Commit(
        pb.CommitRequest(lease_id=e.bob_write), metadata=ALICE), Code.PERMISSION_DENIED),
    ("renew of another tenant's lease", lambda e: e.stub.RenewLease(
        pb.RenewLeaseRequest(lease_id=e.bob_read), metadata=ALICE), Code.PERMISSION_DENIED),
    ("release reporting NaN seconds", lambda e: e.stub.Release(
        pb.ReleaseRequest(lease_id=e.alice_read, seconds=math.nan), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("release reporting more bytes than the lease holds", lambda e: e.stub.Release(
        pb.ReleaseRequest(lease_id=e.alice_read, bytes=BLOCK + 1), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("commit reporting more bytes than were allocated", lambda e: e.stub.Commit(
        pb.CommitRequest(lease_id=e.alice_write, bytes=10 * BLOCK), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("prefill report of zero tokens", lambda e: e.stub.ReportPrefill(
        pb.ReportPrefillRequest(layout=LID, tokens=0, seconds=1.0), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("write stream without a header", lambda e: e.stub.WriteBlocks(
        _chunks(_chunk(0, 0, b"x")), metadata=ALICE), Code.INVALID_ARGUMENT),
    ("write stream with a short block", lambda e: e.stub.WriteBlocks(
        _chunks(_header(keys(5, 1)), _chunk(0, 0, bytes(100))), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("write stream overrunning a block", lambda e: e.stub.WriteBlocks(
        _chunks(_header(keys(5, 1)), _chunk(0, 0, bytes(BLOCK)), _chunk(1, 0, b"x")),
        metadata=ALICE), Code.INVALID_ARGUMENT),
    ("write stream out of order", lambda e: e.stub.WriteBlocks(
        _chunks(_header(keys(5, 2)), _chunk(1, 0, bytes(BLOCK))), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("read stream of an unknown layout", lambda e: list(e.stub.ReadBlocks(
        pb.ReadBlocksRequest(layout=b"never-registered", keys=keys(1, 1), key_width=32),
        metadata=ALICE)), Code.NOT_FOUND),
    ("HBM report without a replica name", lambda e: e.stub.ReportHbm(
        pb.ReportHbmRequest(layout=LID, key_width=32, added=keys(7, 1)), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("HBM report with a huge replica name", lambda e: e.stub.ReportHbm(
        pb.ReportHbmRequest(layout=LID, replica="r" * 129, key_width=32), metadata=ALICE),
     Code.INVALID_ARGUMENT),
    ("message above the size limit", lambda e: e.stub.Lookup(
        pb.LookupRequest(layout=LID, keys=bytes(9 << 20), key_width=32), metadata=ALICE),
     Code.RESOURCE_EXHAUSTED),
]


@pytest.mark.parametrize("name,call,code", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_refused_and_changes_nothing(
    env: Env, name: str, call: Callable[[Env], Any], code: Code
) -> None:
    before = env.snapshot()
    with pytest.raises(grpc.RpcError) as exc:
        call(env)
    assert exc.value.code() is code, exc.value.details()
    assert exc.value.details(), "every refusal carries a message"
    assert env.snapshot() == before
    assert env.d.healthy()


def test_table_has_at_least_twenty_cases() -> None:
    assert len(CASES) >= 20


def test_tenants_are_isolated(env: Env) -> None:
    sock: Path = env.d.socket
    k = [key(100, i) for i in range(3)]
    a_data = [bytes([1]) * BLOCK for _ in k]
    b_data = [bytes([2]) * BLOCK for _ in k]
    with Client(sock, layout=LAYOUT, token="alice-secret-token") as alice, \
            Client(sock, layout=LAYOUT, token="bob-secret-token-2") as bob:
        assert (alice.tenant, bob.tenant) == ("alice", "bob")
        assert alice.store(k, a_data).stored == 3
        assert bob.lookup(k).hit_blocks == 0  # cannot see alice's blocks
        with bob.load(k) as got:
            assert got.blocks == 0  # nor read them
        assert bob.store(k, b_data).stored == 3  # same key bytes: bob's own blocks
        with alice.load(k) as got:
            assert [bytes(v) for v in got.views] == a_data  # never overwritten
        with bob.load(k) as got:
            assert [bytes(v) for v in got.views] == b_data
        assert bob.report_hbm("r1", added=k) == 3  # bob's own copies of the same key bytes
        assert Tier.HBM not in alice.lookup(k, replica="r1").tiers  # his replicas are his
        assert alice.stats().tenant_dram_quota_bytes == 512 * 1024
        assert bob.stats().tenant_dram_quota_bytes == 0


def test_events_are_per_tenant(env: Env) -> None:
    env.alice_store(keys(120, 2))
    env.bob_store(keys(121, 2))
    seen: dict[str, set[bytes]] = {}
    for who, md in (("alice", ALICE), ("bob", BOB)):
        stream = env.stub.WatchEvents(pb.WatchEventsRequest(since_sequence=1), metadata=md,
                                      timeout=1.5)
        got: set[bytes] = set()
        with pytest.raises(grpc.RpcError) as exc:
            for ev in stream:
                got.update(ev.stored.block_hashes if ev.HasField("stored") else ())
        assert exc.value.code() is Code.DEADLINE_EXCEEDED  # the stream stays open until then
        seen[who] = got
    assert key(120, 0) in seen["alice"] and key(120, 0) not in seen["bob"]
    assert key(121, 0) in seen["bob"] and key(121, 0) not in seen["alice"]
