"""Pinning host memory (e.g. the DRAM tier's shm mapping) so kernels and DMA reach it directly.

`register(buf)` wraps cudaHostRegister(Portable | Mapped): the pages are pinned and mapped into
the device address space, so one kernel launch can read or write any slot over PCIe. Register a
mapping once at attach and unregister it before unmapping it; registration is per process.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

PORTABLE, MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped


class Registration(NamedTuple):
    host_ptr: int
    device_ptr: int
    nbytes: int


def buffer_span(buf: Any) -> tuple[int, int]:
    """(address, bytes) of a numpy array's whole strided span, or of any writable buffer."""
    if isinstance(buf, np.ndarray):
        if buf.size == 0:
            raise ValueError("cannot register an empty buffer")
        hi = sum((d - 1) * s for d, s in zip(buf.shape, buf.strides, strict=True) if s > 0)
        return buf.ctypes.data, hi + buf.itemsize
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def device_pointer(host_ptr: int) -> int | None:
    """The device address of registered/pinned host memory, or None if it is not pinned."""
    from cupy.cuda import runtime

    try:
        attrs = runtime.pointerGetAttributes(host_ptr)
    except runtime.CUDARuntimeError:
        return None
    ptr = int(attrs.devicePointer)
    return ptr or None


def register(buf: Any) -> Registration:
    """Pin and map `buf`; raises CUDARuntimeError if the driver refuses."""
    from cupy.cuda import runtime

    ptr, nbytes = buffer_span(buf)
    runtime.hostRegister(ptr, nbytes, PORTABLE | MAPPED)
    dev = device_pointer(ptr)
    if dev is None:
        runtime.hostUnregister(ptr)
        raise RuntimeError("registered host memory has no device mapping")
    return Registration(ptr, dev, nbytes)


def unregister(reg: Registration) -> None:
    from cupy.cuda import runtime

    runtime.hostUnregister(reg.host_ptr)
