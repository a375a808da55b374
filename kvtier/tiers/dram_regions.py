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
from typing import Any

from kvtier.core.segment import STATE, STATE_CLOSED, STATE_OFFSET, DramError
from kvtier.tiers.dram_pages import UNIT, geometric

log = logging.getLogger(__name__)

MAP_FIXED = 0x10
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_HUGEPAGE = 14
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
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
        self._fds: dict[str, int] = {}
        self._tags: dict[str, int] = {}  # tenant -> its tag (1..UNIT-1)
        self._owner: dict[int, str] = {}  # class id -> its tenant
        self._pages: list[str | None] = [None] * page_count  # page -> its tenant

    def fd(self, tenant: str) -> int:
        """The tenant's file (created on first use). The daemon keeps it; a client gets a dup."""
        fd = self._fds.get(tenant)
        if fd is None:
            fd = self._fds[tenant] = anonymous_file(f"kvtier-dram-{tenant}"[:200], self.size,
                                                    self._header)
        return fd

    def class_id(self, tenant: str, stride: int) -> int:
        """The id of `tenant`'s class of blocks of stride `stride`: the stride plus the
        tenant's tag. DramError past 255 tenants."""
        tag = self._tags.get(tenant)
        if tag is None:
            if len(self._tags) >= MAX_TENANTS:  # tenants of earlier tokens files included
                raise DramError(f"an isolated DRAM pool serves at most {MAX_TENANTS} tenants")
            self.fd(tenant)
            tag = self._tags[tenant] = len(self._tags) + 1
        cls = geometric(stride) + tag
        self._owner[cls] = tenant
        return cls

    def tagged(self) -> set[str]:
        """The tenants given a tag so far."""
        return set(self._tags)

    def is_class(self, cls: int) -> bool:
        return cls in self._owner

    def owner(self, cls: int) -> str:
        """The tenant of class `cls`; DramError for a class no tenant has (a bare stride)."""
        tenant = self._owner.get(cls)
        if tenant is None:
            raise DramError(f"no tenant has size class {cls} (isolated pool: allocate through "
                            "the tenant's class, `DramPool.class_bytes`)")
        return tenant

    def page_owner(self, page: int) -> str | None:
        """The tenant whose file backs page `page` (None: the base file, never handed out)."""
        return self._pages[page]

    def back(self, page: int, cls: int) -> None:
        """`PageTable.backing`: page `page` joins class `cls` (0: goes back to the free
        pages). A page joining another tenant's class gets that tenant's memory, and the
        previous tenant's bytes there are dropped; a free page keeps its tenant's memory (its
        bytes are that tenant's, and the tenant taking it again costs nothing: no remap, no
        fresh zeroed pages)."""
        if not cls:
            return
        tenant = self.owner(cls)
        old = self._pages[page]
        if old == tenant:
            return
        o = self._data_offset + page * self._page_bytes
        fd = self.fd(tenant)
        self._map(fd, o)
        self._punch(self._base_fd if old is None else self._fds[old], o)
        if self._prefault:
            try:
                os.posix_fallocate(fd, o, self._page_bytes)
            except OSError as exc:
                log.warning("cannot allocate a DRAM page of tenant %r now: %s", tenant, exc)
        self._pages[page] = tenant

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
