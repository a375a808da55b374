"""The client refuses a daemon of another protocol version, and one that does not confirm its
layout id (it would file blocks of every model with this layout together). One gRPC server in
this process plays such a daemon: it answers RegisterLayout with the version and layout id it
is given."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.core.methods import PROTOCOL_VERSION

LAYOUT = LayoutDecl(b"compat-layout-01", 4096, 16, model_id="compat-model")


class OtherDaemon(pb_grpc.KvTierServicer):
    def __init__(self, layout_id: bytes, version: int) -> None:
        self.layout_id = layout_id
        self.version = version
        self.registered: list[pb.RegisterLayoutRequest] = []

    def RegisterLayout(self, request: pb.RegisterLayoutRequest, context: Any
                       ) -> pb.RegisterLayoutResponse:
        self.registered.append(request)
        return pb.RegisterLayoutResponse(tenant="default", layout_id=self.layout_id,
                                         max_blocks_per_request=512,
                                         protocol_version=self.version)

    def OpenSession(self, request: pb.OpenSessionRequest, context: Any
                    ) -> Iterator[pb.SessionEvent]:
        yield pb.SessionEvent(session_id="s" * 32)
        while context.is_active():
            time.sleep(0.05)


def serve(sock: Path, layout_id: bytes, version: int = PROTOCOL_VERSION) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KvTierServicer_to_server(OtherDaemon(layout_id, version), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    return server


@pytest.mark.parametrize("layout_id", [b"", LayoutDecl(b"compat-layout-01", 4096, 16,
                                                       model_id="other-model").layout_id],
                         ids=["no layout id", "another model's id"])
def test_client_refuses_a_daemon_that_does_not_confirm_the_layout_id(
    tmp_path: Path, layout_id: bytes
) -> None:
    server = serve(tmp_path / "old.sock", layout_id)
    try:
        with pytest.raises(KvtierRpcError) as exc:
            Client(tmp_path / "old.sock", layout=LAYOUT, streaming=True, timeout=5.0)
        assert exc.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "compat-model" in str(exc.value)
    finally:
        server.stop(None)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1], ids=["none", "newer"])
def test_client_refuses_a_daemon_of_another_protocol_version(tmp_path: Path,
                                                              version: int) -> None:
    server = serve(tmp_path / "other.sock", LAYOUT.layout_id, version)
    try:
        with pytest.raises(KvtierRpcError) as exc:
            Client(tmp_path / "other.sock", layout=LAYOUT, streaming=True, timeout=5.0)
        assert exc.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert f"the daemon speaks protocol {version}" in str(exc.value)
    finally:
        server.stop(None)


def test_client_accepts_the_confirmed_layout_id(tmp_path: Path) -> None:
    server = serve(tmp_path / "new.sock", LAYOUT.layout_id)
    try:
        with Client(tmp_path / "new.sock", layout=LAYOUT, streaming=True, timeout=5.0) as kv:
            assert kv.tenant == "default"
    finally:
        server.stop(None)
