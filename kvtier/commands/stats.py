"""`kvtier stats`: pool sizes, usage and counters of a running daemon."""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "show a running daemon's tiers, leases and counters"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import target

    target.add_arguments(parser)
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="give up after this many seconds (default 5)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def tier_name(value: int) -> str:
    """A tier as the table and the metrics name it: dram, ssd, hbm."""
    from kvtier._proto import kvtier_pb2 as pb

    return pb.Tier.Name(value).removeprefix("TIER_").lower()


def plain(message: Any) -> dict[str, Any]:
    """A reply as plain JSON values: numbers as numbers (protobuf's JSON mapping writes 64-bit
    integers as strings), tiers by the table's names, bytes as hex; every field, set or not."""
    from google.protobuf.descriptor import FieldDescriptor as F

    def value(field: Any, v: Any) -> Any:
        if field.type == F.TYPE_MESSAGE:
            return plain(v)
        if field.type == F.TYPE_ENUM:
            if field.enum_type.name == "Tier":
                return tier_name(v)
            return field.enum_type.values_by_number[v].name
        if field.type == F.TYPE_BYTES:
            return bytes(v).hex()
        return v

    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        v = getattr(message, field.name)
        if field.is_repeated:
            out[field.name] = [value(field, x) for x in v]
        else:
            out[field.name] = value(field, v)
    return out


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._proto import kvtier_pb2_grpc as pb_grpc
    from kvtier.commands import target
    from kvtier.core.errors import UsageError

    where = target.from_args(args)
    target.probe(where)
    with target.channel(where) as channel:
        stub = pb_grpc.KvTierStub(channel)  # type: ignore[no-untyped-call]
        try:
            s: pb.StatsResponse = stub.Stats(pb.StatsRequest(), timeout=args.timeout,
                                             metadata=target.token(args))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                from kvtier.client.sync_client import no_daemon

                why = f" ({exc.details()})" if where.tcp else ""
                raise UsageError(no_daemon(where.where).details + why) from None
            raise UsageError(f"{exc.code().name}: {exc.details()}") from None
    if args.json:
        print(json.dumps(plain(s), indent=2))
        return 0
    for line in report(s, where.where):
        print(line)
    return 0


def report(s: Any, where: str) -> list[str]:
    """The table `kvtier stats` prints, in lines of at most 80 columns (the first, with the
    daemon's address, may be longer)."""
    import textwrap

    from kvtier.core.units import format_bytes
    from kvtier.index.mrc import ERROR, MIN_SAMPLES

    out = [f"kvtier {s.version} on {where}, up {s.uptime_seconds:.0f} s, {s.layouts} "
           f"layout(s)", f"{'tier':<6}{'capacity':>14}{'used':>14}{'blocks':>10}"]
    for t in s.tiers:
        out.append(f"{tier_name(t.tier):<6}{format_bytes(t.capacity_bytes):>14}"
                   f"{format_bytes(t.used_bytes):>14}{t.blocks:>10}")
    total = s.blocks_hit + s.blocks_missed
    ratio = f"{s.blocks_hit / total:.1%}" if total else "-"
    text = [f"lookups {s.lookups}, blocks hit {s.blocks_hit}, missed {s.blocks_missed} "
            f"(block hit ratio {ratio})",
            f"active leases {s.active_leases}, write-backs dropped {s.writeback_dropped}, "
            f"checksum failures {s.checksum_failures}",
            f"verification: {s.verify_verified_blocks} blocks verified, "
            f"{s.verify_mismatched_blocks} mismatched, {s.verify_quarantined_blocks} "
            f"quarantined"]
    if s.node_wide and s.mrc_sampled_blocks < MIN_SAMPLES:
        text.append(f"estimated hit ratio (MRC): not enough lookups yet "
                    f"({s.mrc_sampled_blocks} of {MIN_SAMPLES} sampled blocks)")
    elif s.mrc:  # the online miss-ratio curve (node totals)
        est = {(p.scaled, p.factor): p.hit_ratio for p in s.mrc}
        parts = [f"{tier} x{f:g} {est[(tier, f)]:.1%}" for tier in ("dram", "ssd")
                 for f in (0.5, 2.0, 8.0) if (tier, f) in est]
        now = est.get(("none", 1.0))
        head = f"now {now:.1%} (+-{ERROR * 100:g} pts)" if now is not None else "now -"
        text.append(f"estimated hit ratio (MRC): {head}; " + ", ".join(parts))

    def quota(q: int) -> str:
        return format_bytes(q) if q else "unlimited"

    text.append(f"this tenant: DRAM {format_bytes(s.tenant_dram_bytes)} of "
                f"{quota(s.tenant_dram_quota_bytes)}, SSD {format_bytes(s.tenant_ssd_bytes)} "
                f"of {quota(s.tenant_ssd_quota_bytes)}")
    for line in text:
        out += textwrap.wrap(line, 80, subsequent_indent="  ", break_on_hyphens=False)
    return out
