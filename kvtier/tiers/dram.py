"""DRAM tier: block slots of size classes on pages of a POSIX shared-memory segment (the daemon's
side; clients map it with `kvtier.client.mapping.DramClient`). Which bytes a slot id names, and
how classes take and give back pages: `kvtier.tiers.dram_pages`.

The daemon creates the segment (`DramPool.create`) as a file under /dev/shm opened with
O_CREAT|O_EXCL and mode 0600 (or 0660 with a configured group), sizes it with ftruncate and maps
it. Local clients map the same file (`DramClient.attach`) by name, size and generation and read
or write slots in place: block bytes never pass through a socket. `multiprocessing.shared_memory`
is not used: its resource tracker can unlink a segment when an attaching process exits.

Segment layout and header: `kvtier.core.segment` (the contract clients check at attach).

Trust boundary: whoever can open the file can read and write every slot. Only the daemon's user
(mode 0600), or members of the configured group (0660), may map it. That is the single-tenant
pool (no tokens file). With tenants (`DramSpec.isolated`) there is no file: each tenant has a
region of its own, an anonymous file laid out as a pool (header, its slice of the pages) with its
own page table (`kvtier.tiers.dram_regions`); a tenant's client maps only its own, handed over
after its token is checked, and holds none of another tenant's bytes. Slot ids stay global (a
region's pages stand for pages of the pool's page space); offsets and `SegmentHandle`s of an
isolated pool are those of the slot's region (`tenant_handle`). Remote clients use the daemon's
Read/WriteBlocks byte stream.

Keeping (`spec.keep`, `kvtier.tiers.dram_keep`): a keep record follows each slot's meaning, and
`close(keep=True)` leaves the memory to a successor, which re-adopts it (same generation; its
blocks in `adopted`, for the index) or says why not in `cold` and starts empty.

Lease rule (invariant 3): a pinned slot is never freed nor rewritten through the pool: `free` and
`write` refuse it (`SlotPinned`). Pins have one owner. A pool on its own (tools, tests, the
mover's tests) keeps them itself (`pin`/`unpin`). The daemon's pool has an owner (`PinOwner`:
the prefix index): a slot is pinned while the block in it is pinned in the index (a lease, a
queued write-back or remote write, a page move's source), and the pool asks it; the pool's own
pins are then only page moves' targets, which hold no block yet.

Threading: `DramPool` metadata operations take an internal lock and may be called from any
thread. Slot bytes are not locked: the pin rule is what keeps readers and writers apart. The
pool's lock is innermost: callers may hold their own locks (the daemon's cache lock, a write
queue's) when they call in, and nothing here takes another lock under it. Moving blocks to free
a page or a row runs in three steps so the copy holds no lock: `plan_evacuation` / `plan_row`
(pool lock: targets claimed, both ends pinned — the source by the owner when there is one),
`copy_moves` (no lock, any thread), `end_move` per pair (pool lock: unpin, free the old slot or
give the target back). `evacuate` and `clear_row` run the three on the caller's thread (tests,
tools). The owner (`PinOwner`) is asked under the pool's lock and takes no lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import grp
import logging
import math
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from kvtier.core.errors import UsageError
from kvtier.core.segment import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    STATE,
    STATE_CLOSED,
    STATE_OFFSET,
    VERSION,
    DramError,
    SegmentHandle,
    SegmentHeader,
    mark_closed,
    pack_header,
    round_up,
    slot_stride,
    unpack_header,
)
from kvtier.tiers.dram_keep import (
    NAME,
    Geometry,
    Keeper,
    KeepFile,
    Kept,
    KeptBlock,
    Refused,
    keep_path,
)
from kvtier.tiers.dram_pages import UNIT, ClassStats, PageTable, geometric
from kvtier.tiers.dram_regions import (
    Region,
    RegionSpec,
    TenantRegions,
    TenantShare,
    release_fd,
    reslice,
)

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20

U8Array = npt.NDArray[np.uint8]


class SlotPinned(DramError):
    """The slot is leased (pinned); it cannot be freed or rewritten now."""


MAX_BLOCK_BYTES = 8 << 20
"""The largest block a daemon's pool serves by default (`max_block_bytes`)."""

PAGE_SCALE = 256 << 10
"""Auto page size: sqrt(data bytes x this) (`DramSpec.geometry`). A class loses up to about a
page to free slots it holds under churn (`kvtier.tiers.dram_pages`), and a stride that does not
divide the page loses up to one slot at each end of a run of adjacent pages of its class: pages
~ sqrt(pool x a typical block) balance the two (8 MiB for 256 MiB, 16 MiB for 1 GiB, 32 MiB for
4 GiB; measured by `bench.dram_rounding`); smaller pools get pages of a quarter of the largest
block, which spans adjacent pages of its class."""


