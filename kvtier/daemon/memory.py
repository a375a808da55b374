"""Giving memory back to the OS after a burst of large requests (glibc malloc tuning).

A request of a few MiB is allocated by gRPC and Python as one large block. glibc serves such a
block with mmap, but after the first free it raises its mmap threshold to that size (up to 32 MiB)
and from then on serves blocks that large from the heap, where freed memory is kept for reuse:
a burst of near-limit requests left the daemon's RSS ten times its size at start, idle. Fixing the
threshold (`M_MMAP_THRESHOLD`, which also turns the adjustment off) keeps every block above it in
its own mapping, unmapped at free; `trim` returns free heap pages (`malloc_trim`) — the daemon's
reaper calls it every `TRIM_EVERY_S`.

Both are no-ops where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own default before it starts adjusting
TRIM_EVERY_S = 5.0


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def limit_retained_memory() -> bool:
    """Fixes glibc's mmap threshold (see the module docstring); False where unsupported."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim() -> None:
    """Returns free heap memory to the OS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
