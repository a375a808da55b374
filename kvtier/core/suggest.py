"""The closest known name to a mistyped one, for "did you mean ...?" in CLI and config errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, names: Iterable[str]) -> str | None:
    """The name `word` most likely meant: the shortest name it begins (`--dram` ->
    `--dram-bytes`), else the nearest by `difflib` (ratio >= 0.6), else None."""
    known = sorted(set(names), key=lambda n: (len(n), n))
    if word in known:
        return word
    longer = [n for n in known if n.startswith(word) and len(word) >= 3]
    if longer:
        return longer[0]
    near = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return near[0] if near else None
