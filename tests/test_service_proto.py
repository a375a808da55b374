"""The committed generated code in kvtier/_proto/ must match protos/kvtier/v1/kvtier.proto."""

from __future__ import annotations

import subprocess
from pathlib import Path

from google.protobuf import descriptor_pb2

from kvtier._proto import kvtier_pb2, kvtier_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _fresh_descriptor(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    rc = protoc.main(
        ["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={out}", "kvtier/v1/kvtier.proto"]
    )
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = fds.file
    for msg in fd.message_type:  # the embedded descriptor omits derived json names
        _strip_json_names(msg)
    return fd


def _strip_json_names(msg: descriptor_pb2.DescriptorProto) -> None:
    for field in msg.field:
        field.ClearField("json_name")
    for nested in msg.nested_type:
        _strip_json_names(nested)


def test_committed_descriptor_matches_proto_source(tmp_path: Path) -> None:
    committed = descriptor_pb2.FileDescriptorProto.FromString(kvtier_pb2.DESCRIPTOR.serialized_pb)
    fresh = _fresh_descriptor(tmp_path)
    assert committed == fresh, "kvtier/_proto is stale: run scripts/gen_proto.sh"


def test_gen_script_reproduces_committed_files(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True)
    for name in ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "kvtier" / "_proto" / name).read_text()
        assert fresh == committed, f"kvtier/_proto/{name} is stale: run scripts/gen_proto.sh"


def test_service_has_every_rpc_of_the_protocol() -> None:
    methods = {m.name for m in kvtier_pb2.DESCRIPTOR.services_by_name["KvTier"].methods}
    assert methods == {
        "RegisterLayout", "Lookup", "Acquire", "Release", "RenewLease", "Allocate", "Commit",
        "Abort", "ReadBlocks", "WriteBlocks", "ReportHbm", "ReportPrefill", "Stats",
        "WatchEvents", "OpenSession", "Evict", "Pin", "Unpin", "ListPins", "Prefetch",
        "ReportVerification",
    }
    assert hasattr(kvtier_pb2_grpc, "KvTierServicer")
