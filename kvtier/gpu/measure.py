"""GPU timing on scratch buffers: kernel vs batched DMA vs per-chunk copies vs one contiguous copy.

Shared by the CUDA backend's first-use calibration and `bench.gpu_transfer`. Scratch host memory
is an anonymous shared mapping registered with CUDA, like a client's mapping of the DRAM tier.
"""

from __future__ import annotations

import contextlib
import mmap
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.gpu import dma, hostmem, kernels
from kvtier.gpu.plan import (
    Calibration,
    CalibrationRow,
    Direction,
    PoolGeometry,
    PoolKind,
    SlotGeometry,
    copy_ops,
    merge_runs,
    per_chunk_ops,
    sort_pairs,
)


@dataclass
class Scratch:
    """A device pool of `n_chunks` tensors and a registered host slot buffer, `n` blocks each."""

    pool: PoolGeometry
    slots: SlotGeometry
    dev: Any  # cupy uint8 [n_chunks, num_blocks, chunk_bytes]
    host: np.ndarray  # uint8 [num_slots, payload]
    reg: hostmem.Registration
    mapping: mmap.mmap

    @classmethod
    def make(cls, kind: PoolKind, n_chunks: int, chunk_bytes: int, n: int) -> Scratch:
        import cupy

        pool = PoolGeometry(kind, n, n_chunks, chunk_bytes, chunk_bytes)
        slots = SlotGeometry(n, pool.payload_bytes, pool.payload_bytes)
        dev = cupy.zeros((n_chunks, n, chunk_bytes), dtype=cupy.uint8)
        mapping = mmap.mmap(-1, n * pool.payload_bytes)
        host = np.frombuffer(mapping, dtype=np.uint8).reshape(n, pool.payload_bytes)
        host[...] = 1
        return cls(pool, slots, dev, host, hostmem.register(host), mapping)

    def chunk_ptrs(self) -> list[int]:
        step = self.pool.num_blocks * self.pool.chunk_bytes
        return [int(self.dev.data.ptr) + c * step for c in range(self.pool.n_chunks)]

    def close(self) -> None:
        hostmem.unregister(self.reg)
        del self.host
        with contextlib.suppress(BufferError):  # a caller still holds a view; GC unmaps it
            self.mapping.close()


def time_on(stream: Any, fn: Callable[[], object], repeat: int = 5) -> float:
    """Median seconds of `fn` enqueued on `stream`, by CUDA events (one warm-up run first)."""
    import cupy

    fn()
    stream.synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(statistics.median(times))


def scattered_pairs(n_pairs: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random distinct slots and blocks: no two pairs adjacent on both sides by design."""
    rng = np.random.default_rng(seed)
    return (rng.permutation(n)[:n_pairs].astype(np.int64),
            rng.permutation(n)[:n_pairs].astype(np.int64))


def measure(scr: Scratch, direction: Direction, s: np.ndarray, b: np.ndarray, stream: Any,
            repeat: int = 5) -> dict[str, float]:
    """Seconds for the same pairs by: kernel, merged DMA plan, per-chunk DMA loop, and one
    contiguous cudaMemcpyAsync of the same byte count (the ceiling)."""
    import cupy

    ptrs = scr.chunk_ptrs()
    bases = cupy.asarray(np.array(ptrs, dtype=np.uint64))
    pairs = cupy.asarray(np.stack([s, b], axis=1))
    order = sort_pairs(s, b)
    merged = copy_ops(merge_runs(s[order], b[order]), scr.pool, scr.slots)
    naive = per_chunk_ops(s, b, scr.pool, scr.slots)
    nbytes = int(s.size) * scr.pool.payload_bytes
    host, dev = scr.reg.device_ptr, int(scr.dev.data.ptr)
    src, dst = (host, dev) if direction is Direction.LOAD else (dev, host)

    def ceiling() -> None:
        from cupy.cuda import runtime

        runtime.memcpyAsync(dst, src, nbytes, dma.MEMCPY_DEFAULT, stream.ptr)

    return {
        "kernel": time_on(stream, lambda: kernels.launch(
            direction, host, scr.slots, bases, scr.pool, pairs, stream), repeat),
        "dma": time_on(stream, lambda: dma.enqueue(direction, merged, host, ptrs, stream.ptr),
                       repeat),
        "loop": time_on(stream, lambda: dma.enqueue(direction, naive, host, ptrs, stream.ptr),
                        repeat),
        "ceiling": time_on(stream, ceiling, repeat),
        "bytes": float(nbytes),
    }


def calibrate_pool(pool: PoolGeometry, budget_bytes: int = 32 << 20) -> Calibration:
    """Measure kernel vs per-copy DMA throughput at this pool's chunk size and at 4x, 16x, 64x
    (merged runs make larger copies), both directions, on scratch buffers (~0.1-1 s)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    rows: list[CalibrationRow] = []
    sizes = sorted({min(pool.chunk_bytes * m, 16 << 20) for m in (1, 4, 16, 64)})
    for size in sizes:
        n = int(min(1024, max(4, budget_bytes // size)))
        scr = Scratch.make(PoolKind.CONTIGUOUS, 1, size, n)
        try:
            s, b = scattered_pairs(n, n)
            for direction in Direction:
                t = measure(scr, direction, s, b, stream, repeat=3)
                rows.append(CalibrationRow(direction, size, t["bytes"] / t["kernel"] / 1e9,
                                           t["bytes"] / t["loop"] / 1e9))
        finally:
            scr.close()
    return Calibration(tuple(rows), f"measured at first use for chunk {pool.chunk_bytes} B")
