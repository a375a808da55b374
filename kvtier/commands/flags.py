"""Flag conventions shared by every subcommand: old names kept as hidden, deprecated aliases, and
"did you mean" for a flag no subcommand has.

One name per idea across subcommands, config keys and variables (`--dram-bytes` is a size in
bytes wherever it appears, `--preset` names a built-in model, `--ssd-admit-after` the k-th
access rule). A renamed flag keeps working for a release through `alias`: it is not listed in
`--help`, stores into the new flag's destination, and prints one deprecation line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvtier.core.suggest import closest


class _Deprecated(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str,
          dest: str, **kwargs: Any) -> None:
    """`old` as a hidden, deprecated spelling of `new` (which stores into `dest`)."""
    parser.add_argument(old, dest=dest, action=_Deprecated, new=new, **kwargs)


def known_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string of `parser` -> the flag to suggest for it (an alias -> its new name)."""
    out: dict[str, str] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt] = action.new if isinstance(action, _Deprecated) else opt
    return out


def unrecognized(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """The one-line error for arguments `parser` does not take, naming the closest flag."""
    first = extra[0]
    if not first.startswith("-"):
        return f"unrecognized argument {first!r}"
    flags = known_flags(parser)
    word = first.split("=", 1)[0]
    near = closest(word, flags)
    hint = f"; did you mean {flags[near]}?" if near else ""
    return f"unrecognized argument {word}{hint}"
