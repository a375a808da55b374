"""A process's mapping of the daemon's DRAM slot pool (`kvtier.tiers.dram`): attach by name, size
and generation — or, to a daemon with tenants, by the fd its fd socket hands this client's tenant
(`fetch_fd`) — zero-copy slot views, optional CUDA registration. See `kvtier.tiers.dram` for the
segment layout and the trust boundary.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.core.segment import (
    FD_MESSAGE_MAX,
    STATE_LIVE,
    DramError,
    SegmentHandle,
    StaleSegment,
    check_attach,
    fd_request,
    parse_fd_reply,
    unpack_header,
)

U8Array = npt.NDArray[np.uint8]

log = logging.getLogger(__name__)


class DramClient:
    """A process's read/write mapping of the daemon's pool. It never allocates nor unlinks.

    Slots are addressed by the offsets/slot numbers the daemon hands out under leases; reading a
    slot outside a lease, or writing one the daemon did not allocate to this client, races with
    the daemon and is the caller's bug.
    """

    def __init__(self, handle: SegmentHandle, writable: bool = True, fd: int | None = None
                 ) -> None:
        """Maps the segment file `handle` names, or with `fd` (taken over: closed here) the
        file it is (a tenant's memory from `fetch_fd`)."""
        self.handle = handle
        if fd is None:
            path = os.path.join(handle.shm_dir, handle.name)
            try:
                fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
            except FileNotFoundError:
                raise StaleSegment(f"no shared-memory segment {path}") from None
        else:
            path = f"the daemon's fd for pool {handle.name}"
        try:
            if os.fstat(fd).st_size != handle.size:
                raise StaleSegment(f"{path} has size {os.fstat(fd).st_size}, not {handle.size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(fd, handle.size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        try:
            check_attach(unpack_header(self._mm), handle, path)
        except StaleSegment:
            self._mm.close()
            raise
        self._buf: U8Array = np.frombuffer(self._mm, dtype=np.uint8)
        if not writable:
            self._buf.flags.writeable = False
        self._cuda: Any = None  # kvtier.gpu.hostmem.Registration once registered

    @classmethod
    def attach(cls, handle: SegmentHandle, writable: bool = True) -> DramClient:
        return cls(handle, writable)

    @classmethod
    def attach_fd(cls, handle: SegmentHandle, fd_socket: str, token: str,
                  writable: bool = True) -> DramClient:
        """Maps the memory the daemon's fd socket hands this token's tenant (`fetch_fd`)."""
        return cls(handle, writable, fetch_fd(fd_socket, token))

    def is_live(self) -> bool:
        """False once the daemon closed this pool (the mapping itself stays valid)."""
        h = unpack_header(self._mm)
        return h.state == STATE_LIVE and h.generation == self.handle.generation

    def view(self, slot: int, nbytes: int | None = None) -> U8Array:
        h = self.handle
        if not 0 <= slot < h.slot_count:
            raise DramError(f"slot {slot} out of range")
        o = h.data_offset + slot * h.slot_stride
        return self._buf[o : o + (h.slot_size if nbytes is None else nbytes)]

    def view_at(self, offset: int, nbytes: int) -> U8Array:
        """The `nbytes` at segment byte `offset` (a block the daemon placed there)."""
        h = self.handle
        if offset < h.data_offset or nbytes < 0 or offset + nbytes > h.size:
            raise DramError(f"{nbytes} bytes at offset {offset} are outside the pool")
        return self._buf[offset : offset + nbytes]

    def views_at(self, offsets: Sequence[int], nbytes: int) -> list[U8Array]:
        """`view_at` of each offset (a reply's blocks: the bounds checked once, by the lowest
        and highest; one outside raises as `view_at` does for the first such)."""
        if not offsets:
            return []
        h = self.handle
        if min(offsets) < h.data_offset or nbytes < 0 or max(offsets) + nbytes > h.size:
            return [self.view_at(o, nbytes) for o in offsets]
        buf = self._buf
        return [buf[o : o + nbytes] for o in offsets]

    @property
    def buffer(self) -> U8Array:
        """The whole mapped segment as one uint8 array (header included); a block the daemon
        placed at offset o is `buffer[o : o + block_bytes]` (a size class of stride s: row
        (o - data_offset) // s of its grid). Valid until `close()`."""
        return self._buf

    def register_cuda(self) -> bool:
        """Pin the whole mapping and map it into the device address space (cudaHostRegister
        Portable|Mapped, via `kvtier.gpu.hostmem.register`), so DMA and kernels reach every slot.
        Idempotent; False (logged) without cupy, a GPU, or when the driver refuses."""
        if self._cuda is not None:
            return True
        try:
            import cupy  # noqa: F401
        except ImportError:
            log.info("cupy not installed; DRAM pool not registered with CUDA")
            return False
        from kvtier.gpu import hostmem

        try:
            self._cuda = hostmem.register(self._buf)
        except Exception as exc:  # any CUDA error: no device, no driver, registration refused
            log.warning("CUDA host registration of the DRAM pool failed: %s", exc)
            return False
        return True

    @property
    def cuda_registration(self) -> Any:
        """The `kvtier.gpu.hostmem.Registration` from `register_cuda`, or None."""
        return self._cuda

    def close(self) -> None:
        if self._cuda is not None:
            from kvtier.gpu import hostmem

            try:
                hostmem.unregister(self._cuda)
            except Exception as exc:
                log.warning("CUDA host unregistration failed: %s", exc)
            self._cuda = None
        del self._buf
        try:
            self._mm.close()
        except BufferError:
            log.debug("DRAM segment still viewed by callers; unmapped when their views go")

    def __enter__(self) -> DramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_fd(fd_socket: str, token: str, timeout: float = 5.0) -> int:
    """The fd of this token's tenant's DRAM memory from a daemon's fd socket
    (`kvtier.core.segment`: request line, JSON reply, SCM_RIGHTS). StaleSegment when the daemon
    refuses (a wrong token) or sends no fd; OSError when nothing answers. A full listen backlog
    (a burst of connections: EAGAIN at once on a Unix socket) is tried again until `timeout`."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        pause = 0.005
        while True:
            try:
                s.connect(fd_socket)
                break
            except BlockingIOError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        s.sendall(fd_request(token))
        line, fds = b"", []
        while not line.endswith(b"\n") and len(line) < FD_MESSAGE_MAX:
            got, more, _, _ = socket.recv_fds(s, FD_MESSAGE_MAX, 1)
            fds.extend(more)
            if not got:
                break
            line += got
    try:
        parse_fd_reply(line)
        if len(fds) != 1:
            raise StaleSegment(f"the daemon sent {len(fds)} fds, not 1")
    except StaleSegment:
        for fd in fds:
            os.close(fd)
        raise
    os.set_inheritable(fds[0], False)
    return fds[0]
