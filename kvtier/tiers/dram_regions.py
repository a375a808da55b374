"""Per-tenant memory behind the DRAM pool of a daemon with a tokens file: no name to open, each
tenant's memory its own, and none of it ever handed to another tenant while a client may map it.

Without tenants the pool is one named file under /dev/shm that every local client maps whole
(`kvtier.tiers.dram`). With a tokens file each tenant has a *region*: an anonymous file
(`memfd_create`, sealed against shrinking and growing) laid out as a pool of its own — the
segment header, then `pages` pages — with a page table of its own (`kvtier.tiers.dram_pages`).
Its client gets the file's fd over the daemon's fd socket (`kvtier.daemon.fdpass`, after its
token is checked) and maps it whole: every byte of it is the tenant's.

Slices. At start the pool's pages are divided among the tenants (`slice_pages`): a tenant with a
`dram_quota` gets the pages that hold it, the others share the rest equally (each at least its
`dram_guarantee`). A reload keeps the slice of every tenant whose quota and guarantee did not
change and divides the pages those do not hold among the tenants added or changed; when those
pages are too few it divides the whole pool again (`reslice`: tenants whose slice changes move to
a fresh region, their DRAM blocks leave DRAM, their SSD and remote copies stay).
A region has exactly its tenant's slice of pages, so the tenants' files together never hold more
than the pool's data bytes plus one header each, whatever their clients write or read through
their mappings.

Pages never move between tenants. A page of a live region stays in that region's file at the
same offset for the region's whole life, so a mapping a client pinned (cudaHostRegister, an
io_uring fixed buffer) always sees the bytes the daemon serves. Each region page stands for one
page of the pool's global page space (`home`): slot ids are global (page * ids_per_page + slot
of the page, as in a shared pool), so tables sized by slot id cover every tenant.

Retirement. A reload that changes or revokes a tenant's token, or changes its slice, retires its
region (`retire`: the header marked closed); the tenant's next region is a fresh file with a
fresh tag (tags 1..255 are never reused) and a generation of its own, which its clients compare
to re-fetch. The retired region's blocks are served no more (`stale`: the daemon drops them, at
once or at their last release). When its last slot is freed the region is released: its file's
data is punched out (a client still mapping it sees its closed header and zeros; only pages a
client pinned stay allocated, held by that client), the daemon closes it, and its global pages go
to the regions that wait for pages (a new region takes free global pages at once and the rest as
they are released). A region that waits for pages is not handed out (`DramPool.tenant_file`
refuses; its clients stream meanwhile and fetch it later) nor prefaulted, so the files a client
can write hold no more than the pages each region has.

Called under the pool's lock (`kvtier.tiers.dram.DramPool`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier.core.errors import UsageError
from kvtier.core.segment import (
    STATE,
    STATE_CLOSED,
    STATE_OFFSET,
    DramError,
    SegmentHandle,
    SegmentHeader,
    pack_header,
)
from kvtier.core.units import format_bytes
from kvtier.tiers.dram_keep import Holder, KeepFile, Kept, region_fd_name
from kvtier.tiers.dram_pages import UNIT, PageTable

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_TENANTS = UNIT - 1
"""Regions an isolated pool makes over its life (their tags, 1..255, lie below the stride unit;
a tenant's first region and one per retirement); a tokens file with more tenants is refused at
start and at a reload (`tenant_count_problem`)."""


def tenant_count_problem(tenants: int, tokens_file: object) -> str | None:
    """Why a tokens file of `tenants` tenants cannot serve an isolated pool, or None."""
    if tenants <= MAX_TENANTS:
        return None
    return (f"tokens file {tokens_file}: {tenants} tenants, more than the {MAX_TENANTS} an "
            "isolated DRAM pool serves")


class TenantShare(NamedTuple):
    """What a tenant may hold in DRAM (`kvtier.daemon.auth.Tenant`): 0 = not set."""

    name: str
    quota_bytes: int = 0
    guarantee_bytes: int = 0


def _needed(tenants: Sequence[TenantShare], page_bytes: int) -> dict[str, int]:
    """The pages each tenant needs at least: its quota's, or its guarantee's and one."""
    return {t.name: -(-t.quota_bytes // page_bytes) if t.quota_bytes
            else max(1, -(-t.guarantee_bytes // page_bytes)) for t in tenants}


def slice_pages(tenants: Sequence[TenantShare], page_bytes: int, page_count: int,
                where: object = "tokens file") -> dict[str, int]:
    """Each tenant's pages of `page_count` pages: a tenant with a quota the pages that hold it;
    the others the rest in equal shares (the first by name take one more each while pages are
    left over), each at least the pages its guarantee needs. UsageError when the quotas and
    guarantees, with a page for every tenant, need more pages than there are."""
    floor = _needed(tenants, page_bytes)
    need = sum(floor.values())
    if need > page_count:
        raise UsageError(
            f"{where}: the tenants' DRAM quotas and guarantees, with at least one page of "
            f"{format_bytes(page_bytes)} for each tenant, need {need} pages; the DRAM pool has "
            f"{page_count} (raise dram_bytes, lower the quotas, or set smaller dram_page_bytes)")
    pages = {t.name: floor[t.name] for t in tenants if t.quota_bytes}
    rest = page_count - sum(pages.values())
    shared = sorted(t.name for t in tenants if not t.quota_bytes)
    while shared:  # equal shares; a tenant whose guarantee needs more takes that and leaves
        share, extra = divmod(rest, len(shared))
        over = [n for n in shared if floor[n] > share]
        if not over:
            for i, n in enumerate(shared):
                pages[n] = share + (i < extra)
            break
        for n in over:
            pages[n] = floor[n]
            rest -= floor[n]
            shared.remove(n)
    return pages


def reslice(tenants: Sequence[TenantShare], page_bytes: int, page_count: int,
            before: Mapping[str, tuple[TenantShare, int]],
            where: object = "tokens file") -> dict[str, int]:
    """The tenants' pages after a reload: a tenant whose quota and guarantee are unchanged
    keeps its slice (`before`: tenant -> (share, pages)), and the tenants added or changed
    share the pages the kept ones do not hold (`slice_pages`), so a reload takes no DRAM from a
    tenant it did not change — unless those pages are too few: then the whole pool is divided
    again (`slice_pages`; the caller moves every tenant whose slice changed to a fresh
    region). UsageError when even that does not fit."""
    kept = {t.name: before[t.name][1] for t in tenants
            if t.name in before and before[t.name][0] == t}
    fresh = [t for t in tenants if t.name not in kept]
    free = page_count - sum(kept.values())
    if sum(_needed(fresh, page_bytes).values()) > free:
        return slice_pages(tenants, page_bytes, page_count, where)
    return {**kept, **slice_pages(fresh, page_bytes, free, where)}


def anonymous_file(name: str, size: int, header: bytes = b"") -> int:
    """A sealed (no shrink, no grow) anonymous file of `size` bytes with `header` at offset 0."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if header:
            os.pwrite(fd, header, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class RegionSpec(NamedTuple):
    """The geometry every region shares (the pool's) and how its memory is taken."""

    page_bytes: int
    min_stride: int  # the smallest slot stride (the pool's `slot_stride`)
    slot_size: int  # the smallest slot
    data_offset: int  # the header area before page 0
    align: int  # the file size is a multiple of it (huge pages: 2 MiB)
    prefault: bool = False
    mlock: bool = False
    huge: bool = False


def release_fd(fd: int) -> None:
    """Punches a tenant file's memory out and closes `fd` (a kept region not adopted: a client
    still mapping it sees zeros, never a block)."""
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    try:
        size = os.fstat(fd).st_size
        if size and _libc().fallocate(fd, mode, 0, size) != 0:
            log.warning("cannot free a kept tenant file's memory: %s",
                        os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


class Region:
    """One tenant's file: a pool of `len(home)` pages of its own (module docstring). `home[p]`
    is the global page local page p stands for, -1 until one is free for it; `pages`, its page
    table, is None until every local page has one (a region made while a retired one still
    holds its pages waits for them, and holds no block meanwhile)."""

    def __init__(self, tenant: str, tag: int, pages: int, generation: int,
                 spec: RegionSpec, fd: int | None = None) -> None:
        """A new file, or with `fd` (taken over: closed on failure) the kept file of a region
        a dead daemon made (`TenantRegions.adopt`): same size, sealed as this one seals."""
        self.tenant = tenant
        self.tag = tag
        self.generation = generation
        self.spec = spec
        self.data_offset = spec.data_offset
        size = spec.data_offset + pages * spec.page_bytes
        self.size = -(-size // spec.align) * spec.align
        self.count = pages
        self.pages: PageTable | None = None
        self.home = [-1] * pages
        self.retired = False
        self.name = f"kvtier-dram-{tenant}-{tag}"
        if fd is not None:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                if os.fstat(fd).st_size != self.size or seals & SEALS != SEALS:
                    raise DramError(f"tenant {tenant!r}'s kept file has another size or seals")
            except BaseException:
                os.close(fd)
                raise
        self.fd = anonymous_file(self.name, self.size) if fd is None else fd
        try:
            self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.buf: npt.NDArray[np.uint8] = np.frombuffer(self.mm, dtype=np.uint8)
        pack_header(self.mm, SegmentHeader.live(self.handle()))
        if spec.huge:
            with contextlib.suppress(AttributeError, OSError):
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        if spec.mlock:
            libc = _libc()
            if libc.mlock(ctypes.c_void_p(int(self.buf.ctypes.data)), self.size) != 0:
                log.warning("mlock of tenant %r's DRAM failed: %s", tenant,
                            os.strerror(ctypes.get_errno()))

    def handle(self) -> SegmentHandle:
        """What the tenant's client attaches: its own file's geometry and generation."""
        s = self.spec
        return SegmentHandle(self.name, self.size, self.generation, s.slot_size, s.min_stride,
                             self.count * s.page_bytes // s.min_stride, self.data_offset,
                             "/dev/shm", s.page_bytes, self.count)

    def ready(self) -> None:
        """Every local page has a global page: the region takes blocks, its file may be handed
        out (before, a client touching it could make it hold memory beyond the pool's), and
        with `prefault` its memory is allocated now."""
        self.pages = PageTable(self.spec.page_bytes, self.count, self.spec.min_stride)
        if self.spec.prefault:
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as exc:
                log.warning("cannot allocate tenant %r's DRAM now: %s", self.tenant, exc)

    @property
    def used(self) -> int:
        """Allocated slots (page-move targets included)."""
        return 0 if self.pages is None else self.pages.used

    def close_header(self) -> None:
        os.pwrite(self.fd, STATE.pack(STATE_CLOSED), STATE_OFFSET)

    def release(self) -> None:
        """Punches the file's data memory out (a client still mapping it reads its closed
        header and zeros; pages a client pinned stay with that client), closes the daemon's fd
        and unmaps (views still held keep the mapping until they go)."""
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        n = self.size - self.data_offset
        if _libc().fallocate(self.fd, mode, self.data_offset, n) != 0:
            log.warning("cannot free tenant %r's retired DRAM: %s", self.tenant,
                        os.strerror(ctypes.get_errno()))
        os.close(self.fd)
        del self.buf
        try:
            self.mm.close()
        except BufferError:
            log.debug("a retired region is still viewed; unmapped when its views go")


class TenantRegions:
    """The tenants' regions of an isolated pool (see the module docstring). Called under the
    pool's lock."""

    def __init__(self, spec: RegionSpec, page_count: int) -> None:
        self.spec = spec
        self.page_count = page_count
        self.keep: KeepFile | None = None  # where the regions are written down (`dram_keep`)
        self.holder: Holder | None = None  # who keeps their memfds across a restart
        self.keys: dict[str, bytes] = {}  # tenant -> its token's fingerprint (`token_key`)
        self.ids_per_page = -(-spec.page_bytes // spec.min_stride)
        self._slices: dict[str, int] = {}
        self._current: dict[str, Region] = {}  # tenant -> its region now
        self._by_tag: dict[int, Region] = {}  # live and retired, until released
        self._tags = 0  # tags given so far (never reused)
        self._global: list[Region | None] = [None] * page_count  # global page -> its region
        self._local = [0] * page_count  # global page -> the region's local page
        self._free_global = list(range(page_count - 1, -1, -1))
        self._waiting: list[Region] = []  # regions with local pages no global page backs yet

    # -- slices and regions -------------------------------------------------------------

    def set_slices(self, slices: dict[str, int]) -> list[str]:
        """The tenants' pages from now on (`reslice`); returns the tenants whose region now has
        another size (the caller retires them: their next region has the new one). A tenant
        left out keeps its region until the caller retires it (revoked)."""
        self._slices = dict(slices)
        return sorted(t for t, r in self._current.items() if slices.get(t, r.count) != r.count)

    def slices(self) -> dict[str, int]:
        """Tenant -> its pages, as set last (`set_slices`)."""
        return dict(self._slices)

    def region(self, tenant: str) -> Region:
        """The tenant's region now (made on first use, with the tenant's slice of pages)."""
        r = self._current.get(tenant)
        if r is not None:
            return r
        pages = self._slices.get(tenant)
        if not pages:
            raise DramError(f"tenant {tenant!r} has no DRAM slice (not in the tokens file)")
        if self._tags >= MAX_TENANTS:
            raise DramError(f"an isolated DRAM pool makes at most {MAX_TENANTS} tenant regions "
                            "(one per tenant, one more per token change; a restart starts over)")
        self._tags += 1
        r = Region(tenant, self._tags, pages, secrets.randbits(63) | 1, self.spec)
        self._current[tenant] = self._by_tag[r.tag] = r
        self._waiting.append(r)
        self._write(r)
        if self.holder is not None:
            self.holder.keep(region_fd_name(r.generation), r.fd)
        self._grant()
        return r

    def _write(self, r: Region) -> None:
        """Region `r` as the keep file lists it (`kvtier.tiers.dram_keep`), if there is one."""
        if self.keep is not None:
            self.keep.set_region(r.tag, r.tenant, self.keys.get(r.tenant, b""), r.generation,
                                 r.count, r.retired)

    def record_all(self) -> None:
        """Every region and page as the keep file lists them (after `adopt`, or a fresh one)."""
        keep = self.keep
        if keep is None:
            return
        keep.reset_regions()
        for r in self._by_tag.values():
            self._write(r)
            for p, g in enumerate(r.home):
                if g >= 0:
                    keep.set_page(g, r.tag, p)

    def adopt(self, kept: Kept, fds: dict[str, int]) -> tuple[list[Region], list[str]]:
        """Takes over the live regions a dead daemon's keep file lists whose memfd the holder
        gave back (popped from `fds`), whose tenant's token is the same now (`keys`) and whose
        pages are all its own; re-tagged 1..n. Returns them (their page tables empty: the
        pool adopts their slots) and a line per region left out (its fd stays in `fds`: the
        caller releases it)."""
        adopted: list[Region] = []
        notes: list[str] = []
        used: set[int] = set()
        for k in sorted(kept.regions, key=lambda k: k.tag):
            if k.retired:
                continue
            name = region_fd_name(k.generation)
            why = ""
            if name not in fds:
                why = "the holder gave back no memory for it"
            elif k.tenant in self._current:
                why = "a second region of the tenant"
            elif self.keys.get(k.tenant) != k.digest:
                why = "its tenant's token changed or was revoked"
            elif any(not 0 <= g < self.page_count or g in used for g in k.home):
                why = "its pages are not all its own"
            if why:
                notes.append(f"tenant {k.tenant!r}'s DRAM starts cold: {why}")
                continue
            try:
                r = Region(k.tenant, len(adopted) + 1, k.pages, k.generation, self.spec,
                           fds.pop(name))
            except (OSError, DramError) as exc:
                notes.append(f"tenant {k.tenant!r}'s DRAM starts cold: {exc}")
                continue
            r.home = list(k.home)
            for p, g in enumerate(r.home):
                self._global[g], self._local[g] = r, p
                used.add(g)
            r.pages = PageTable(self.spec.page_bytes, r.count, self.spec.min_stride)
            self._current[r.tenant] = self._by_tag[r.tag] = r
            adopted.append(r)
        self._tags = len(adopted)
        self._free_global = sorted(set(range(self.page_count)) - used, reverse=True)
        return adopted, notes

    def local_of(self, r: Region, slot: int) -> int | None:
        """The local slot id of global slot id `slot` in region `r`, None when another's."""
        g, j = divmod(slot, self.ids_per_page)
        if not 0 <= g < self.page_count or self._global[g] is not r:
            return None
        return self._local[g] * self.ids_per_page + j

    def _grant(self) -> None:
        """Free global pages to the regions waiting for them, oldest first."""
        while self._waiting and self._free_global:
            r = self._waiting[0]
            p = r.home.index(-1)
            g = self._free_global.pop()
            r.home[p] = g
            self._global[g], self._local[g] = r, p
            if self.keep is not None:
                self.keep.set_page(g, r.tag, p)
            if -1 not in r.home:
                r.ready()
                self._waiting.pop(0)

    def of_class(self, cls: int) -> Region:
        """The region of class id `cls` (its stride plus the region's tag)."""
        r = self._by_tag.get(cls % UNIT)
        if r is None:
            raise DramError(f"no tenant has size class {cls} (isolated pool: allocate through "
                            "the tenant's class, `DramPool.class_bytes`)")
        return r

    def is_class(self, cls: int) -> bool:
        """Whether `cls` names a class of a region not released (a stride plus its tag)."""
        return cls % UNIT in self._by_tag

    def locate(self, slot: int) -> tuple[Region, int]:
        """(region, local slot id) of global slot id `slot`; DramError when no region has it."""
        g, j = divmod(slot, self.ids_per_page)
        r = self._global[g] if 0 <= g < self.page_count else None
        if r is None:
            raise DramError(f"slot {slot} is in no tenant's memory")
        return r, self._local[g] * self.ids_per_page + j

    def to_global(self, r: Region, local: int) -> int:
        p, j = divmod(local, self.ids_per_page)
        return r.home[p] * self.ids_per_page + j

    def retire(self, tenant: str) -> bool:
        """The tenant's region now is retired (header closed; its classes `stale`); its next
        one is fresh (`region`). False when the tenant had none."""
        r = self._current.pop(tenant, None)
        if r is None:
            return False
        r.retired = True
        r.close_header()
        self._write(r)
        if self.holder is not None:  # a retired region is never adopted
            self.holder.forget(region_fd_name(r.generation))
        if r in self._waiting:
            self._waiting.remove(r)
        self.release_if_drained(r)
        return True

    def release_if_drained(self, r: Region) -> bool:
        """Releases retired region `r` once no slot of it is allocated: its memory punched out,
        its file closed, its global pages to the regions waiting for them."""
        if not r.retired or r.used or self._by_tag.get(r.tag) is not r:
            return False
        del self._by_tag[r.tag]
        if self.keep is not None:
            self.keep.drop_region(r.tag)
        for g in r.home:
            if g >= 0:
                self._global[g] = None
                self._free_global.append(g)
                if self.keep is not None:
                    self.keep.set_page(g, 0, 0)
        self._free_global.sort(reverse=True)
        r.release()
        self._grant()
        return True

    def tagged(self) -> set[str]:
        """The tenants that have a region now."""
        return set(self._current)

    def tags_needed(self, tenants: set[str], retiring: set[str]) -> int:
        """Tags in use once every tenant of `tenants` has a region (those given so far, never
        reused, plus one per tenant without a region now or `retiring`)."""
        return self._tags + len(tenants - (self.tagged() - retiring))

    def regions(self) -> Iterator[Region]:
        """Every region not released (live and retired)."""
        return iter(list(self._by_tag.values()))

    def mark_closed(self) -> None:
        for r in self._by_tag.values():
            r.close_header()

    def close(self, keep: bool = False) -> None:
        """Closes every region (`keep`: live headers stay live, for a successor that adopts
        the memfds the holder keeps)."""
        for r in list(self._by_tag.values()):
            if not keep or r.retired:
                r.close_header()
            os.close(r.fd)
            del r.buf
            try:
                r.mm.close()
            except BufferError:
                log.debug("a region is still viewed at close; unmapped when its views go")
        self._by_tag.clear()
        self._current.clear()
