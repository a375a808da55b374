"""Per-tenant memory behind the DRAM pool of a daemon with a tokens file: no name to open, and a
tenant's mapping holds its own blocks only.

Without tenants the pool is one named file under /dev/shm that every local client maps whole
(`kvtier.tiers.dram`). With a tokens file the pool's address range is backed page by page by
anonymous files (`memfd_create`): a base file the daemon never hands out, and one file per tenant
(its region), each as large as the pool (sparse: only pages written hold memory) and sealed against
shrinking and growing (a client that holds the fd cannot truncate it under the daemon's mapping),
with the segment header at offset 0. A size class belongs to one tenant (`class_id`: the stride
plus the tenant's tag, 1..255, below the 256 B stride unit — same geometry, another class:
`kvtier.tiers.dram_pages.geometric`), and a page belongs to one class, so a page holds one tenant's
blocks only; the pool takes at most 255 tenants. When a page joins a class of another tenant than
the one whose file backs it, the daemon maps that page of the new tenant's file over it (`mmap`
MAP_FIXED, at the same offset: offsets and size-class grids are the ones the pool hands out anyway)
and punches the page out of the previous file (the base one, or the previous tenant's: its bytes
there are gone, not left for it). A page that goes back to the free pages keeps its tenant's
memory, as a free page of the single-tenant pool keeps its bytes: only that tenant's bytes are
there, and the tenant taking it again costs no remap and no fresh zeroed pages (punching at every
release cost 5x in store+load bandwidth). A tenant's client gets its own file's fd over the
daemon's fd socket (`kvtier.daemon.fdpass`, after its token is checked) and maps it whole: at the
offsets of its blocks it finds them, everywhere else zeros, its own earlier blocks or what it
wrote there itself — never another tenant's bytes, and nothing it writes reaches them.

A tenant's file is one *region* of it. A reload that changes or revokes its token retires the
region (`retire`: its header marked closed); the tenant's next region has a fresh file, a fresh
tag (fresh class ids; tags are never reused, so each counts toward the 255) and a generation of
its own in its header, which its clients compare to re-fetch. The retired region's classes are
`stale` (the daemon evicts their blocks: `kvtier.daemon.cache.residency.Residency.rekey`), and
its pages are punched out of its file when another region, the tenant's new one included, takes
them: an fd fetched before the reload sees no block stored after it.

Every move of a page from one tenant to another costs two syscalls (mmap, fallocate) under the
pool's lock, at page granularity (megabytes), not per block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import secrets
from typing import Any

from kvtier.core.segment import STATE, STATE_CLOSED, STATE_OFFSET, DramError
from kvtier.tiers.dram_pages import UNIT, geometric

log = logging.getLogger(__name__)

MAP_FIXED = 0x10
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_HUGEPAGE = 14
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
GENERATION_AT = STATE_OFFSET + STATE.size  # the header's generation (u64, after the state)
MAX_TENANTS = UNIT - 1
"""Tenants an isolated pool serves (their tags, 1..255, lie below the stride unit); a tokens file
with more is refused at start and at a reload (`tenant_count_problem`)."""


def tenant_count_problem(tenants: int, tokens_file: object) -> str | None:
    """Why a tokens file of `tenants` tenants cannot serve an isolated pool, or None."""
    if tenants <= MAX_TENANTS:
        return None
    return (f"tokens file {tokens_file}: {tenants} tenants, more than the {MAX_TENANTS} an "
            "isolated DRAM pool serves")


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


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


class TenantRegions:
    """The tenants' files behind the pool's pages (see the module docstring). Called under the
    pool's lock."""

    def __init__(self, base_fd: int, base_address: int, size: int, data_offset: int,
                 page_bytes: int, page_count: int, header: bytes, *, prefault: bool = False,
                 mlock: bool = False, huge: bool = False) -> None:
        if data_offset % mmap.PAGESIZE or page_bytes % mmap.PAGESIZE:
            raise DramError(f"pages of {page_bytes} B at {data_offset} are not aligned to the "
                            f"{mmap.PAGESIZE} B memory page")
        self._libc = _libc()
        self._base_fd = base_fd
        self._base = base_address
        self.size = size
        self._data_offset = data_offset
        self._page_bytes = page_bytes
        self._header = header
        self._prefault = prefault
        self.mlock = mlock
        self.huge = huge
        self._generation = int.from_bytes(header[GENERATION_AT:GENERATION_AT + 8], "little")
        # A region is one file of one tenant: the tenant's first is keyed by its name, one made
        # after a reload changed or revoked its token (`retire`) by "<name>#<n>" (a tenant name
        # never holds "#": `kvtier.daemon.auth`).
        self._current: dict[str, str] = {}  # tenant -> its region now
        self._tenant: dict[str, str] = {}  # region -> its tenant
        self._gens: dict[str, int] = {}  # region -> the generation in its file's header
        self._fds: dict[str, int] = {}  # region -> its file
        self._tags: dict[str, int] = {}  # region -> its tag (1..UNIT-1)
        self._owner: dict[int, str] = {}  # class id -> its region
        self._pages: list[str | None] = [None] * page_count  # page -> its region
        self._renewed = 0

    def _region(self, tenant: str) -> str:
        """The tenant's region now (made on first use: its first, or a fresh one after
        `retire`, with a generation of its own)."""
        region = self._current.get(tenant)
        if region is None:
            if tenant not in self._tenant:  # its first: keyed by its name
                region, gen = tenant, self._generation
            else:
                self._renewed += 1
                region = f"{tenant}#{self._renewed}"
                gen = secrets.randbits(63) | 1
            self._current[tenant], self._tenant[region], self._gens[region] = region, tenant, gen
        return region

    def fd(self, tenant: str) -> int:
        """The file of the tenant's region now (created on first use). The daemon keeps it; a
        client gets a dup."""
        return self._file(self._region(tenant))

    def generation(self, tenant: str) -> int:
        """The generation in the header of the tenant's file now (its first file's is the
        pool's; a fresh file after `retire` has its own: a client compares it and re-fetches)."""
        return self._gens[self._region(tenant)]

    def _file(self, region: str) -> int:
        fd = self._fds.get(region)
        if fd is None:
            header = bytearray(self._header)
            header[GENERATION_AT:GENERATION_AT + 8] = self._gens[region].to_bytes(8, "little")
            fd = self._fds[region] = anonymous_file(f"kvtier-dram-{region}"[:200], self.size,
                                                    bytes(header))
        return fd

    def class_id(self, tenant: str, stride: int) -> int:
        """The id of `tenant`'s class of blocks of stride `stride` now: the stride plus the
        tag of its region. DramError past 255 tags."""
        region = self._region(tenant)
        tag = self._tags.get(region)
        if tag is None:
            if len(self._tags) >= MAX_TENANTS:  # regions of earlier tokens files included
                raise DramError(f"an isolated DRAM pool serves at most {MAX_TENANTS} tenants "
                                "(tags, one more per token change, never reused)")
            self._file(region)
            tag = self._tags[region] = len(self._tags) + 1
        cls = geometric(stride) + tag
        self._owner[cls] = region
        return cls

    def tagged(self) -> set[str]:
        """The tenants whose region now has a tag."""
        return {t for t, r in self._current.items() if r in self._tags}

    def tags_needed(self, tenants: set[str], retiring: set[str]) -> int:
        """The tags in use once every tenant of `tenants` has one (those given so far, never
        reused, plus one per tenant whose region now has none or is `retiring`)."""
        return len(self._tags) + len(tenants - (self.tagged() - retiring))

    def retire(self, tenant: str) -> bool:
        """A reload changed or revoked `tenant`'s token: its region now is retired (its file's
        header marked closed) and its next file and classes are fresh (`_region`); the pages of
        the retired region stay its until another region takes them (`back` punches them
        then). Its blocks there must leave (`stale`). False when the tenant had no region."""
        region = self._current.pop(tenant, None)
        if region is None:
            return False
        fd = self._fds.get(region)
        if fd is not None:
            os.pwrite(fd, STATE.pack(STATE_CLOSED), STATE_OFFSET)
        return True

    def stale(self, cls: int) -> bool:
        """Whether class `cls` is of a retired region (its blocks are served no more)."""
        region = self._owner.get(cls)
        return region is not None and self._current.get(self._tenant[region]) != region

    def is_class(self, cls: int) -> bool:
        return cls in self._owner

    def owner(self, cls: int) -> str:
        """The region of class `cls`; DramError for a class no tenant has (a bare stride)."""
        tenant = self._owner.get(cls)
        if tenant is None:
            raise DramError(f"no tenant has size class {cls} (isolated pool: allocate through "
                            "the tenant's class, `DramPool.class_bytes`)")
        return tenant

    def page_owner(self, page: int) -> str | None:
        """The tenant whose file backs page `page` (None: the base file, never handed out)."""
        region = self._pages[page]
        return None if region is None else self._tenant[region]

    def back(self, page: int, cls: int) -> None:
        """`PageTable.backing`: page `page` joins class `cls` (0: goes back to the free
        pages). A page joining another tenant's class gets that tenant's memory, and the
        previous tenant's bytes there are dropped; a free page keeps its tenant's memory (its
        bytes are that tenant's, and the tenant taking it again costs nothing: no remap, no
        fresh zeroed pages)."""
        if not cls:
            return
        region = self.owner(cls)
        old = self._pages[page]
        if old == region:
            return
        o = self._data_offset + page * self._page_bytes
        fd = self._file(region)
        self._map(fd, o)
        self._punch(self._base_fd if old is None else self._fds[old], o)
        if self._prefault:
            try:
                os.posix_fallocate(fd, o, self._page_bytes)
            except OSError as exc:
                log.warning("cannot allocate a DRAM page of tenant %r now: %s",
                            self._tenant[region], exc)
        self._pages[page] = region

    def _map(self, fd: int, offset: int) -> None:
        libc, n, address = self._libc, self._page_bytes, self._base + offset
        got = libc.mmap(ctypes.c_void_p(address), n, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_SHARED | MAP_FIXED, fd, offset)
        if got != address:
            err = ctypes.get_errno()
            raise DramError(f"cannot map a DRAM page at offset {offset}: {os.strerror(err)}")
        if self.huge:
            libc.madvise(ctypes.c_void_p(address), n, MADV_HUGEPAGE)
        if self.mlock and libc.mlock(ctypes.c_void_p(address), n) != 0:
            log.warning("mlock of a remapped DRAM page failed: %s",
                        os.strerror(ctypes.get_errno()))

    def _punch(self, fd: int, offset: int) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(fd, mode, offset, self._page_bytes) != 0:
            log.warning("cannot free a DRAM page's old memory at offset %d: %s", offset,
                        os.strerror(ctypes.get_errno()))

    def mark_closed(self) -> None:
        """Marks every tenant file's header closed (their clients see the pool went)."""
        closed = STATE.pack(STATE_CLOSED)
        for fd in self._fds.values():
            os.pwrite(fd, closed, STATE_OFFSET)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
