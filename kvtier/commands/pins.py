"""`kvtier pins`: the pins in scope, per namespace."""

from __future__ import annotations

import argparse

HELP = "list pinned blocks per namespace, with when they expire"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import scope

    scope.add_target(parser)
    scope.add_namespaces(parser)


def run(args: argparse.Namespace) -> int:
    from kvtier.commands import scope
    from kvtier.commands.stats import plain

    with scope.connect(args) as ops:
        got = scope.call(ops.pins, **scope.namespaces(args))
    lines = [f"{'tenant':<12} {'model':<28} {'layout':<16} {'blocks':>8} {'expire in (s)':>16}"]
    for p in got:
        model = p.model_id or "(not registered)"
        lines.append(f"{p.tenant[:12]:<12} {model[:28]:<28} {p.layout.hex()[:16]:<16} "
                     f"{p.blocks:>8} {p.first_expiry_seconds:>7.0f}..{p.last_expiry_seconds:<7.0f}")
    if not got:
        lines = ["no pins"]
    return scope.output(args, {"namespaces": [plain(p) for p in got]}, lines)
