"""Giving memory back to the OS after a burst of large requests (glibc).

A request of a few MiB is allocated by gRPC and Python as one large block. glibc serves such a
block with mmap at first, but after the first free it raises its mmap threshold to that size (up
to 32 MiB) and from then on serves blocks that large from the heap, where freed memory is kept for
reuse: a burst of near-limit requests left the daemon's RSS ten times its size at start, idle.
`trim` (`malloc_trim`, which also returns free pages inside the heap, not only at its top) gives it
back; the daemon's reaper calls it every `TRIM_EVERY_S`. Fixing the mmap threshold instead would
keep the heap small too, but it made every 4 MiB streaming chunk an mmap + munmap with fresh page
faults and halved the streaming byte path's throughput (`bench.daemon`), so the heap keeps its
blocks between bursts and gives them back when idle.

A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

TRIM_EVERY_S = 5.0


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def trim() -> None:
    """Returns free heap memory to the OS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
