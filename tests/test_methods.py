"""The method table (`kvtier.core.methods`) against the proto, and what is built from it: the
daemon's handlers, the guard's limits, the local socket's dispatcher and the client's call map;
and the one protocol version, refused by a real daemon when a client states another."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.decl import register_request
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.methods import BY_NAME, LOCAL, METHODS, PROTOCOL_VERSION, Local, Size
from kvtier.daemon.rpc.guard import SMALL_BYTES, Limits
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401

SERVICE = pb.DESCRIPTOR.services_by_name["KvTier"]
LAYOUT = LayoutDecl(b"methods-layout-01", 4096, 16, model_id="methods-model")


def test_the_table_names_every_method_of_the_proto_once_with_its_messages() -> None:
    assert [m.name for m in METHODS] == [m.name for m in SERVICE.methods]
    for m in METHODS:
        shape = SERVICE.methods_by_name[m.name]
        assert shape.input_type.name == m.request, m.name
        assert shape.output_type.name == m.response, m.name
        fields = {f.name for f in shape.input_type.fields}
        want = (Size.CHUNK if shape.client_streaming else Size.TWO_CHAINS
                if {"added", "removed"} <= fields else Size.KEYS if "keys" in fields
                else Size.SMALL)
        assert m.size is want, m.name
        if m.local is Local.CALL:  # one request frame, one reply frame
            assert not shape.client_streaming and not shape.server_streaming, m.name
        elif m.local is Local.BULK_READ:
            assert shape.server_streaming and not shape.client_streaming, m.name
        elif m.local is Local.BULK_WRITE:
            assert shape.client_streaming and not shape.server_streaming, m.name
        if shape.client_streaming or shape.server_streaming:
            assert m.waits, m.name  # a stream waits by nature


def test_the_local_socket_numbers_its_methods_from_zero() -> None:
    assert [m.number for m in LOCAL] == list(range(len(LOCAL)))
    assert all(m.number == -1 for m in METHODS if m.local is None)
    # the wire numbers clients and daemons of this protocol agree on
    assert {m.name: m.number for m in LOCAL} == {
        "Lookup": 0, "Acquire": 1, "Release": 2, "Allocate": 3, "Commit": 4, "Abort": 5,
        "WriteBlocks": 6, "ReadBlocks": 7}


def test_the_guards_limits_come_from_the_table() -> None:
    limits = Limits.for_daemon(512, 32, 4 << 20)
    chain = 512 * 32 + SMALL_BYTES
    assert set(limits.per_method) == {m.name for m in METHODS}
    for m in METHODS:
        want = {Size.SMALL: SMALL_BYTES, Size.KEYS: chain, Size.TWO_CHAINS: 2 * chain,
                Size.CHUNK: (4 << 20) + SMALL_BYTES}[m.size]
        assert limits.of(m.name) == want, m.name
    assert limits.local(BY_NAME["WriteBlocks"]) == chain  # its header on the local socket


def test_every_unary_method_has_a_handler_that_waits_as_the_table_says() -> None:
    from kvtier.daemon.metrics import DaemonMetrics
    from kvtier.daemon.rpc.service import Service

    class _Cache:
        metrics = DaemonMetrics()

    service = Service(_Cache(), None)  # type: ignore[arg-type]
    unary = {m.name for m in METHODS
             if not (SERVICE.methods_by_name[m.name].client_streaming
                     or SERVICE.methods_by_name[m.name].server_streaming)}
    assert set(service.handlers) == unary

    class _Wrong(Service):
        def release(self, request: pb.ReleaseRequest, call: object) -> pb.ReleaseResponse:
            raise AssertionError

        async def stats(self, request: pb.StatsRequest, call: object  # type: ignore[override]
                        ) -> pb.StatsResponse:
            raise AssertionError

    with pytest.raises(AssertionError, match="Stats's handler must not wait"):
        _Wrong(_Cache(), None)  # type: ignore[arg-type]


def test_the_clients_call_map_is_the_tables(daemon: DaemonProc) -> None:  # noqa: F811
    with Client(daemon.socket, layout=LAYOUT) as kv:
        mapped = {getattr(kv._stub, m.name): m for m in METHODS}
        assert {mapped[stub].name: number for stub, (number, _) in kv._local_calls.items()} == {
            m.name: m.number for m in LOCAL if m.local is Local.CALL and m.name != "Lookup"}
        assert all(reply is getattr(pb, mapped[stub].response)
                   for stub, (_, reply) in kv._local_calls.items())


def test_a_daemon_refuses_a_client_of_another_protocol_version(
        daemon: DaemonProc, tmp_path: Path) -> None:  # noqa: F811
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = pb_grpc.KvTierStub(channel)  # type: ignore[no-untyped-call]
        req = register_request(LAYOUT)
        assert req.protocol_version == PROTOCOL_VERSION
        reply = stub.RegisterLayout(req, timeout=10)
        assert reply.protocol_version == PROTOCOL_VERSION
        req.protocol_version = 0  # not stated (a hand-made call): accepted
        assert stub.RegisterLayout(req, timeout=10).layout_id == LAYOUT.layout_id
        req.protocol_version = PROTOCOL_VERSION + 1
        with pytest.raises(grpc.RpcError) as exc:
            stub.RegisterLayout(req, timeout=10)
        assert exc.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"the client speaks protocol {PROTOCOL_VERSION + 1}" in (exc.value.details() or "")
