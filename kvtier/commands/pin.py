"""`kvtier pin`: keep a prompt prefix's cached blocks through pressure for a time."""

from __future__ import annotations

import argparse

HELP = "keep a prompt prefix's cached blocks through pressure for --ttl seconds"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    parser.description = (
        "Pin the cached prefix of a chain of blocks in each layout of the scope for --ttl "
        "seconds: never evicted by pressure until then (or kvtier unpin / evict). A block "
        "pinned again keeps the later deadline. The tenant's pinned blocks may never take "
        "more than its DRAM quota or slice of the pool: such a pin is refused whole. Blocks "
        "stay in the tier they are in (kvtier prefetch brings them into DRAM first).")
    scope.add_target(parser)
    scope.add_namespaces(parser, every=False)
    scope.add_keys(parser, "the prefix (a chain from its first block)")
    parser.add_argument("--ttl", type=float, required=True, metavar="S",
                        help="seconds the pin lasts (at most the daemon's max_pin_ttl_s)")


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope
    from kvtier.core.errors import UsageError

    if not args.ttl > 0:
        raise UsageError(f"--ttl must be a positive number of seconds, got {args.ttl:g}")
    keys = scope.keys_of(args, required=True)
    with scope.connect(args) as ops:
        r = scope.call(ops.pin, keys, args.ttl, **scope.namespaces(args))
    asked = r.asked * r.namespaces
    lines = [f"pinned {r.pinned} of {asked} block(s) for {r.ttl_seconds:g} s in "
             f"{r.namespaces} layout(s) ({r.new_pins} newly pinned"
             f"{f', {asked - r.pinned} not cached' if asked > r.pinned else ''})"]
    return scope.output(args, r, lines)
