"""`kvtier clear`: remove every block of a tenant (or of every tenant) from every tier."""

from __future__ import annotations

import argparse

HELP = "remove every block of this tenant (--tenant: another's; --all-tenants: all) everywhere"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    parser.description = (
        "Remove every block of the token's tenant (--tenant NAME: another tenant's, "
        "--all-tenants: every block of the node; both need an admin token) from DRAM and SSD, "
        "and their copies in the remote store (every key of each namespace this node holds, "
        "whichever node wrote it).")
    scope.add_target(parser)
    parser.add_argument("--tenant", metavar="NAME", default="",
                        help="another tenant's blocks (admin token)")
    parser.add_argument("--all-tenants", action="store_true",
                        help="every tenant's blocks (admin token)")
    parser.add_argument("--local-only", action="store_true",
                        help="keep the copies in the remote store")


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope
    from kvtier.core.errors import UsageError

    if args.tenant and args.all_tenants:
        raise UsageError("give --tenant or --all-tenants, not both")
    with scope.connect(args) as ops:
        reply = scope.call(ops.clear, tenant=args.tenant, all_tenants=args.all_tenants,
                           local_only=args.local_only)
    return scope.output(args, reply, scope.evicted_lines(reply))
