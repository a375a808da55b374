"""`kvtier evict`: remove a model's, a layout's or a prefix's blocks from every tier."""

from __future__ import annotations

import argparse

HELP = "remove a model's, a layout's or a prompt prefix's blocks from DRAM, SSD and remote"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    parser.description = (
        "Remove blocks from every tier this node holds: DRAM and SSD at once (blocks a lease "
        "holds go when it is released; no lookup finds them meanwhile), then their copies in "
        "the remote store. Without keys: every block of the --model's or --layout's "
        "namespaces. With keys or tokens: the first given block and every block under it.")
    scope.add_target(parser)
    scope.add_namespaces(parser)
    scope.add_keys(parser, "a prefix (its first block and every block under it)")
    parser.add_argument("--from-token", type=int, default=0, metavar="N",
                        help="with --tokens: from the block holding token N on (keep the "
                             "blocks before it, e.g. a shared system prompt)")
    parser.add_argument("--local-only", action="store_true",
                        help="keep the copies in the remote store")


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope
    from kvtier.core.errors import UsageError

    keys = scope.keys_of(args, required=False)
    if args.from_token:
        if not (args.tokens or args.tokens_file) or args.from_token < 0:
            raise UsageError("--from-token N goes with --tokens or --tokens-file (N >= 0)")
        keys = keys[args.from_token // args.block_tokens:]
        if not keys:
            raise UsageError(f"--from-token {args.from_token}: the prompt has no full block "
                             "from there")
    where = scope.namespaces(args)
    if not keys and not (where["model_id"] or where["layout_id"]):
        raise UsageError("name what to evict: --model, --layout, --keys or --tokens (to "
                         "remove every block of a tenant: kvtier clear)")
    with scope.connect(args) as ops:
        reply = scope.call(ops.evict, keys, local_only=args.local_only, **where)
    return scope.output(args, reply, scope.evicted_lines(reply))
