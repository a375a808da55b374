"""CUDA backend of the transfer engine: per job, the block-copy kernel or batched DMA.

Streams and events come from pools: one non-blocking stream per direction (loads and stores
overlap; jobs of one direction stay in order) and recycled events marking each job's end. The
path per job is chosen by a measured `Calibration` (given, loaded from
$KVTIER_TRANSFER_CALIBRATION, or measured on scratch buffers of this pool's chunk size at first
use — never a constant; a measurement serves every later backend of the process with that
device and chunk size, `measured`).

Failures: an enqueue error fails exactly the pairs of the ops (DMA) or the launch (kernel) that
failed; an error seen while waiting fails every pair of the job (CUDA errors are sticky, so
nothing of it can be trusted). A failed pair is never reported as copied.

Host slots must be device-visible: pinned memory, or a mapping registered with
`kvtier.gpu.hostmem.register` (the client does this once at attach). An unregistered numpy slot
buffer is registered here and unregistered at `close`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.gpu import dma, hostmem, kernels
from kvtier.gpu.arrays import array_info
from kvtier.gpu.cpu import Outcome
from kvtier.gpu.plan import (
    Calibration,
    Direction,
    IntArray,
    PoolGeometry,
    PoolKind,
    SlotGeometry,
    copy_ops,
    merge_runs,
    pairs_of_ops,
    sort_pairs,
)


@dataclass(slots=True)
class _Pending:
    event: Any
    ok: np.ndarray  # False for pairs that already failed at enqueue
    path: str
    error: str | None
    keep: Any  # device arrays the stream still reads


def wait_on(after: object | None, stream: Any, event: Any) -> None:
    """Make `stream` wait for `after`: a CuPy or torch event, a CuPy/torch stream, or a raw
    cudaStream_t handle (int). `event` is a scratch event recorded on a foreign stream."""
    import cupy

    if after is None:
        return
    if isinstance(after, cupy.cuda.Event):
        stream.wait_event(after)
        return
    if hasattr(after, "wait") and hasattr(after, "query") and hasattr(after, "record"):
        import torch  # a torch.cuda.Event

        after.wait(torch.cuda.ExternalStream(stream.ptr))  # type: ignore[no-untyped-call]
        return
    handle = getattr(after, "cuda_stream", None)
    if handle is None:
        handle = getattr(after, "ptr", None)
    if handle is None and isinstance(after, int):
        handle = after
    if handle is None:
        raise ValueError(f"cannot order after {type(after)!r}: pass a CUDA stream or event")
    cupy.cuda.runtime.eventRecord(event.ptr, int(handle))
    stream.wait_event(event)


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    return Calibration.from_json(json.loads(Path(path).read_text()))


@functools.cache
def measured(device: int, chunk_bytes: int) -> Calibration:
    """Kernel vs DMA rates measured on `device` at `chunk_bytes` (and larger merged runs), once
    per process: the rates depend on the device and the chunk size only, and a measurement takes
    about a second, too long to repeat for each backend."""
    from kvtier.gpu.measure import calibrate_pool

    return calibrate_pool(PoolGeometry(PoolKind.CONTIGUOUS, 1, 1, chunk_bytes, chunk_bytes))


class CudaBackend:
    name = "cuda"

    def __init__(self, pool: PoolGeometry, chunks: Sequence[Any], slots: Any,
                 slot_geom: SlotGeometry, calibration: Calibration | None = None,
                 force_path: str | None = None) -> None:
        import cupy

        if force_path not in (None, "kernel", "dma"):
            raise ValueError(f"force_path must be 'kernel' or 'dma', got {force_path!r}")
        self.force_path = force_path
        infos = [array_info(c) for c in chunks]
        if any(i.device != "cuda" for i in infos):
            raise ValueError("CUDA backend needs the pool on a CUDA device")
        self._pool, self._slots = pool, slot_geom
        self._chunk_ptrs = [i.ptr for i in infos]
        self._bases = cupy.asarray(np.array(self._chunk_ptrs, dtype=np.uint64))
        self._range_bases: dict[tuple[int, int], Any] = {}
        self._reg: hostmem.Registration | None = None
        sinfo = array_info(slots)
        if sinfo.device == "cuda":
            self._slot_ptr = sinfo.ptr
        else:
            dev = hostmem.device_pointer(sinfo.ptr)
            if dev is None:
                try:
                    self._reg = hostmem.register(slots)
                except Exception as exc:
                    raise ValueError(
                        "slot buffer is not device-mapped and could not be registered (a range "
                        "pinned without cudaHostRegisterMapped? use kvtier.gpu.hostmem.register): "
                        f"{exc}") from exc
                dev = self._reg.device_ptr
            self._slot_ptr = dev
        self._streams = {d: cupy.cuda.Stream(non_blocking=True) for d in Direction}
        self._free_events: list[Any] = []
        self._scratch_event = cupy.cuda.Event(disable_timing=True)
        env = os.environ.get("KVTIER_TRANSFER_CALIBRATION")
        self.calibration = calibration or (load_calibration(env) if env else None)

    def _event(self) -> Any:
        import cupy

        return self._free_events.pop() if self._free_events else cupy.cuda.Event(
            disable_timing=True)

    def _choose(self, direction: Direction, ops: Sequence[Any]) -> str:
        if self.force_path is not None:
            return self.force_path
        if self.calibration is None:
            import cupy

            self.calibration = measured(int(cupy.cuda.Device().id), self._pool.chunk_bytes)
        return self.calibration.choose(direction, ops)

    def _sub_pool(self, chunks: tuple[int, int] | None) -> tuple[PoolGeometry, Any, int]:
        """(geometry, device bases, slot byte offset) of chunk range `chunks` (None: all)."""
        if chunks is None:
            return self._pool, self._bases, 0
        import cupy

        lo, hi = chunks
        bases = self._range_bases.get(chunks)
        if bases is None:
            bases = self._range_bases[chunks] = cupy.asarray(
                np.array(self._chunk_ptrs[lo:hi], dtype=np.uint64))
        return replace(self._pool, n_chunks=hi - lo), bases, lo * self._pool.chunk_bytes

    def start(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
              after: object | None, chunks: tuple[int, int] | None = None) -> _Pending:
        import cupy

        n = slot_idx.size
        ok = np.ones(n, dtype=np.bool_)
        stream = self._streams[direction]
        order = sort_pairs(slot_idx, block_idx)
        pool, bases, skip = self._sub_pool(chunks)
        lo = chunks[0] if chunks is not None else 0
        ops = [op._replace(chunk=op.chunk + lo, host_off=op.host_off + skip) for op in
               copy_ops(merge_runs(slot_idx[order], block_idx[order]), pool, self._slots)]
        path, keep, error = "kernel", None, None
        try:
            path = self._choose(direction, ops)
            wait_on(after, stream, self._scratch_event)
            with stream:
                if path == "kernel":
                    keep = cupy.asarray(np.stack([slot_idx, block_idx], axis=1))
                    kernels.launch(direction, self._slot_ptr + skip, self._slots, bases,
                                   pool, keep, stream)
                else:
                    bad = dma.enqueue(direction, ops, self._slot_ptr, self._chunk_ptrs,
                                      stream.ptr)
                    if bad:
                        ok &= ~pairs_of_ops(n, order, ops, bad)
                        error = f"{len(bad)} of {len(ops)} cudaMemcpyAsync calls failed"
        except Exception as exc:
            ok[:] = False
            return _Pending(None, ok, path, f"{type(exc).__name__}: {exc}", keep)
        event = self._event()
        event.record(stream)
        return _Pending(event, ok, path, error, keep)

    def done(self, pending: _Pending) -> bool:
        return pending.event is None or bool(pending.event.done)

    def finish(self, pending: _Pending, timeout: float | None = None) -> Outcome:
        if pending.event is None:
            return Outcome(pending.ok, pending.path, pending.error)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while deadline is not None and not pending.event.done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer not finished after {timeout} s")
                time.sleep(50e-6)
            pending.event.synchronize()
        except TimeoutError:
            raise
        except Exception as exc:
            pending.ok[:] = False
            return Outcome(pending.ok, pending.path, f"{type(exc).__name__}: {exc}")
        self._free_events.append(pending.event)
        pending.keep = None
        return Outcome(pending.ok, pending.path, pending.error)

    def close(self) -> None:
        for s in self._streams.values():
            s.synchronize()
        if self._reg is not None:
            hostmem.unregister(self._reg)
            self._reg = None
