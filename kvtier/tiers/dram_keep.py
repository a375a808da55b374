"""What a successor daemon needs to re-adopt the DRAM pool: the keep file, written by the daemon
alone, never mapped by a client.

With `keep_dram` the pool's memory outlives the daemon (a named pool is a file in /dev/shm; a
pool with tenants is memfds a holder keeps: systemd's fd store), and this file says what the
memory holds. It is a file beside the named pool (`<name>.keep`, mode 0600 whatever the pool's
group) or, with tenants, one more memfd given to the holder. Layout (little-endian):

    0         header (4096 B): magic b"KVTKEEP\\0", format VERSION, the pool's generation and
              geometry (a successor with another geometry starts cold)
    4096      regions (tenants): 256 x 128 B, one per region tag: tenant, its token's digest,
              the region's generation and pages, retired flag
    +32 KiB   page map (tenants): per global page, (region tag, the region's local page)
    records   one per global slot id (`RECORD`, 192 B): held_until, state, key width, class
              stride, payload bytes, layout id, key, parent key, tenant

A record is written at the points where a slot's meaning changes, under the pool's lock:

- Allocate: state WRITING and `held_until` = the WRITE lease's deadline (time.monotonic(),
  one clock for every process of a boot);
- the block's DRAM copy is added (Commit, a promotion, a remote fetch): every field, then
  state COMMITTED last (`commit`);
- a page move: the record copied to the target, state last, before the source is freed;
- a slot freed: state FREE first (`clear`), so a slot is never reused under a record that
  still names a block;
- Acquire/RenewLease set `held_until` to the READ lease's deadline, Release clears it when no
  lease pins the block any more.

A SIGKILL between two writes leaves a record FREE or WRITING (the block is then not adopted,
never half-adopted): state is one byte, written after the fields it vouches for and before
they change. `freeze` stops every write: a stopping daemon ends its leftover leases without
clearing what their holders may still be reading or writing.

What the records prove: a COMMITTED record names the block whose writer committed it into
that slot, and nothing reused the slot since (the daemon clears the record before it frees
the slot; clients never reach this file). It does not prove a client left a committed slot's
bytes alone after its own Commit — a running daemon serves such bytes as they are too.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvtier.core.segment import round_up

log = logging.getLogger(__name__)

MAGIC = b"KVTKEEP\0"
VERSION = 1
"""The keep file's format. A successor that reads another refuses the pool (cold start)."""
HEADER_BYTES = 4096
HEADER = struct.Struct("<8sII" + "Q" * 11)
REGION_SLOTS = 256  # one per tag (tags 1..255)
REGION = struct.Struct("<BBxxIQ32s64s")
REGION_BYTES = 128
PAGE = struct.Struct("<II")
REGIONS_OFFSET = HEADER_BYTES
PAGES_OFFSET = REGIONS_OFFSET + REGION_SLOTS * REGION_BYTES

FREE, COMMITTED, WRITING = 0, 1, 2
RECORD_BYTES = 192
STATE_AT = 8
BODY = struct.Struct("<BBBII4x32s32s32s64s")  # at offset 9: key width .. tenant
BODY_AT = 9
RECORD = np.dtype({
    "names": ["held", "state", "kw", "has_parent", "tenant_len", "stride", "nbytes",
              "layout", "key", "parent", "tenant"],
    "formats": ["<f8", "u1", "u1", "u1", "u1", "<u4", "<u4", ("u1", 32), ("u1", 32),
                ("u1", 32), ("u1", 64)],
    "offsets": [0, 8, 9, 10, 11, 12, 16, 24, 56, 88, 120],
    "itemsize": RECORD_BYTES,
})
NAME = "kvtier-keep"
"""The keep memfd's name in the holder (a pool with tenants)."""


def is_ours(name: str) -> bool:
    """Whether an fd the holder gave back by `name` is a pool's (`NAME`, `region_fd_name`)."""
    return name == NAME or name.startswith("kvtier-dram-")


def token_key(digest: bytes) -> bytes:
    """What a keep file records of a tenant's token (its SHA-256 digest, hashed once more)."""
    return hashlib.sha256(b"kvtier-keep/v1\0" + digest).digest()


def region_fd_name(generation: int) -> str:
    """A tenant region's memfd's name in the holder (its generation, unique for a boot)."""
    return f"kvtier-dram-{generation:016x}"


class Refused(Exception):
    """A kept pool this daemon cannot adopt; the message says why (it starts cold)."""


