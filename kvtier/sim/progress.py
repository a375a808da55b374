"""A tqdm progress bar on stderr, reduced to a callable `advance(n)`; a no-op when hidden."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _noop(n: int) -> None:
    return None


@contextmanager
def progress_bar(
    total: int, desc: str, show: bool, unit: str = "req"
) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`; with `show` False (not a TTY, --quiet) draw and import nothing."""
    if not show:
        yield _noop
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False) as bar:
        yield bar.update