@dataclass(frozen=True)
class DramSpec:
    """How the daemon creates its pool: `slot_count` slots of the smallest size `slot_size`
    (the data area is `slot_count * round_up(slot_size, 4 KiB)` bytes), carved into pages that
    size classes up to `max_block` bytes take on demand (`kvtier.tiers.dram_pages`).
    `max_block` 0: `slot_size` (one class, every slot alike); `page_bytes` 0: automatic."""

    name: str
    slot_size: int
    slot_count: int
    group: str | None = None
    prefault: bool = False  # allocate every page at creation (charged to this process's cgroup)
    mlock: bool = False
    huge_pages: bool = False
    replace_stale: bool = False
    shm_dir: str = "/dev/shm"
    max_block: int = 0
    page_bytes: int = 0
    isolated: bool = False  # tenants: no named file, a region per tenant (`dram_regions`)
    tenants: int = 0  # isolated: automatic pages small enough for 4 pages a tenant, if they can
    keep: bool = False  # a keep file says what the pool holds, for a successor (`dram_keep`)

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise UsageError(f"invalid shared-memory name {self.name!r}")
        if self.slot_size <= 0 or self.slot_count <= 0:
            raise UsageError("DRAM pool needs slot_size > 0 and slot_count > 0")
        if self.max_block < 0 or self.page_bytes < 0:
            raise UsageError("DRAM pool needs max_block >= 0 and page_bytes >= 0")

    def geometry(self) -> tuple[int, int]:
        """(page_bytes, page_count): pages of `page_bytes`, else sqrt(data x `PAGE_SCALE`);
        when that is below the largest block (a pool under 256 MiB with 8 MiB blocks), a
        quarter of the largest block (2 MiB: its rows span 4 pages, `kvtier.tiers.dram_pages`;
        measured best of 2, 4 and 8 MiB at 64 and 128 MiB by `bench.dram_rounding`); at least
        one smallest slot. The data area is split evenly (4 KiB multiples), so at most
        `page_count` * 4 KiB is lost to it."""
        stride = slot_stride(self.slot_size)
        data = stride * self.slot_count
        want = self.page_bytes or math.isqrt(data * PAGE_SCALE)
        big = min(max(self.max_block, self.slot_size), data)
        if not self.page_bytes and want < big:
            want = big // 4 // 4096 * 4096  # a row of the largest block spans 4 pages
        if not self.page_bytes and self.isolated and self.tenants:
            want = min(want, data // (4 * self.tenants) // 4096 * 4096)  # slices of 4+ pages
        count = max(1, data // max(want, stride))
        size = data // count // 4096 * 4096
        return max(size, stride), count


class PinOwner(Protocol):
    """Who holds the pins of the blocks in the pool's slots, when not the pool itself: the
    daemon's prefix index (`PrefixIndex.slot_pinned`), whose block pins are the only ones."""

    def slot_pinned(self, slot: int) -> bool: ...

    def any_pinned(self, slots: list[int]) -> bool:
        """Whether any of `slots` holds a pinned block (`slot_pinned` of each, at C speed)."""

    @property
    def pinned_slots(self) -> int: ...


class SlotMove(NamedTuple):
    """A planned move of one block's bytes between two slots of its class (`plan_evacuation`,
    `plan_row`): slot ids and their segment offsets, fixed when planned."""

    old: int
    new: int
    src: int
    dst: int
    nbytes: int


class DramStats(NamedTuple):
    slot_size: int  # the smallest slot
    slot_count: int  # slots of the smallest size the data area holds
    slots_used: int  # allocated slots, every class
    slots_free: int  # free slots of the smallest class: free pages and its own free slots
    slots_pinned: int
    bytes_reserved: int  # the data area (pages): the pool's block capacity
    bytes_used: int  # allocated slots * their class stride
    bytes_free: int  # bytes_reserved - bytes_used (free pages, free slots, page heads/tails)
    segment_bytes: int  # the mapped file, header and alignment padding included
    mlocked: bool
    huge_pages: bool
    page_bytes: int = 0
    page_count: int = 0
    pages_free: int = 0
    classes: tuple[ClassStats, ...] = ()


def _thp_shmem_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "unknown"


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _address(buf: U8Array) -> int:
    return int(buf.ctypes.data)


class SegmentMapping:
    """An mmap of the segment plus one numpy view of it; slot views are slices of that view."""

    def __init__(self, fd: int, size: int, writable: bool = True) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self.buf: U8Array = np.frombuffer(self.mm, dtype=np.uint8)
        if not writable:
            self.buf.flags.writeable = False
        self.size = size

    def close(self) -> None:
        del self.buf
        try:
            self.mm.close()
        except BufferError:
            log.debug("DRAM segment still viewed by callers; unmapped when their views go")


def peek_header(path: str) -> SegmentHeader | None:
    """The header of the segment file at `path` without mapping it; None when the file is
    missing, unreadable or not a kvtier pool (no magic)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = os.pread(fd, HEADER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < HEADER.size:
        return None
    header = unpack_header(raw)
    return header if header.magic == MAGIC else None


def _close_kept(path: str) -> None:
    """Marks the kvtier pool at `path` closed (one a successor will not adopt)."""
    if peek_header(path) is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.pwrite(fd, STATE.pack(STATE_CLOSED), STATE_OFFSET)
        finally:
            os.close(fd)


def _unlink_forgotten(path: str, generation: int, creator: int) -> None:
    """Unlinks a pool nobody closed (garbage-collected, or open at interpreter exit), in the
    process that created it only (a forked child must not unlink its parent's pool)."""
    header = peek_header(path)
    if os.getpid() == creator and header is not None and header.generation == generation:
        log.warning("shared-memory segment %s was never closed; unlinking it", path)
        os.unlink(path)


class DramPool:
    """The daemon's side: owns the segment, allocates slots, tracks pins, unlinks on close.

    A pool that is garbage-collected, or still open when the interpreter exits, unlinks its file
    as well; only a killed process leaves its segment behind (`kvtier.tiers.segment_owner` reclaims
    those at the next daemon start).
    """

    def __init__(self, spec: DramSpec, keeper: Keeper | None = None) -> None:
        """A fresh pool, or with `spec.keep` and a `keeper` that finds one, the pool a dead
        daemon kept (`adopted`; `cold` says why one was not)."""
        spec.validate()
        self.spec = spec
        self.slot_size = spec.slot_size
        self.slot_stride = slot_stride(spec.slot_size)
        self.slot_count = spec.slot_count
        self.page_bytes, self.page_count = spec.geometry()
        self.pages = PageTable(self.page_bytes, self.page_count, self.slot_stride)
        self.data_bytes = self.page_bytes * self.page_count
        self.max_block = min(max(spec.max_block, spec.slot_size), self.data_bytes)
        self.data_offset = HUGE_PAGE if spec.huge_pages else HEADER_BYTES
        size = self.data_offset + self.data_bytes
        self.size = round_up(size, HUGE_PAGE) if spec.huge_pages else size
        self.generation = secrets.randbits(63) | 1
        self.isolated = spec.isolated
        self.path = (f"memfd:{spec.name}" if spec.isolated
                     else os.path.join(spec.shm_dir, spec.name))
        self._lock = threading.Lock()
        self._pins: dict[int, int] = {}  # its own pins: all of them without an owner
        self.owner: PinOwner | None = None  # the pins' owner (`PinOwner`), when not itself
        self._closed = False
        self.mlocked = False
        self.huge_pages = False
        self._regions: TenantRegions | None = None
        self._shares: dict[str, tuple[TenantShare, int]] = {}  # tenant -> (share, its pages)
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._map: SegmentMapping | None = None
        self.keep: KeepFile | None = None  # with `spec.keep` (`kvtier.tiers.dram_keep`)
        self.adopted: Kept | None = None  # a kept pool's blocks and held slots, taken over
        self.cold = ""  # why a kept pool was not adopted ("": adopted, or there was none)
        self.adopt_s = 0.0  # the seconds adopting a kept pool took here
        started = time.monotonic()
        keeper = keeper or Keeper()
        if spec.isolated:  # no memory of its own: the tenants' regions hold it all
            self._fd = -1
            self._regions = TenantRegions(RegionSpec(
                self.page_bytes, self.slot_stride, self.slot_size, self.data_offset,
                HUGE_PAGE if spec.huge_pages else mmap.PAGESIZE, spec.prefault, spec.mlock,
                spec.huge_pages), self.page_count)
            self.huge_pages, self.mlocked = spec.huge_pages, spec.mlock
            if spec.keep:
                self._keep_regions(keeper)
                self.adopt_s = time.monotonic() - started
            return
        self._fd = -1
        if spec.keep and keeper.adopt:
            try:
                self._adopt_named()
                self.adopt_s = time.monotonic() - started
            except Refused as why:
                self.cold = f"{self.path}: {why}"
                _close_kept(self.path)  # a client still mapping it sees it closed
                for gone in (self.path, keep_path(self.path)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(gone)
        if self._fd < 0:
            self._fd = self._create_file()
            try:
                os.ftruncate(self._fd, self.size)
                if spec.prefault:
                    self._allocate()
                self._map = SegmentMapping(self._fd, self.size)
                if spec.keep:
                    self.keep = KeepFile.create(self._geometry(), keep_path(self.path))
            except BaseException:
                if self._map is not None:
                    self._map.close()
                os.close(self._fd)
                os.unlink(self.path)
                raise
            pack_header(self._map.mm, SegmentHeader.live(self.handle()))
        self._finalizer = weakref.finalize(
            self, _unlink_forgotten, self.path, self.generation, os.getpid())
        if spec.huge_pages:
            self.huge_pages = self._advise_huge()
        if spec.mlock:
            self.mlocked = self._mlock()

    def _allocate(self) -> None:
        """Every page of the segment now (tmpfs fallocate): a full /dev/shm fails here, not as
        SIGBUS at a later write, and the pages are charged to the daemon's memory cgroup rather
        than to the first client that writes them."""
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as exc:
            raise UsageError(f"cannot allocate the DRAM pool ({self.size} bytes) in "
                             f"{self.spec.shm_dir}: {exc.strerror or exc}") from None

    @classmethod
    def create(cls, spec: DramSpec, keeper: Keeper | None = None) -> DramPool:
        return cls(spec, keeper)

    # -- keeping and adopting (`kvtier.tiers.dram_keep`) ------------------------------------

    def _geometry(self, generation: int | None = None) -> Geometry:
        return Geometry(int(self.isolated), self.generation if generation is None else generation,
                        self.pages.slot_ids, self.page_count, self.page_bytes, self.slot_size,
                        self.slot_stride, self.data_offset, 0 if self.isolated else self.size)

    def _adopt_named(self) -> None:
        """Maps the named pool a dead daemon kept, with its keep file; `Refused` (nothing
        changed, nothing left open) when it is of another format or shape."""
        path = self.path
        header = peek_header(path)
        if header is None:
            raise Refused("no kvtier pool there")
        if header.version != VERSION:
            raise Refused(f"DRAM pool format version {header.version}; this kvtier reads "
                          f"version {VERSION}")
        theirs = (header.slot_size, header.slot_stride, header.data_offset, header.page_bytes,
                  header.page_count)
        mine = (self.slot_size, self.slot_stride, self.data_offset, self.page_bytes,
                self.page_count)
        if theirs != mine:
            raise Refused(f"the kept pool has slot size, stride, data offset, page size and "
                          f"count {theirs}, this daemon's {mine}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != self.size:
                raise Refused(f"the kept pool has {os.fstat(fd).st_size} bytes, this daemon's "
                              f"{self.size}")
            try:
                kfd = os.open(keep_path(path), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise Refused("it has no keep file (kept by a daemon without keep_dram?)"
                              ) from None
            keep, kept = KeepFile.read(kfd, self._geometry(), keep_path(path))
            if kept.geometry.generation != header.generation:
                keep.close(unlink=False)
                raise Refused("its keep file is of another generation")
            self._map = SegmentMapping(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.keep, self.generation = fd, keep, header.generation
        try:
            if self.spec.group:
                os.fchown(fd, -1, grp.getgrnam(self.spec.group).gr_gid)
            os.fchmod(fd, 0o660 if self.spec.group else 0o600)
        except (KeyError, OSError) as exc:
            log.warning("cannot give the kept pool %s to group %r: %s", path, self.spec.group,
                        exc)
        pack_header(self._map.mm, SegmentHeader.live(self.handle()))  # live again, if marked
        self.adopted = self._adopt_slots(self.pages, kept, lambda s: s)
        keep.clear_others(self._adopted_slots())  # no record survives that was not adopted

    def _adopt_slots(self, pages: PageTable, kept: Kept, local: Callable[[int], int | None],
                     tag: int = 0) -> Kept:
        """Takes a kept pool's blocks and still-held write slots into `pages` (global slot ->
        `local` slot id in it, None: not this table's); what is left out is returned as not
        adopted. The caller clears the records of every slot not adopted."""
        now = time.monotonic()
        want: dict[int, int] = {}
        for b in kept.blocks:
            s = local(b.slot)
            if s is not None and self._fits(b.nbytes, b.stride):
                want[s] = b.stride + tag
        writing = [(s, st, t, until) for s, st, t, until in kept.writing
                   if until > now and (ls := local(s)) is not None and ls not in want]
        for s, st, _, _ in writing:
            want[cast(int, local(s))] = st + tag
        bad = set(pages.adopt(want))
        return Kept(kept.geometry,
                    [b for b in kept.blocks if (s := local(b.slot)) in want and s not in bad],
                    [w for w in writing if local(w[0]) not in bad], [])

    def _fits(self, nbytes: int, stride: int) -> bool:
        """Whether blocks of `nbytes` go to class `stride` in this pool."""
        try:
            return self._stride_of_size(nbytes) == stride
        except DramError:
            return False

    def _keep_regions(self, keeper: Keeper) -> None:
        """A pool with tenants and `spec.keep`: adopts the regions the holder gave back when
        the keep file it gave back describes them, else starts with none; a new keep memfd
        otherwise. Every memfd from now on is offered to the holder."""
        assert self._regions is not None
        regions, fds = self._regions, dict(keeper.fds)
        if keeper.holder is None:  # nothing would keep the memfds: no keep file to write
            for fd in fds.values():
                release_fd(fd)
            return
        regions.holder, regions.keys = keeper.holder, dict(keeper.keys)
        kfd = fds.pop(NAME, None)
        if kfd is not None:
            try:
                keep, kept = KeepFile.read(kfd, self._geometry(0))
            except Refused as why:
                self.cold = f"the tenants' DRAM: {why}"
            else:
                self.keep, self.generation = keep, kept.geometry.generation
                adopted, notes = regions.adopt(kept, fds)
                if notes:
                    self.cold = "; ".join(notes)
                blocks: list[KeptBlock] = []
                writing: list[tuple[int, int, str, float]] = []
                for r in adopted:
                    assert r.pages is not None
                    got = self._adopt_slots(r.pages, kept, functools.partial(
                        regions.local_of, r), r.tag)
                    blocks += [b for b in got.blocks if b.tenant == r.tenant]
                    writing += [w for w in got.writing if w[2] == r.tenant]
                    for b in got.blocks:  # another tenant's record: never adopted
                        if b.tenant != r.tenant:
                            r.pages.free(cast(int, regions.local_of(r, b.slot)))
                    for w in got.writing:
                        if w[2] != r.tenant:
                            r.pages.free(cast(int, regions.local_of(r, w[0])))
                self.adopted = Kept(kept.geometry, blocks, writing, [])
        for name, fd in fds.items():  # not (or no longer) ours to keep
            release_fd(fd)
            if keeper.holder is not None:
                keeper.holder.forget(name)
        if self.keep is None:
            self.keep = KeepFile.create(self._geometry())
        self.keep.clear_others(self._adopted_slots())
        self.keep.set_generation(self.generation)
        regions.keep = self.keep
        regions.record_all()
        if keeper.holder is not None:
            keeper.holder.keep(NAME, self.keep.fd)

    def _adopted_slots(self) -> set[int]:
        kept = self.adopted
        if kept is None:
            return set()
        return {b.slot for b in kept.blocks} | {w[0] for w in kept.writing}

    def set_tenant_keys(self, keys: dict[str, bytes]) -> None:
        """Each tenant's token fingerprint now (`dram_keep.token_key`): a region made from now on
        is written down with it, and a successor adopts it only under the same token."""
        if self._regions is not None:
            with self._lock:
                self._regions.keys = dict(keys)

    def record(self, slot: int, tenant: str, layout_id: bytes, key: bytes,
               parent: bytes | None, nbytes: int) -> None:
        """`slot` holds a block now (its DRAM copy was added): its keep record (no-op without
        a keep file)."""
        keep = self.keep
        if keep is None:
            return
        with self._lock:
            pages, local, _ = self._slot(slot)
            keep.commit(slot, pages.stride_of(local), nbytes, tenant, layout_id, key, parent)

    def writing(self, slots: list[int], tenant: str, until: float) -> None:
        """`slots` are filled under `tenant`'s WRITE lease until `until` (keep record)."""
        keep = self.keep
        if keep is None or not slots:
            return
        with self._lock:
            pages, local, _ = self._slot(slots[0])
            keep.writing(slots, pages.stride_of(local), tenant, until)

    def hold(self, slots: list[int], until: float) -> None:
        """A READ lease holds the blocks in `slots` until `until` (keep record)."""
        if self.keep is not None:
            with self._lock:
                self.keep.hold(slots, until)

    def unhold(self, slots: list[int]) -> None:
        """No lease holds the blocks in `slots` any more (keep record)."""
        if self.keep is not None:
            with self._lock:
                self.keep.unhold(slots)

    def freeze_keep(self) -> None:
        """The daemon stops: the keep records stay as they are now (`KeepFile.freeze`)."""
        if self.keep is not None:
            with self._lock:
                self.keep.freeze()

    def kept_blocks(self) -> int:
        """COMMITTED keep records now (what a successor would find)."""
        keep = self.keep
        return 0 if keep is None else keep.committed()

    def _create_file(self) -> int:
        mode = 0o660 if self.spec.group else 0o600
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, mode)
        except FileExistsError:
            if not self.spec.replace_stale:
                raise UsageError(
                    f"shared-memory segment {self.path} exists (another daemon, or a stale one: "
                    "remove it or allow replacing it)"
                ) from None
            log.warning("replacing stale shared-memory segment %s", self.path)
            os.unlink(self.path)
            fd = os.open(self.path, flags, mode)
        try:
            if self.spec.group:
                os.fchown(fd, -1, grp.getgrnam(self.spec.group).gr_gid)
            os.fchmod(fd, mode)  # the umask may have narrowed the mode given to open
        except (KeyError, OSError) as exc:
            os.close(fd)
            os.unlink(self.path)
            msg = f"cannot give {self.path} to group {self.spec.group!r}: {exc}"
            raise UsageError(msg) from None
        return fd

    def _advise_huge(self) -> bool:
        try:
            assert self._map is not None
            self._map.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:
            log.warning("huge pages unavailable for %s (%s); using 4 KiB pages", self.path, exc)
            return False
        mode = _thp_shmem_mode()
        if mode in ("never", "deny") and not self.spec.shm_dir.startswith("/dev/hugepages"):
            log.warning(
                "transparent huge pages for shared memory are %r on this host; using 4 KiB pages "
                "(set /sys/kernel/mm/transparent_hugepage/shmem_enabled to advise, or use a "
                "hugetlbfs shm_dir)", mode,
            )
            return False
        return True

    def _mlock(self) -> bool:
        libc = _libc()
        if libc.mlock(ctypes.c_void_p(_address(self._buf())), ctypes.c_size_t(self.size)) != 0:
            err = ctypes.get_errno()
            log.warning(
                "mlock of %d bytes failed (%s); the DRAM pool may swap (raise RLIMIT_MEMLOCK)",
                self.size, errno.errorcode.get(err, err),
            )
            return False
        return True

    # -- allocation and the lease rule ------------------------------------------------------

    def handle(self) -> SegmentHandle:
        return SegmentHandle(
            self.spec.name, self.size, self.generation, self.slot_size, self.slot_stride,
            self.slot_count, self.data_offset, self.spec.shm_dir, self.page_bytes,
            self.page_count,
        )

    @property
    def slot_ids(self) -> int:
        """Slot ids are below this (for tables indexed by slot id)."""
        return self.pages.slot_ids

    def _buf(self) -> U8Array:
        assert self._map is not None, "an isolated pool's bytes are its regions'"
        return self._map.buf

    def _table(self, cls: int) -> tuple[PageTable | None, Region | None]:
        """The page table class `cls` allocates from (None: the region waits for its pages),
        and its region in an isolated pool."""
        if self._regions is None:
            return self.pages, None
        r = self._regions.of_class(cls)
        return r.pages, r

    def _slot(self, slot: int) -> tuple[PageTable, int, Region | None]:
        """(page table, slot id in it, region) of global slot id `slot`; DramError when out of
        range (in an isolated pool: in no region)."""
        if self._regions is None:
            if not 0 <= slot < self.pages.slot_ids:
                raise DramError(f"slot {slot} out of range 0..{self.pages.slot_ids - 1}")
            return self.pages, slot, None
        r, local = self._regions.locate(slot)
        assert r.pages is not None  # a region holds slot ids once all its pages are granted
        return r.pages, local, r

    def _global(self, r: Region | None, local: int) -> int:
        return local if r is None or self._regions is None else self._regions.to_global(r, local)

    def stride_for(self, nbytes: int) -> int:
        """The slot stride a block of `nbytes` bytes gets; raises DramError above `max_block`.
        `nbytes` is a size, never a class id (a size may equal another tenant's class id:
        stride 65,536 + tag 1 is also a 65,537-byte block); a class's stride: `class_stride`."""
        return self._stride_of_size(nbytes)

    def class_stride(self, cls: int) -> int:
        """The slot stride of class `cls` (a tenant's class from `class_bytes`, or a size)."""
        return geometric(self._class_of(cls))

    def _stride_of_size(self, nbytes: int) -> int:
        if not 0 < nbytes <= self.max_block:
            raise DramError(f"a {nbytes}-byte block is outside 1..{self.max_block} B")
        return self.pages.stride_for(nbytes)

    def class_of(self, nbytes: int) -> int:
        """The class blocks of `nbytes` go to (its id in `DramStats.classes`): their stride,
        or a tenant's class from `class_bytes` itself."""
        return self._class_of(nbytes)

    def _class_of(self, nbytes: int) -> int:
        """The class blocks of `nbytes` go to: a tenant's class (`class_bytes`) is itself."""
        if self._regions is not None and nbytes % UNIT and self._regions.is_class(nbytes):
            return nbytes
        return self._stride_of_size(nbytes)

    def class_bytes(self, nbytes: int, tenant: str) -> int:
        """What to ask the pool for `tenant`'s blocks of `nbytes` (`alloc_many`, `room`,
        `can_alloc`, `stride_for`...): `nbytes` itself in a shared pool; in an isolated one the
        id of the class of their stride in the tenant's region now (the stride plus the
        region's tag, below 256: `kvtier.tiers.dram_regions`)."""
        if self._regions is None:
            return nbytes
        stride = self._stride_of_size(nbytes)  # a size: never read as another's class id
        with self._lock:
            return stride + self._regions.region(tenant).tag

    def slice_pages(self, shares: list[TenantShare], where: object = "tokens file"
                    ) -> dict[str, int]:
        """The tenants' pages `set_tenants` would give (`dram_regions.reslice` over the shares
        set so far); UsageError when they do not fit. Changes nothing."""
        with self._lock:
            before = dict(self._shares)
        return reslice(shares, self.page_bytes, self.page_count, before, where)

    def set_tenants(self, shares: list[TenantShare], where: object = "tokens file") -> list[str]:
        """The tenants' slices of an isolated pool from now on (`slice_pages`; UsageError when
        they do not fit, nothing changed). Returns the tenants whose region now has another
        size: the caller retires them (`retire_tenant`)."""
        if self._regions is None:
            return []
        slices = self.slice_pages(shares, where)
        with self._lock:
            self._shares = {t.name: (t, slices[t.name]) for t in shares}
            return self._regions.set_slices(slices)

    def slices(self) -> dict[str, int]:
        """Tenant -> the bytes of its slice (isolated pools; {} for a shared one)."""
        if self._regions is None:
            return {}
        with self._lock:
            return {t: p * self.page_bytes for t, p in self._regions.slices().items()}

    def tenant_fd(self, tenant: str) -> int:
        """The anonymous file of `tenant`'s region now (isolated pools only; the pool's own fd,
        valid while the region lives: to hand it out, `tenant_file`). DramError for a shared
        pool."""
        if self._regions is None:
            raise DramError("a shared pool has no per-tenant memory")
        with self._lock:
            return self._regions.region(tenant).fd

    def tenant_file(self, tenant: str) -> tuple[int, int, int]:
        """(a duplicate of `tenant_fd` the caller owns and closes, the generation in its header,
        its size): what the fd socket hands out. Duplicated under the pool's lock, so a region
        released meanwhile (its fd closed, the number reused) can never be sent instead.
        DramError while the region waits for the pages a retired one of the tenant still holds
        (a client touching the whole file then would hold memory beyond the pool's): its
        clients use the streaming path and fetch it again later."""
        if self._regions is None:
            raise DramError("a shared pool has no per-tenant memory")
        with self._lock:
            r = self._regions.region(tenant)
            if r.pages is None:
                raise DramError(
                    f"tenant {tenant!r}'s DRAM is not ready: its memory from before its token "
                    "or slice changed still holds blocks in use (leased, or being written "
                    "to SSD or the remote tier); fetch it again later")
            return os.dup(r.fd), r.generation, r.size

    def tenant_handle(self, tenant: str) -> SegmentHandle:
        """The pool as `tenant`'s client maps it: `handle()`, or in an isolated pool its region
        now (its own file's size, geometry and generation: a fresh region after
        `retire_tenant` has another, so a client that mapped the old one fetches the new)."""
        if self._regions is None:
            return self.handle()
        with self._lock:
            return self._regions.region(tenant).handle()

    def retire_tenant(self, tenant: str) -> bool:
        """A reload changed or revoked `tenant`'s token, or its slice (isolated pools): from now
        on its blocks go to a fresh region, and the slots of the one so far are `slot_stale`
        (their blocks must leave the pool; the region is released when its last slot is
        freed). False when the tenant had no region."""
        if self._regions is None:
            return False
        with self._lock:
            return self._regions.retire(tenant)

    def slot_stale(self, slot: int) -> bool:
        """Whether allocated `slot` is of a retired region (`retire_tenant`): its block is no
        longer served from the pool."""
        if self._regions is None:
            return False
        with self._lock:
            return self._slot(slot)[2].retired  # type: ignore[union-attr]

    def tagged_tenants(self) -> set[str]:
        """The tenants that have a region now (isolated pools; tags are never reused: at
        most `dram_regions.MAX_TENANTS`, `tags_needed`)."""
        if self._regions is None:
            return set()
        with self._lock:
            return self._regions.tagged()

    def tags_needed(self, tenants: set[str], retiring: set[str]) -> int:
        """The region tags in use once each of `tenants` has a region (isolated pools): those
        given since the start, never reused, plus one per tenant without a region now or
        `retiring` (`retire_tenant` next)."""
        if self._regions is None:
            return 0
        with self._lock:
            return self._regions.tags_needed(tenants, retiring)

    def tenant_bytes(self) -> dict[str, int]:
        """The bytes of every region's file (isolated pools; retired ones not yet released
        under their tenant's name too): what the tenants' memory can reach at most."""
        if self._regions is None:
            return {}
        with self._lock:
            out: dict[str, int] = {}
            for r in self._regions.regions():
                out[r.tenant] = out.get(r.tenant, 0) + r.size
            return out

    def alloc(self, nbytes: int | None = None) -> int | None:
        """One free slot for a block of `nbytes` (default: the smallest slot), or None."""
        got = self.alloc_many(1, nbytes)
        return got[0] if got else None

    def alloc_many(self, n: int, nbytes: int | None = None) -> list[int] | None:
        """`n` slots for blocks of `nbytes`, all or none (None when they do not fit now)."""
        cls = self._class_of(nbytes or self.slot_size)
        with self._lock:
            pages, r = self._table(cls)
            got = None if pages is None else pages.alloc_many(n, cls)
            if r is None or got is None:
                return got
            return [self._global(r, s) for s in got]

    def room(self, nbytes: int) -> int:
        """Slots for blocks of `nbytes` free now: the class's own and those of free pages."""
        cls = self._class_of(nbytes)
        with self._lock:
            pages = self._table(cls)[0]
            return 0 if pages is None else pages.room(cls)

    def can_alloc(self, n: int, nbytes: int) -> bool:
        cls = self._class_of(nbytes)
        with self._lock:
            pages = self._table(cls)[0]
            return pages is not None and pages.can_alloc(n, cls)

    def free(self, slot: int) -> int:
        """Return a slot to its class (its page to the free pages when it was the page's last);
        returns the bytes it spanned (its `stride_of`). Refuses a pinned slot (SlotPinned) or a
        free one. The last slot of a retired region releases it."""
        with self._lock:
            pages, local, r = self._check(slot)
            if self._held(slot):
                raise SlotPinned(f"slot {slot} is pinned")
            if self.keep is not None:
                self.keep.clear(slot)  # before the slot can be taken again
            n = pages.free(local)
            if r is not None and r.retired and self._regions is not None:
                self._regions.release_if_drained(r)
            return n

    def free_many(self, slots: list[int]) -> int:
        """`free` of each slot under one lock; the bytes they spanned. Checks every slot first
        (allocated, unpinned) and frees none when one fails."""
        with self._lock:
            owner = self.owner
            if self._pins and not self._pins.keys().isdisjoint(slots):
                raise SlotPinned("a slot to free is pinned")
            if owner is not None and slots and owner.any_pinned(slots):
                raise SlotPinned("a slot to free holds a pinned block")
            if self._regions is None:
                try:
                    return self.pages.free_many(slots)
                except ValueError as exc:
                    raise DramError(str(exc)) from None
            by_table: dict[int, tuple[PageTable, Region, list[int]]] = {}
            for s in slots:
                pages, local, r = self._slot(s)
                assert r is not None
                by_table.setdefault(id(pages), (pages, r, []))[2].append(local)
            for pages, _, ids in by_table.values():  # all checked before any is freed
                for slot in ids:
                    if not pages.is_allocated(slot):
                        raise DramError(f"slot {slot} of a region is not allocated")
            n = 0
            for pages, r, ids in by_table.values():
                n += pages.free_many(ids)
                if r.retired:
                    self._regions.release_if_drained(r)
            return n

    def pin(self, slot: int) -> int:
        """Add a pin (a lease) to an allocated slot; returns the new pin count. Only for a pool
        that keeps its own pins (no `owner`: pin the block there instead)."""
        if self.owner is not None:
            raise DramError("this pool's pins are its owner's: pin the block, not the slot")
        with self._lock:
            self._check(slot)
            n = self._pins[slot] = self._pins.get(slot, 0) + 1
            return n

    def unpin(self, slot: int) -> int:
        if self.owner is not None:
            raise DramError("this pool's pins are its owner's: unpin the block, not the slot")
        with self._lock:
            self._check(slot)
            n = self._pins.get(slot, 0)
            if not n:
                raise DramError(f"slot {slot} is not pinned")
            if n == 1:
                del self._pins[slot]
            else:
                self._pins[slot] = n - 1
            return n - 1

    def pins(self, slot: int) -> int:
        """The pool's own pins of `slot` (with an owner: only a page move's target)."""
        return self._pins.get(slot, 0)

    def _held(self, slot: int) -> bool:
        """Whether `slot` is pinned: by the pool's own pins or, with an owner, by its block's."""
        owner = self.owner
        return bool(self._pins.get(slot)) or (owner is not None and owner.slot_pinned(slot))

    def is_allocated(self, slot: int) -> bool:
        try:
            pages, local, _ = self._slot(slot)
        except DramError:
            return False
        return pages.is_allocated(local)

    def _check(self, slot: int) -> tuple[PageTable, int, Region | None]:
        pages, local, r = self._slot(slot)
        if not pages.is_allocated(local):
            raise DramError(f"slot {slot} is not allocated")
        return pages, local, r

    # -- reclaim ----------------------------------------------------------------------------

    def can_evacuate(self, nbytes: int) -> bool:
        """Whether some page of the class of `nbytes` blocks has only unpinned live slots that
        fit the class's free slots elsewhere (what `evacuate` needs, before the caller's rule)."""
        cls = self._class_of(nbytes)
        with self._lock:
            pages, r = self._table(cls)
            return pages is not None and pages.evacuation(
                cls, lambda s: not self._held(self._global(r, s))) is not None

    def evacuate(self, nbytes: int, movable: Callable[[int], bool],
                 moved: Callable[[int, int], None], for_nbytes: int = 0) -> int:
        """Frees one page of the class of `nbytes` blocks by moving its live slots into the
        class's free slots on other pages: `plan_evacuation`, then `copy_moves` and per pair
        `moved(old, new)` (the caller repoints its owner) and `end_move`, on this thread.
        Returns the slots moved, -1 when no page can be freed so."""
        moves = self.plan_evacuation(nbytes, movable, for_nbytes)
        return -1 if moves is None else self._move_now(moves, moved)

    def clear_row(self, nbytes: int, movable: Callable[[int], bool],
                  moved: Callable[[int, int], None]) -> int:
        """For blocks of `nbytes` larger than a page: frees the pages of one row
        (`plan_row`), then copies and ends the moves as `evacuate` does. Returns the blocks
        moved, -1 when no row can be freed so."""
        moves = self.plan_row(nbytes, movable)
        return -1 if not moves else self._move_now(moves, moved)

    def _move_now(self, moves: list[SlotMove], moved: Callable[[int, int], None]) -> int:
        self.copy_moves(moves)
        for m in moves:
            moved(m.old, m.new)
            self.end_move(m, True)
        return len(moves)

    def plan_evacuation(self, nbytes: int, movable: Callable[[int], bool],
                        for_nbytes: int = 0) -> list[SlotMove] | None:
        """The moves that free one page of the class of `nbytes` blocks: its live slots (only
        when every one is unpinned and `movable`, the caller's rule) to the class's free slots
        on other pages, which are claimed now (taken: no allocation gets them). Both ends of
        each move are pinned until `end_move` (the source by the pool's owner, when it has
        one: the caller pins its block there), so neither is freed, rewritten or moved again
        meanwhile. None when no page can be freed so. `for_nbytes`: the block size the page is
        freed for (the page chosen keeps its slots next to that class's pages when it can:
        `PageTable.evacuation`). In an isolated pool pages move within a region only."""
        cls = self._class_of(nbytes)
        want = self._class_of(for_nbytes) if for_nbytes else 0
        with self._lock:
            pages, r = self._table(cls)
            if pages is None:
                return None
            found = pages.evacuation(
                cls, lambda s: not self._held(g := self._global(r, s)) and movable(g), want)
            if found is None:
                return None
            page, live = found
            dst = pages.targets(cls, page, len(live))
            pages.claim(dst)
            return self._planned([(self._global(r, a), self._global(r, b))
                                  for a, b in zip(live, dst, strict=True)])

    def plan_row(self, nbytes: int, movable: Callable[[int], bool]) -> list[SlotMove]:
        """For blocks of `nbytes` larger than a page (a row spans pages): the moves that free
        the pages of one row, the blocks of other classes on them to free slots of their
        classes elsewhere (`PageTable.relocation`), only when each is unpinned and `movable`;
        targets claimed and both ends pinned as in `plan_evacuation`. [] when no row can be
        freed so."""
        cls = self._class_of(nbytes)
        with self._lock:
            pages, r = self._table(cls)
            if pages is None:
                return []
            pairs = pages.relocation(
                cls, lambda s: not self._held(g := self._global(r, s)) and movable(g))
            return self._planned([(self._global(r, a), self._global(r, b)) for a, b in pairs])

    def _planned(self, pairs: list[tuple[int, int]]) -> list[SlotMove]:
        """Pins the ends of each move the pool owns (`_ends`) and notes where their bytes are
        (pool lock held)."""
        out: list[SlotMove] = []
        for old, new in pairs:
            for s in self._ends(old, new):
                self._pins[s] = self._pins.get(s, 0) + 1
            pages, local, _ = self._slot(old)
            out.append(SlotMove(old, new, self.offset(old), self.offset(new),
                                pages.stride_of(local)))
        return out

    def _ends(self, old: int, new: int) -> tuple[int, ...]:
        """The ends of a move the pool pins itself: both, or with an owner only the target (the
        owner pins the source's block: `Residency._moving`)."""
        return (old, new) if self.owner is None else (new,)

    def copy_moves(self, moves: list[SlotMove]) -> None:
        """Copies each planned move's bytes, old slot to new. Takes no lock: both slots are
        pinned (nobody frees or rewrites them) and their offsets were fixed when planned; call
        it on any thread, without the caller's locks."""
        for m in moves:
            buf = self._bytes_of(m.old)
            buf[m.dst : m.dst + m.nbytes] = buf[m.src : m.src + m.nbytes]

    def _bytes_of(self, slot: int) -> U8Array:
        """The daemon's view of the file slot `slot` lies in (a pinned or allocated slot's
        region is never released under it)."""
        if self._regions is None:
            return self._buf()
        return self._regions.locate(slot)[0].buf

    def end_move(self, move: SlotMove, moved: bool) -> None:
        """Ends a planned move: unpins its ends (`_ends`), then frees the old slot when the block
        `moved` (its owner now names the new one; its page goes back once every slot left it),
        else the new one (the block stays where it was: a reader pinned it meanwhile)."""
        with self._lock:
            for s in self._ends(move.old, move.new):
                n = self._pins[s] - 1
                if n:
                    self._pins[s] = n
                else:
                    del self._pins[s]
            gone = move.old if moved else move.new
            if self._held(gone):
                raise SlotPinned(f"slot {gone} is pinned; the move cannot free it")
            pages, local, r = self._slot(gone)
            if self.keep is not None:
                if moved:
                    self.keep.move(move.old, move.new)  # before the old record goes
                self.keep.clear(gone)
            pages.free(local)
            if r is not None and r.retired and self._regions is not None:
                self._regions.release_if_drained(r)

    # -- bytes ----------------------------------------------------------------------------

    def offset(self, slot: int) -> int:
        """Byte offset of a slot in its file (what a client is told: the segment's, or in an
        isolated pool its region's)."""
        try:
            if self._regions is None:
                return self.data_offset + self.pages.location(slot)
            r, local = self._regions.locate(slot)
            assert r.pages is not None
            return r.data_offset + r.pages.location(local)
        except ValueError as exc:
            raise DramError(str(exc)) from None

    def slot_at(self, offset: int, tenant: str | None = None) -> int | None:
        """The slot starting at byte `offset` of the segment, or in an isolated pool of
        `tenant`'s region now (None when none starts there)."""
        if self._regions is None:
            return self.pages.slot_at(offset - self.data_offset)
        if tenant is None:
            raise DramError("an isolated pool's offsets name a slot only within a region")
        with self._lock:
            r = self._regions.region(tenant)
            local = None if r.pages is None else r.pages.slot_at(offset - r.data_offset)
            return None if local is None else self._global(r, local)

    def stride_of(self, slot: int) -> int:
        """The bytes an allocated slot spans (its class stride)."""
        with self._lock:
            pages, local, _ = self._check(slot)
            return pages.stride_of(local)

    def view(self, slot: int, nbytes: int | None = None) -> U8Array:
        """Zero-copy writable view of a slot's first `nbytes` (default: all its stride) bytes.

        Valid while the pool is open (in an isolated pool, while the slot is allocated: a
        retired region is released once its last slot is freed); the caller must respect the
        pin rule when writing.
        """
        pages, local, r = self._slot(slot)
        o = self.offset(slot)
        stride = pages.stride_of(local) if pages.is_allocated(local) else 0
        n = stride if nbytes is None else nbytes
        if nbytes is not None and stride and nbytes > stride:
            raise DramError(f"{nbytes} bytes do not fit slot {slot} ({stride} B)")
        buf = self._buf() if r is None else r.buf
        return buf[o : o + n]

    def write(self, slot: int, data: Any) -> None:
        """Copy `data` (a buffer of at most the slot's stride) into an allocated, unpinned slot."""
        src = np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            pages, local, _ = self._check(slot)
            if self._held(slot):
                raise SlotPinned(f"slot {slot} is leased; it cannot be rewritten")
            stride = pages.stride_of(local)
        if src.nbytes > stride:
            raise DramError(f"{src.nbytes} bytes do not fit a {stride}-byte slot")
        np.copyto(self.view(slot, src.nbytes), src)

    def write_many(self, slots: list[int], blocks: list[Any]) -> None:
        for slot, data in zip(slots, blocks, strict=True):
            self.write(slot, data)

    def read_into(self, slot: int, out: Any) -> None:
        dst = np.frombuffer(out, dtype=np.uint8)
        np.copyto(dst, self.view(slot, dst.nbytes))

    def read_many_into(self, slots: list[int], outs: list[Any]) -> None:
        for slot, out in zip(slots, outs, strict=True):
            self.read_into(slot, out)

    def _tables(self) -> list[PageTable]:
        if self._regions is None:
            return [self.pages]
        return [r.pages for r in self._regions.regions() if r.pages is not None]

    def strides(self, nbytes: int | None = None) -> set[int]:
        """The size classes (slot strides, tagged in an isolated pool) holding pages now; with
        `nbytes`, those of the page table its class allocates from (an isolated pool's region:
        pages move between its classes only)."""
        with self._lock:
            if nbytes is not None:
                pages = self._table(self._class_of(nbytes))[0]
                return set() if pages is None else pages.strides()
            return set().union(*(t.strides() for t in self._tables()))

    def slots_pinned(self) -> int:
        """`stats().slots_pinned` alone (what eviction asks on every Allocate that evicts),
        without walking the pages for the class figures."""
        with self._lock:
            return len(self._pins) + (self.owner.pinned_slots if self.owner is not None else 0)

    def stats(self) -> DramStats:
        with self._lock:
            tables = self._tables()
            used = sum(t.used for t in tables)
            used_bytes = sum(t.used_bytes for t in tables)
            pinned = len(self._pins)
            if self.owner is not None:
                pinned += self.owner.pinned_slots
            classes = tuple(c for t in tables for c in t.classes())
            if self._regions is None:
                pages_free = self.pages.free_pages
            else:  # pages no region holds yet count as free
                pages_free = self.page_count - sum(t.page_count - t.free_pages for t in tables)
            small = [c for c in classes if geometric(c.stride) == self.slot_stride]
            free_small = sum(c.slots - c.slots_used for c in small) + pages_free * (
                self.page_bytes // self.slot_stride)
        return DramStats(
            self.slot_size, self.data_bytes // self.slot_stride, used, free_small, pinned,
            self.data_bytes, used_bytes, self.data_bytes - used_bytes, self.size, self.mlocked,
            self.huge_pages, self.page_bytes, self.page_count, pages_free, classes,
        )

    def close(self, keep: bool = False) -> None:
        """Mark the header(s) closed, unlink the file and unmap. Clients keep their mapping.
        `keep` (a pool with a keep file): the memory is left for a successor instead — the
        named file and its keep file stay, live; memfds stay with the holder."""
        if self._closed:
            return
        self._closed = True
        keep = keep and self.keep is not None
        if self.keep is not None:
            self.keep.freeze()
        if self._regions is not None:
            with self._lock:
                self._regions.close(keep)
            if self.keep is not None:
                self.keep.close(unlink=False)
            return
        assert self._map is not None
        if not keep:
            mark_closed(self._map.mm)
        if self._finalizer is not None:
            self._finalizer.detach()
            try:
                if not keep:
                    os.unlink(self.path)
            except FileNotFoundError:
                log.warning("shared-memory segment %s was already removed", self.path)
        if self.keep is not None:
            self.keep.close(unlink=not keep)
        self._map.close()
        os.close(self._fd)

    def __enter__(self) -> DramPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
