"""Per-group capacity accounting (issue 21 item 4): a layout may declare how its block's bytes
split over the engine's KV cache groups (a hybrid model's full-attention, sliding-window and
state groups); the daemon then reports, per (model, group), the bytes each tier holds, in Stats
and as `kvtier_group_bytes{model, group, tier}`. Real daemon."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import Client, LayoutDecl
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

BLOCK = 65536
GROUPS = (("0:full", 32768), ("1:swa128", 16384), ("2:state", 16384))
HYBRID = LayoutDecl(b"hybrid-layout-fp-01", BLOCK, 16, model_id="org/hybrid@r1", groups=GROUPS)
PLAIN = LayoutDecl(b"plain-layout-fp-001", BLOCK, 16, model_id="org/plain@r1")


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def blocks(n: int) -> list[np.ndarray]:
    return [np.full(BLOCK, i, np.uint8) for i in range(n)]


def test_stats_and_metrics_count_bytes_per_group(daemon: DaemonProc) -> None:  # noqa: F811
    with Client(daemon.socket, layout=HYBRID) as kv, Client(daemon.socket, layout=PLAIN) as pl:
        assert kv.store(keys(3, 1), blocks(3)).stored == 3
        assert pl.store(keys(2, 2), blocks(2)).stored == 2  # no groups declared: not counted
        got = [(g.model_id, g.group, g.dram_bytes) for g in kv.stats().groups]
    # 3 blocks in DRAM: 3 x 32768 for the full group, 3 x 16384 for each of the others
    assert got == [("org/hybrid@r1", "0:full", 98304), ("org/hybrid@r1", "1:swa128", 49152),
                   ("org/hybrid@r1", "2:state", 49152)]
    text = daemon.metrics_text()
    lines = sorted(line for line in text.splitlines()
                   if line.startswith("kvtier_group_bytes{") and 'tier="dram"' in line)
    assert lines == [
        'kvtier_group_bytes{group="0:full",model="org/hybrid@r1",tier="dram"} 98304.0',
        'kvtier_group_bytes{group="1:swa128",model="org/hybrid@r1",tier="dram"} 49152.0',
        'kvtier_group_bytes{group="2:state",model="org/hybrid@r1",tier="dram"} 49152.0',
    ]


@pytest.mark.parametrize(("groups", "message"), [
    ((("a", 32768), ("b", 16384)), "sum to 49152, not the layout's block_bytes 65536"),
    ((("a", 32768), ("a", 32768)), "group names must be unique"),
    ((("", 65536),), "group name must be 1..64 bytes"),
    ((("a", 65536), ("b", 0)), "block_bytes must be positive"),
])
def test_a_bad_group_split_is_refused_and_registers_nothing(
        daemon: DaemonProc, groups: tuple[tuple[str, int], ...], message: str  # noqa: F811
) -> None:
    with grpc.insecure_channel(f"unix://{daemon.socket}") as ch:
        stub = pb_grpc.KvTierStub(ch)  # type: ignore[no-untyped-call]
        req = pb.RegisterLayoutRequest(layout=b"bad-groups-layout-1", block_bytes=BLOCK,
                                       block_tokens=16, key_width=32, model_id="org/bad@r1",
                                       groups=[pb.LayoutGroup(name=n, block_bytes=b)
                                               for n, b in groups])
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterLayout(req)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(err.value.details())
        assert stub.Stats(pb.StatsRequest()).layouts == 0


def test_layout_decl_checks_the_split() -> None:
    with pytest.raises(ValueError, match="sum to 32768, not block_bytes 65536"):
        LayoutDecl(b"x" * 16, BLOCK, 16, model_id="m@1", groups=(("a", 32768),))