class Holder(Protocol):
    """What keeps a pool's memfds across the daemon's restart (systemd's fd store,
    `kvtier.daemon.sdnotify.FdStore`). Both calls are best effort and never raise."""

    def keep(self, name: str, fd: int) -> None: ...

    def forget(self, name: str) -> None: ...


@dataclass
class Keeper:
    """What a starting daemon with `keep_dram` gives its pool: `adopt` — a dead daemon's named
    pool may be adopted (`kvtier.tiers.segment_owner` found its owner gone); `fds` — the memfds
    the holder gave back, by name (taken over: adopted, or released and closed); `keys` — each
    tenant's token fingerprint now (a region whose tenant's token changed is not adopted: a
    client of the old token may still map it); `holder` — None when nothing keeps memfds."""

    adopt: bool = False
    fds: dict[str, int] = field(default_factory=dict)
    keys: dict[str, bytes] = field(default_factory=dict)
    holder: Holder | None = None


class Geometry(NamedTuple):
    """The pool's shape a keep file is valid for (a successor's must be the same)."""

    isolated: int
    generation: int
    slot_ids: int
    page_count: int
    page_bytes: int
    slot_size: int
    slot_stride: int
    data_offset: int
    pool_size: int  # the named segment's size (0 with tenants: each region has its own)

    def file_bytes(self) -> int:
        return self.records_offset() + self.slot_ids * RECORD_BYTES

    def records_offset(self) -> int:
        return round_up(PAGES_OFFSET + self.page_count * PAGE.size, 4096)

    def differs(self, other: Geometry) -> str:
        """What `other` (a kept file's) has that this pool has not ("" when equal but for the
        generation, which is the kept pool's)."""
        for name in ("isolated", "slot_ids", "page_count", "page_bytes", "slot_size",
                     "slot_stride", "data_offset", "pool_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {theirs}, this daemon's pool has {mine}"
        return ""


class KeptBlock(NamedTuple):
    """A COMMITTED record: a block in `slot` (global slot id)."""

    slot: int
    stride: int
    nbytes: int
    tenant: str
    layout_id: bytes
    key: bytes
    parent: bytes | None
    held_until: float


class KeptRegion(NamedTuple):
    """A tenant region the keep file lists (pool with tenants)."""

    tag: int
    tenant: str
    digest: bytes
    generation: int
    pages: int
    retired: bool
    home: list[int]  # local page -> global page (-1: none yet)


@dataclass(frozen=True, slots=True)
class Kept:
    """What a keep file says (`KeepFile.read`): the blocks, the slots held for writing
    (slot, class stride, tenant, deadline) and, with tenants, the regions."""

    geometry: Geometry
    blocks: list[KeptBlock]
    writing: list[tuple[int, int, str, float]]
    regions: list[KeptRegion]


def _fixed(raw: bytes, n: int) -> bytes:
    return raw.ljust(n, b"\0")


class KeepFile:
    """One keep file mapped read/write (the daemon's; the pool calls it under its lock)."""

    def __init__(self, fd: int, geometry: Geometry, path: str = "") -> None:
        """Maps the file at `fd` (taken over), which holds `geometry` (`create` wrote it or
        `read` checked it). `path`: its name in /dev/shm (a named pool's), "" for a memfd."""
        self.fd = fd
        self.path = path
        self.geometry = geometry
        self.mm = mmap.mmap(fd, geometry.file_bytes(), flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._records_at = geometry.records_offset()
        self._recs = np.frombuffer(self.mm, dtype=RECORD, count=geometry.slot_ids,
                                   offset=self._records_at)
        self._held: npt.NDArray[np.float64] = self._recs["held"]
        self.frozen = False

    @classmethod
    def create(cls, geometry: Geometry, path: str = "") -> KeepFile:
        """A new keep file for a pool of `geometry`: at `path` (O_EXCL, 0600; an old one there
        is replaced) or, with no path, a memfd."""
        if path:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                os.unlink(path)
                fd = os.open(path, flags, 0o600)
        else:
            fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, geometry.file_bytes())
            os.pwrite(fd, HEADER.pack(MAGIC, VERSION, *geometry,
                                      RECORD_BYTES, geometry.records_offset(), 0), 0)
            return cls(fd, geometry, path)
        except BaseException:
            os.close(fd)
            if path:
                os.unlink(path)
            raise

    @classmethod
    def read(cls, fd: int, want: Geometry, path: str = "") -> tuple[KeepFile, Kept]:
        """Maps a kept file (`fd` taken over) and reads what it holds; `Refused` (fd closed)
        when it is of another format or geometry than `want` (whose generation is ignored:
        the kept pool's is the one that counts)."""
        try:
            raw = os.pread(fd, HEADER.size, 0)
            if len(raw) < HEADER.size:
                raise Refused("its keep file is truncated")
            magic, version, *fields = HEADER.unpack(raw)
            if magic != MAGIC:
                raise Refused("its keep file is not one (no magic)")
            if version != VERSION:
                raise Refused(f"its keep file has format {version}; this kvtier reads format "
                              f"{VERSION}")
            kept = Geometry(*fields[:9])
            why = want.differs(kept)
            if why:
                raise Refused(f"the kept pool has {why}")
            if fields[9] != RECORD_BYTES or fields[10] != kept.records_offset():
                raise Refused("its keep file's records are laid out otherwise")
            if os.fstat(fd).st_size < kept.file_bytes():
                raise Refused("its keep file is truncated")
            f = cls(fd, kept, path)
        except BaseException:
            os.close(fd)
            raise
        return f, f._scan()

    def _scan(self) -> Kept:
        recs = self._recs
        blocks: list[KeptBlock] = []
        idx = np.flatnonzero(recs["state"] == COMMITTED)
        sub = recs[idx]  # the committed records, copied: columns read at C speed
        names: dict[bytes, str | None] = {}
        for s, kw, n, has_parent, stride, nbytes, held, layout, key, parent, tenant in zip(
                idx.tolist(), sub["kw"].tolist(), sub["tenant_len"].tolist(),
                sub["has_parent"].tolist(), sub["stride"].tolist(), sub["nbytes"].tolist(),
                sub["held"].tolist(), sub["layout"], sub["key"], sub["parent"], sub["tenant"],
                strict=True):
            if kw not in (16, 32) or not 0 < n <= 64:
                continue  # not a record this format writes: not adopted
            raw = tenant[:n].tobytes()
            if raw not in names:
                try:
                    names[raw] = raw.decode("ascii")
                except UnicodeDecodeError:
                    names[raw] = None
            name = names[raw]
            if name is None:
                continue
            blocks.append(KeptBlock(s, stride, nbytes, name, layout.tobytes(),
                                    key[:kw].tobytes(),
                                    parent[:kw].tobytes() if has_parent else None, held))
        writing: list[tuple[int, int, str, float]] = []
        for s in np.flatnonzero(recs["state"] == WRITING).tolist():
            r = recs[s]
            n = int(r["tenant_len"])
            try:
                tenant = r["tenant"][:n].tobytes().decode("ascii")
            except UnicodeDecodeError:
                continue
            writing.append((s, int(r["stride"]), tenant, float(r["held"])))
        regions: list[KeptRegion] = []
        pages = self.geometry.page_count
        if self.geometry.isolated:
            homes: dict[int, list[int]] = {}
            for g in range(pages):
                tag, local = PAGE.unpack_from(self.mm, PAGES_OFFSET + g * PAGE.size)
                if tag:
                    homes.setdefault(tag, []).append((local << 32) | g)
            for tag in range(1, REGION_SLOTS):
                t, retired, count, gen, digest, name = REGION.unpack_from(
                    self.mm, REGIONS_OFFSET + tag * REGION_BYTES)
                if t != tag:
                    continue
                home = [-1] * count
                for v in homes.get(tag, ()):
                    local, g = v >> 32, v & 0xFFFFFFFF
                    if local < count:
                        home[local] = g
                try:
                    tenant = name.rstrip(b"\0").decode("ascii")
                except UnicodeDecodeError:
                    continue
                regions.append(KeptRegion(tag, tenant, digest, gen, count, bool(retired), home))
        return Kept(self.geometry, blocks, writing, regions)

    # -- records (the pool calls these under its lock) ------------------------------------

    def _at(self, slot: int) -> int:
        return self._records_at + slot * RECORD_BYTES

    def commit(self, slot: int, stride: int, nbytes: int, tenant: str, layout_id: bytes,
               key: bytes, parent: bytes | None) -> None:
        """`slot` now holds the block: every field, then state COMMITTED."""
        if self.frozen:
            return
        at = self._at(slot)
        name = tenant.encode("ascii")
        BODY.pack_into(self.mm, at + BODY_AT, len(key), parent is not None, len(name), stride,
                       nbytes, _fixed(layout_id, 32), _fixed(key, 32),
                       _fixed(parent or b"", 32), _fixed(name, 64))
        self.mm[at + STATE_AT] = COMMITTED

    def writing(self, slots: list[int], stride: int, tenant: str, until: float) -> None:
        """`slots` (of class `stride`) are `tenant`'s WRITE lease's until `until`: state
        WRITING (their writer may still fill them after this daemon is gone: a successor
        holds them until then)."""
        if self.frozen or not slots:
            return
        idx = np.asarray(slots, dtype=np.int64)
        name = tenant.encode("ascii")
        recs = self._recs
        recs["stride"][idx] = stride
        recs["tenant_len"][idx] = len(name)
        recs["tenant"][idx] = np.frombuffer(_fixed(name, 64), dtype=np.uint8)
        self._held[idx] = until
        recs["state"][idx] = WRITING

    def hold(self, slots: list[int], until: float) -> None:
        """A READ lease on the blocks in `slots` lasts until `until` (the latest one counts)."""
        if self.frozen or not slots:
            return
        idx = np.asarray(slots, dtype=np.int64)
        self._held[idx] = np.maximum(self._held[idx], until)

    def unhold(self, slots: list[int]) -> None:
        """No lease holds the blocks in `slots` any more."""
        if self.frozen or not slots:
            return
        self._held[np.asarray(slots, dtype=np.int64)] = 0.0

    def clear(self, slot: int) -> None:
        """`slot` holds no block from now on: state FREE first."""
        if self.frozen:
            return
        at = self._at(slot)
        self.mm[at + STATE_AT] = FREE
        self._held[slot] = 0.0

    def move(self, old: int, new: int) -> None:
        """A page move put `old`'s block in `new` (copied): the record follows, state last;
        the caller then frees `old` (`clear`)."""
        if self.frozen:
            return
        src, dst = self._at(old), self._at(new)
        self.mm[dst + BODY_AT : dst + RECORD_BYTES] = self.mm[src + BODY_AT : src + RECORD_BYTES]
        self._held[new] = self._held[old]
        self.mm[dst + STATE_AT] = self.mm[src + STATE_AT]

    def set_region(self, tag: int, tenant: str, digest: bytes, generation: int, pages: int,
                   retired: bool) -> None:
        if self.frozen:
            return
        REGION.pack_into(self.mm, REGIONS_OFFSET + tag * REGION_BYTES, tag, retired, pages,
                         generation, _fixed(digest, 32), _fixed(tenant.encode("ascii"), 64))

    def drop_region(self, tag: int) -> None:
        if self.frozen:
            return
        self.mm[REGIONS_OFFSET + tag * REGION_BYTES] = 0

    def set_page(self, page: int, tag: int, local: int) -> None:
        """Global page `page` is local page `local` of region `tag` (0: of none)."""
        if self.frozen:
            return
        PAGE.pack_into(self.mm, PAGES_OFFSET + page * PAGE.size, tag, local)

    def reset_regions(self) -> None:
        """No region, no page: the table a fresh pool with tenants starts from."""
        if self.frozen:
            return
        self.mm[REGIONS_OFFSET : self._records_at] = bytes(self._records_at - REGIONS_OFFSET)

    def committed(self) -> int:
        """COMMITTED records now."""
        return int(np.count_nonzero(self._recs["state"] == COMMITTED))

    def clear_others(self, keep: set[int]) -> None:
        """Every record of a slot not in `keep` is FREE (what a successor did not adopt must
        never be adopted later, in memory it no longer describes)."""
        state = self._recs["state"]
        mask = state != FREE
        idx = np.flatnonzero(mask)
        if keep:
            idx = idx[~np.isin(idx, np.fromiter(keep, dtype=np.int64, count=len(keep)))]
        state[idx] = FREE
        self._held[idx] = 0.0

    def set_generation(self, generation: int) -> None:
        if self.frozen:
            return
        struct.pack_into("<Q", self.mm, 16, generation)

    def freeze(self) -> None:
        """No more writes (a stopping daemon: see the module docstring)."""
        self.frozen = True

    def close(self, unlink: bool) -> None:
        """Unmaps and closes; `unlink` removes a named keep file (a pool not kept)."""
        del self._held, self._recs
        try:
            self.mm.close()
        except BufferError:
            log.debug("the keep file is still viewed; unmapped when its views go")
        os.close(self.fd)
        if unlink and self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def keep_path(pool_path: str) -> str:
    """Where a named pool's keep file lives."""
    return pool_path + ".keep"
