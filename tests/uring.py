"""A long-term pin of a process's memory on CPU, for tests: an io_uring fixed buffer.

`IORING_REGISTER_BUFFERS` pins the pages under a buffer the way `cudaHostRegister` does
(FOLL_LONGTERM: the kernel holds the physical pages until the buffer is unregistered, whatever
happens to the mapping's file meanwhile), and `READ_FIXED` / `WRITE_FIXED` move bytes between a
file and those pinned pages — the kernel's view of the pin, not the process's page tables. So a
test can write into a client's mapping, or read it, exactly as a GPU's DMA engine would after a
`cudaHostRegister`, without a GPU.

    with FixedBuffer(array) as pin:           # registers array's memory (numpy uint8, contiguous)
        pin.read_into(fd, file_offset, at, n)   # file -> pinned pages at byte `at` of the buffer
        pin.write_from(fd, file_offset, at, n)  # pinned pages at `at` -> file

Raw syscalls through ctypes (x86-64 and arm64 numbers); `available()` says whether this kernel
lets this process use io_uring (it may be disabled by `kernel.io_uring_disabled` or a seccomp
filter).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
from typing import Any

_NR = {"x86_64": (425, 426, 427), "aarch64": (425, 426, 427)}
SETUP, ENTER, REGISTER = _NR.get(platform.machine(), (425, 426, 427))
REGISTER_BUFFERS, UNREGISTER_BUFFERS = 0, 1
OP_READ_FIXED, OP_WRITE_FIXED = 4, 5
ENTER_GETEVENTS = 1
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SqOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32),
                ("ring_mask", ctypes.c_uint32), ("ring_entries", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
                ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32),
                ("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32),
                ("ring_mask", ctypes.c_uint32), ("ring_entries", ctypes.c_uint32),
                ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32),
                ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("sq_thread_cpu", ctypes.c_uint32),
                ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
                ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Sqe(ctypes.Structure):
    _fields_ = [("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("ioprio", ctypes.c_uint16), ("fd", ctypes.c_int32), ("off", ctypes.c_uint64),
                ("addr", ctypes.c_uint64), ("len", ctypes.c_uint32),
                ("rw_flags", ctypes.c_uint32), ("user_data", ctypes.c_uint64),
                ("buf_index", ctypes.c_uint16), ("personality", ctypes.c_uint16),
                ("splice_fd_in", ctypes.c_int32), ("addr3", ctypes.c_uint64),
                ("pad", ctypes.c_uint64)]


class _Cqe(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint64), ("res", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"io_uring {what}: {os.strerror(err)}")
    return ret


def available() -> str | None:
    """None when io_uring works here, else why not."""
    params = _Params()
    fd = _libc.syscall(SETUP, 1, ctypes.byref(params))
    if fd < 0:
        return f"io_uring_setup: {os.strerror(ctypes.get_errno())}"
    os.close(fd)
    return None


class FixedBuffer:
    """One ring with one registered (pinned) buffer: the memory of `array` (see the module)."""

    def __init__(self, array: Any, entries: int = 8) -> None:
        self.base = int(array.ctypes.data)
        self.size = int(array.nbytes)
        self._keep = array  # the pinned memory outlives the registration
        params = _Params()
        self.fd = _check(_libc.syscall(SETUP, entries, ctypes.byref(params)), "setup")
        try:
            sq, cq = params.sq_off, params.cq_off
            self._sq = mmap.mmap(self.fd, sq.array + params.sq_entries * 4,
                                 flags=mmap.MAP_SHARED, offset=OFF_SQ_RING)
            self._cq = mmap.mmap(self.fd, cq.cqes + params.cq_entries * ctypes.sizeof(_Cqe),
                                 flags=mmap.MAP_SHARED, offset=OFF_CQ_RING)
            self._sqes = mmap.mmap(self.fd, params.sq_entries * ctypes.sizeof(_Sqe),
                                   flags=mmap.MAP_SHARED, offset=OFF_SQES)
            u32 = ctypes.c_uint32.from_buffer
            self._sq_tail, self._sq_mask = u32(self._sq, sq.tail), u32(self._sq, sq.ring_mask)
            self._sq_array = (ctypes.c_uint32 * params.sq_entries).from_buffer(self._sq,
                                                                                sq.array)
            self._cq_head, self._cq_tail = u32(self._cq, cq.head), u32(self._cq, cq.tail)
            self._cq_mask = u32(self._cq, cq.ring_mask)
            self._cqes = (_Cqe * params.cq_entries).from_buffer(self._cq, cq.cqes)
            self._sqe_array = (_Sqe * params.sq_entries).from_buffer(self._sqes)
            iov = _Iovec(self.base, self.size)
            _check(_libc.syscall(REGISTER, self.fd, REGISTER_BUFFERS, ctypes.byref(iov), 1),
                   "register buffers")
        except BaseException:
            self._close_maps()
            os.close(self.fd)
            raise

    def read_into(self, fd: int, file_offset: int, at: int, n: int) -> None:
        """`n` bytes of file `fd` from `file_offset` into the pinned pages at byte `at`."""
        self._io(OP_READ_FIXED, fd, file_offset, at, n)

    def write_from(self, fd: int, file_offset: int, at: int, n: int) -> None:
        """`n` bytes of the pinned pages at byte `at` into file `fd` at `file_offset`."""
        self._io(OP_WRITE_FIXED, fd, file_offset, at, n)

    def _io(self, op: int, fd: int, file_offset: int, at: int, n: int) -> None:
        if not 0 <= at <= at + n <= self.size:
            raise ValueError(f"{n} bytes at {at} are outside the {self.size}-byte buffer")
        done = 0
        while done < n:  # a short transfer goes on where it stopped
            tail = self._sq_tail.value
            i = tail & self._sq_mask.value
            sqe = self._sqe_array[i]
            ctypes.memset(ctypes.addressof(sqe), 0, ctypes.sizeof(_Sqe))
            sqe.opcode, sqe.fd, sqe.off = op, fd, file_offset + done
            sqe.addr, sqe.len, sqe.buf_index = self.base + at + done, n - done, 0
            self._sq_array[i] = i
            self._sq_tail.value = tail + 1
            _check(_libc.syscall(ENTER, self.fd, 1, 1, ENTER_GETEVENTS, None, 0), "enter")
            head = self._cq_head.value
            assert self._cq_tail.value != head, "io_uring: no completion"
            res = self._cqes[head & self._cq_mask.value].res
            self._cq_head.value = head + 1
            if res < 0:
                raise OSError(-res, f"io_uring op {op}: {os.strerror(-res)}")
            if res == 0:
                raise OSError(f"io_uring op {op}: end of file after {done} of {n} bytes")
            done += res

    def _close_maps(self) -> None:
        for name in ("_sq_tail", "_sq_mask", "_sq_array", "_cq_head", "_cq_tail", "_cq_mask",
                     "_cqes", "_sqe_array"):
            self.__dict__.pop(name, None)
        for name in ("_sq", "_cq", "_sqes"):
            mm = self.__dict__.pop(name, None)
            if mm is not None:
                mm.close()

    def close(self) -> None:
        """Unregisters the buffer (the pin ends) and closes the ring."""
        if self.fd < 0:
            return
        _libc.syscall(REGISTER, self.fd, UNREGISTER_BUFFERS, None, 0)
        self._close_maps()
        os.close(self.fd)
        self.fd = -1
        self._keep = None

    def __enter__(self) -> FixedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
