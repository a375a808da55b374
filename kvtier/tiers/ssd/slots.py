"""Payload slots for the SSD store: one preallocated file of fixed-size slots, read with preadv.

`kvtier.tiers.ssd.store` keeps the index (keys, headers, which slot holds which block) in LMDB;
this module owns only the payload file and its free set. Slot `i` starts at `i * stride`, `stride`
being the slot size rounded up to 4 KiB (page-aligned I/O, no read-modify-write of shared pages).

The file is `nslots * stride` bytes, allocated with `posix_fallocate` at open, so a full disk is
a one-line error at open and never an ENOSPC or SIGBUS in the middle of a write-back.

Slot life cycle (the crash protocol lives in `SsdStore`; this is the part it relies on):

    free ──allocate()──▶ reserved ──(payload written + synced, LMDB commit)──▶ referenced
      ▲                     │ write or commit failed: release()                 │ delete committed:
      │                     ▼                                                   ▼ retire()
      └─────────────────── free ◀──── no reader that may still see it ──── quarantined

A slot is *referenced* when a committed LMDB entry names it. `allocate` only hands out slots that
no committed entry references and no reader can be reading, so a payload is written only where a
crash cannot expose it: before the commit nothing points at the slot, and at restart the free set
is rebuilt from the index alone (`mark_used`), without reading payloads.

Readers and reuse: every read runs inside `reading()`, which registers the reader under the
current epoch. `retire` quarantines slots under the current epoch and advances it; a quarantined
slot returns to the free set only once every reader registered at or before that epoch has left.
A reader registered later began after the delete committed, so its LMDB snapshot cannot name the
slot. Hence a slot is never rewritten while a reader may still be copying it out.

Threading: `allocate`, `release`, `retire`, `write` and `sync` belong to the store's single writer;
`reading` and `read_into` may run on any number of threads; the free set is guarded by a lock.
The writer waits (bounded) in `allocate` only when the slots it needs are still quarantined.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence

from kvtier.core.errors import UsageError

PAGE = 4096
_IOV_MAX = 1024


def stride_of(slot_size: int) -> int:
    return (slot_size + PAGE - 1) // PAGE * PAGE


class SlotFile:
    """`nslots` payload slots of `slot_size` bytes in the file at `path` (created 0600)."""

    def __init__(self, path: str, slot_size: int, nslots: int) -> None:
        if slot_size <= 0 or nslots <= 0:
            raise UsageError(f"SSD slot file needs a positive slot size and count at {path}")
        self.path = path
        self.slot_size = slot_size
        self.stride = stride_of(slot_size)
        self.nslots = nslots
        size = self.stride * nslots
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            found = os.fstat(self._fd).st_size
            self.found_slots = found // self.stride  # before a shrink cut the file down
            if found > size:
                os.ftruncate(self._fd, size)
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            os.close(self._fd)
            raise UsageError(
                f"cannot reserve {size} bytes for SSD payload slots at {path}: {exc.strerror} "
                "(lower the SSD capacity or free disk space)"
            ) from None
        self._state = bytearray(nslots)  # 0 free, 1 reserved/referenced/quarantined
        self._free = nslots
        self._cursor = 0
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when a reader leaves
        self._epoch = 0
        self._readers: dict[int, int] = {}
        self._quarantine: list[tuple[int, list[int]]] = []

    # -- free set (writer) -------------------------------------------------------------------

    def mark_used(self, slot: int) -> bool:
        """At open: `slot` is referenced by a committed entry. False if out of range or taken."""
        if not 0 <= slot < self.nslots or self._state[slot]:
            return False
        self._state[slot] = 1
        self._free -= 1
        return True

    def free_count(self) -> int:
        with self._lock:
            self._recycle_locked()
            return self._free

    def allocate(self, n: int, wait_s: float = 1.0) -> list[int]:
        """Reserve up to `n` free slots, adjacent when possible (one run for a whole batch).

        When quarantined slots would make up the difference, waits up to `wait_s` for the
        readers that hold them back (reads are short: one batch of preadv).
        """
        with self._ready:
            self._recycle_locked()
            if self._free < n and self._quarantine:
                self._ready.wait_for(self._drained(n), timeout=wait_s)
            n = min(n, self._free)
            if n <= 0:
                return []
            state = self._state
            run = bytes(n)
            start = state.find(run, self._cursor)
            if start < 0:
                start = state.find(run)
            if start >= 0:
                slots = list(range(start, start + n))
            else:
                slots, pos = [], self._cursor
                while len(slots) < n:
                    pos = state.find(b"\0", pos)
                    if pos < 0:
                        pos = state.find(b"\0")
                    slots.append(pos)
                    state[pos] = 1
            for s in slots:
                state[s] = 1
            self._free -= n
            self._cursor = (slots[-1] + 1) % self.nslots
            return slots

    def release(self, slots: Sequence[int]) -> None:
        """Return reserved slots that no committed entry references (a failed write or commit)."""
        with self._lock:
            for s in slots:
                self._state[s] = 0
            self._free += len(slots)

    def retire(self, slots: Sequence[int]) -> None:
        """Slots whose entries were deleted (committed): free once no earlier reader remains."""
        if not slots:
            return
        with self._lock:
            self._quarantine.append((self._epoch, list(slots)))
            self._epoch += 1
            self._recycle_locked()

    def quarantined(self) -> int:
        with self._lock:
            return sum(len(s) for _, s in self._quarantine)

    def _drained(self, n: int) -> Callable[[], bool]:
        def ready() -> bool:
            self._recycle_locked()
            return self._free >= n or not self._quarantine

        return ready

    def _recycle_locked(self) -> None:
        if not self._quarantine:
            return
        oldest = min(self._readers, default=self._epoch + 1)
        keep: list[tuple[int, list[int]]] = []
        for epoch, slots in self._quarantine:
            if epoch < oldest:
                for s in slots:
                    self._state[s] = 0
                self._free += len(slots)
            else:
                keep.append((epoch, slots))
        self._quarantine = keep

    # -- I/O ---------------------------------------------------------------------------------

    def write(self, slots: Sequence[int], payloads: Sequence[memoryview]) -> None:
        """pwritev each payload into its slot; adjacent full slots go out as one large write."""
        pairs = sorted(zip(slots, payloads, strict=True), key=lambda p: p[0])
        for off, bufs in self._runs(pairs):
            _pwritev_all(self._fd, bufs, off)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Register a reader: slots it may see are not reused until it leaves."""
        with self._lock:
            epoch = self._epoch
            self._readers[epoch] = self._readers.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._readers[epoch] - 1
                if left:
                    self._readers[epoch] = left
                else:
                    del self._readers[epoch]
                    if self._quarantine:
                        self._ready.notify_all()

    def read_into(
        self, reads: Sequence[tuple[int, memoryview]], done: Callable[[int], None] | None = None
    ) -> None:
        """pread slot payloads into the given buffers in file order (call inside `reading()`).

        One call per slot, in ascending order, so a run of adjacent slots is a sequential read
        that the kernel's read-ahead pipelines (measured on dev-2c: steadier than one preadv per
        run); `done(i)` runs as soon as `reads[i]` is in its buffer (e.g. to checksum it while
        read-ahead fetches the next). A batch of several runs tells the kernel about all of them
        first (POSIX_FADV_WILLNEED), so scattered reads overlap on the device. Raises OSError on
        an I/O error or a file shorter than expected.
        """
        order = sorted(range(len(reads)), key=lambda i: reads[i][0])
        runs = list(self._runs([reads[i] for i in order]))
        if len(runs) > 1:
            for off, bufs in runs:
                os.posix_fadvise(self._fd, off, sum(b.nbytes for b in bufs),
                                 os.POSIX_FADV_WILLNEED)
        for i in order:
            slot, buf = reads[i]
            _preadv_all(self._fd, [buf], slot * self.stride)
            if done is not None:
                done(i)

    def _runs(
        self, pairs: Sequence[tuple[int, memoryview]]
    ) -> Iterator[tuple[int, list[memoryview]]]:
        """Group (slot, buffer) pairs sorted by slot into contiguous file ranges."""
        start = -1
        end = 0
        bufs: list[memoryview] = []
        for slot, buf in pairs:
            off = slot * self.stride
            if bufs and off == end and len(bufs) < _IOV_MAX:
                bufs.append(buf)
            else:
                if bufs:
                    yield start, bufs
                start, bufs = off, [buf]
            end = off + buf.nbytes
        if bufs:
            yield start, bufs

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pwritev_all(fd: int, bufs: list[memoryview], off: int) -> None:
    while bufs:
        n = os.pwritev(fd, bufs, off)
        off += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


def _preadv_all(fd: int, bufs: list[memoryview], off: int) -> None:
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = os.preadv(fd, bufs, off)
        if n == 0:
            raise OSError(f"short read at offset {off} of the SSD slot file")
        off += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]
