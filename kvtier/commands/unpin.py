"""`kvtier unpin`: end pins before their time."""

from __future__ import annotations

import argparse

HELP = "end pins before their time (given blocks, or every pin in scope)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    scope.add_target(parser)
    scope.add_namespaces(parser)
    scope.add_keys(parser, "those blocks' pins (none given: every pin in scope)")


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope

    keys = scope.keys_of(args, required=False)
    with scope.connect(args) as ops:
        n = scope.call(ops.unpin, keys, **scope.namespaces(args))
    return scope.output(args, {"unpinned": n}, [f"unpinned {n} block(s)"])
