"""`kvtier stats`: pool sizes, usage and counters of a running daemon."""

from __future__ import annotations

import argparse
import json

HELP = "show a running daemon's tiers, leases and counters"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon socket (default $KVTIER_SOCKET, else the runtime dir)")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token (else $KVTIER_TOKEN)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="give up after this many seconds (default 5)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import os

    import grpc
    from google.protobuf import json_format

    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._proto import kvtier_pb2_grpc as pb_grpc
    from kvtier.client.sync_client import default_socket
    from kvtier.core.errors import UsageError
    from kvtier.core.units import format_bytes

    socket = args.socket or str(default_socket())
    token = args.token or os.environ.get("KVTIER_TOKEN")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.KvTierStub(channel)  # type: ignore[no-untyped-call]
        try:
            s: pb.StatsResponse = stub.Stats(pb.StatsRequest(), timeout=args.timeout,
                                             metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise UsageError(f"no daemon answers on {socket} (start one: kvtier serve)"
                                 ) from None
            raise UsageError(f"{exc.code().name}: {exc.details()}") from None
    if args.json:
        print(json.dumps(json_format.MessageToDict(
            s, always_print_fields_with_no_presence=True, preserving_proto_field_name=True),
            indent=2))
        return 0
    print(f"kvtier {s.version} on {socket}, up {s.uptime_seconds:.0f} s, {s.layouts} layout(s)")
    print(f"{'tier':<6}{'capacity':>14}{'used':>14}{'blocks':>10}")
    for t in s.tiers:
        name = pb.Tier.Name(t.tier).removeprefix("TIER_").lower()
        print(f"{name:<6}{format_bytes(t.capacity_bytes):>14}{format_bytes(t.used_bytes):>14}"
              f"{t.blocks:>10}")
    total = s.blocks_hit + s.blocks_missed
    ratio = f"{s.blocks_hit / total:.1%}" if total else "-"
    print(f"lookups {s.lookups}, blocks hit {s.blocks_hit}, missed {s.blocks_missed} "
          f"(block hit ratio {ratio})")
    print(f"active leases {s.active_leases}, write-backs dropped {s.writeback_dropped}, "
          f"checksum failures {s.checksum_failures}")
    if s.mrc:  # the online miss-ratio curve (node totals)
        est = {(p.scaled, p.factor): p.hit_ratio for p in s.mrc}
        parts = [f"{tier} x{f:g} {est[(tier, f)]:.1%}" for tier in ("dram", "ssd")
                 for f in (0.5, 2.0, 8.0) if (tier, f) in est]
        print(f"estimated hit ratio (MRC): now {est.get(('none', 1.0), 0.0):.1%}; "
              + ", ".join(parts))

    def quota(q: int) -> str:
        return format_bytes(q) if q else "unlimited"

    print(f"this tenant: DRAM {format_bytes(s.tenant_dram_bytes)} of "
          f"{quota(s.tenant_dram_quota_bytes)}, SSD {format_bytes(s.tenant_ssd_bytes)} of "
          f"{quota(s.tenant_ssd_quota_bytes)}")
    return 0
