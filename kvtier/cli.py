"""The `kvtier` console script: a thin dispatcher over subcommand modules.

Each subcommand lives in `kvtier/commands/<name>.py` and exposes

    HELP: str                                    # one line for `kvtier --help`
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int     # exit code

Modules are imported lazily, so `kvtier size` never imports gRPC, LMDB or torch. A `UsageError`
escaping `run` is printed as `kvtier <cmd>: error: <message>` and exits 2 (never a traceback);
a flag the subcommand does not have is one such line naming the closest one it has
(`kvtier.commands.flags`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvtier._version import __version__
from kvtier.core.errors import UsageError

# name -> module; a module that does not exist yet is simply not offered.
COMMANDS: dict[str, str] = {
    "serve": "kvtier.commands.serve",
    "size": "kvtier.commands.size",
    "simulate": "kvtier.commands.simulate",
    "calibrate": "kvtier.commands.calibrate",
    "stats": "kvtier.commands.stats",
    "demo": "kvtier.commands.demo",
    "top": "kvtier.commands.top",
    "evict": "kvtier.commands.evict",
    "clear": "kvtier.commands.clear",
    "pin": "kvtier.commands.pin",
    "unpin": "kvtier.commands.unpin",
    "pins": "kvtier.commands.pins",
    "prefetch": "kvtier.commands.prefetch",
    "pd-proxy": "kvtier.commands.pd_proxy",
}


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as exc:
        if exc.name == COMMANDS[name]:
            return None
        raise


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (a typo like `--ssd-byte` must not pass for `--ssd-bytes`), and a
    one-line error with exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="Multi-tier KV cache service for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        if only is not None and name != only:
            # Keep `kvtier --help` complete, but import only the module being run.
            continue
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args, extra = parser.parse_known_args(args_list)
    if extra:
        from kvtier.commands.flags import unrecognized

        sub: argparse.ArgumentParser = getattr(args, "_parser", parser)
        sub.error(unrecognized(sub, extra))
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        code: int = run(args)
    except UsageError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kvtier ... | head`: the reader left; silence the flush at exit as well.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
