"""`kvtier prefetch`: bring a prompt prefix's blocks into DRAM ahead of a burst."""

from __future__ import annotations

import argparse

HELP = "bring a prompt prefix's SSD and remote blocks into DRAM ahead of its requests"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    parser.description = (
        "Promote the cached prefix of a chain of blocks into DRAM in each layout of the scope: "
        "SSD blocks are read and verified, remote ones fetched, as a load would; nothing stays "
        "held after. Pressure may evict them again: kvtier pin keeps them.")
    scope.add_target(parser)
    scope.add_namespaces(parser, every=False)
    scope.add_keys(parser, "the prefix (a chain from its first block)")


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope

    keys = scope.keys_of(args, required=True)
    with scope.connect(args) as ops:
        r = scope.call(ops.prefetch, keys, **scope.namespaces(args))
    lines = [f"in DRAM now: {r.in_dram + r.from_ssd + r.from_remote} of {r.asked * r.namespaces}"
             f" block(s) in {r.namespaces} layout(s): {r.from_ssd} promoted from SSD, "
             f"{r.from_remote} fetched from the remote store, {r.in_dram} already there, "
             f"{r.missing} not cached"]
    return scope.output(args, r, lines)
