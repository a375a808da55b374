"""CPU reference backend of the transfer engine: numpy fancy indexing over byte views.

Used where no GPU exists, and as the reference the CUDA kernels must equal bit for bit. Pool chunks
may be numpy arrays or CPU torch tensors of any dtype (fp32, bf16, fp16, fp8, ...): everything is
viewed as bytes, so a copy can never convert or round a value.

Threading: one worker thread per backend executes jobs in submission order (the CPU analogue of a
CUDA stream); `start` returns at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.gpu.plan import Copy, Direction, IntArray, PoolGeometry, SlotGeometry

U8 = npt.NDArray[np.uint8]
BoolArray = npt.NDArray[np.bool_]


def host_bytes(x: Any) -> U8:
    """A uint8 numpy view sharing memory with a numpy array or CPU torch tensor (any dtype).

    The last dimension must be contiguous; the view has the same leading dimensions and a last
    dimension of `shape[-1] * itemsize` bytes.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "data_ptr") and hasattr(x, "numpy"):
        if x.device.type != "cpu":
            raise ValueError(f"CPU backend needs CPU tensors, got device {x.device}")
        import torch

        if x.ndim and x.stride(-1) != 1:
            raise ValueError("tensor's last dimension must be contiguous")
        arr = x.detach().view(torch.uint8).numpy()
    else:
        raise ValueError(f"CPU backend takes numpy arrays or torch CPU tensors, got {type(x)!r}")
    if arr.ndim and arr.strides[-1] != arr.itemsize:
        raise ValueError("array's last dimension must be contiguous")
    if arr.ndim == 0:
        raise ValueError("scalar is not a buffer")
    return arr.view(np.uint8)


def chunk_bytes_view(x: Any, pool: PoolGeometry) -> U8:
    """[num_blocks, chunk_bytes] uint8 view of one pool chunk tensor (validated by the caller)."""
    raw = host_bytes(x)
    return np.lib.stride_tricks.as_strided(
        raw, shape=(pool.num_blocks, pool.chunk_bytes), strides=(pool.block_stride, 1)
    )


def slot_rows_view(slots: Any, geom: SlotGeometry) -> U8:
    """[num_slots, slot_bytes] uint8 view of the slot buffer."""
    raw = host_bytes(slots)
    return np.lib.stride_tricks.as_strided(
        raw, shape=(geom.num_slots, geom.slot_bytes), strides=(geom.slot_stride, 1)
    )


def flat_span(view2d: U8) -> U8:
    """1-D byte view over the whole span a strided [rows, width] view touches."""
    rows, width = view2d.shape
    n = (rows - 1) * view2d.strides[0] + width if rows else 0
    return np.lib.stride_tricks.as_strided(view2d, shape=(n,), strides=(1,))


def reference_copy(direction: Direction, slot_rows: U8, chunks: Sequence[U8], pool: PoolGeometry,
                   slot_idx: IntArray, block_idx: IntArray) -> None:
    """The reference semantics: for every pair i and chunk c, copy chunk_bytes between
    slot_rows[slot_idx[i], c*chunk_bytes:...] and chunks[c][block_idx[i]]."""
    cb = pool.chunk_bytes
    for c, view in enumerate(chunks):
        part = slot_rows[:, c * cb:(c + 1) * cb]
        if direction is Direction.LOAD:
            view[block_idx] = part[slot_idx]
        else:
            part[slot_idx] = view[block_idx]


def copy_loop(direction: Direction, slot_rows: U8, chunks: Sequence[U8], pool: PoolGeometry,
              slot_idx: IntArray, block_idx: IntArray) -> None:
    """Same result as `reference_copy`, one slice copy per (pair, chunk): the naive baseline."""
    cb = pool.chunk_bytes
    for s, b in zip(slot_idx.tolist(), block_idx.tolist(), strict=True):
        for c, view in enumerate(chunks):
            if direction is Direction.LOAD:
                view[b] = slot_rows[s, c * cb:(c + 1) * cb]
            else:
                slot_rows[s, c * cb:(c + 1) * cb] = view[b]


def execute_ops(direction: Direction, ops: Sequence[Copy], slot_flat: U8,
                chunk_flats: Sequence[U8]) -> None:
    """Run a DMA plan (kvtier.gpu.plan.copy_ops) with numpy: proves the plan on CPU."""
    for op in ops:
        host = np.lib.stride_tricks.as_strided(
            slot_flat[op.host_off:], shape=(op.height, op.width), strides=(op.host_pitch, 1))
        dev = np.lib.stride_tricks.as_strided(
            chunk_flats[op.chunk][op.dev_off:], shape=(op.height, op.width),
            strides=(op.dev_pitch, 1))
        if direction is Direction.LOAD:
            dev[...] = host
        else:
            host[...] = dev


class Outcome:
    """Per-pair result of one job: `ok[i]` is True only if pair i was copied completely."""

    __slots__ = ("done_at", "error", "ok", "path")

    def __init__(self, ok: BoolArray, path: str, error: str | None,
                 done_at: float | None = None) -> None:
        self.ok, self.path, self.error = ok, path, error
        self.done_at = done_at
        """time.perf_counter() when the copies ended, where the backend knows it."""


def _wait_after(after: object | None) -> None:
    if after is None:
        return
    wait: Callable[[], object] | None = getattr(after, "wait", None) or getattr(
        after, "synchronize", None)
    if wait is None:
        raise ValueError(f"cannot wait on {type(after)!r}: needs .wait() or .synchronize()")
    if wait() is False:
        raise RuntimeError("the event to wait on was not set")


class CpuBackend:
    """Reference backend. A failed batch is retried pair by pair, so exactly the pairs whose copy
    raised are reported failed; the others are complete."""

    name = "cpu"

    def __init__(self, pool: PoolGeometry, chunks: Sequence[Any], slots: Any,
                 slot_geom: SlotGeometry) -> None:
        self._pool = pool
        self._chunks = [chunk_bytes_view(c, pool) for c in chunks]
        self._rows = slot_rows_view(slots, slot_geom)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-xfer")

    def copy(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
             chunks: tuple[int, int] | None = None) -> None:
        """Copy a batch of pairs (only chunks [lo, hi) with `chunks`); raises if any copy fails
        (override point for fault tests)."""
        if chunks is None:
            reference_copy(direction, self._rows, self._chunks, self._pool, slot_idx, block_idx)
            return
        lo, hi = chunks
        rows = self._rows[:, lo * self._pool.chunk_bytes:]
        reference_copy(direction, rows, self._chunks[lo:hi], self._pool, slot_idx, block_idx)

    def _copy(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
              chunks: tuple[int, int] | None) -> None:
        if chunks is None:  # subclasses overriding copy(direction, slots, blocks) keep working
            self.copy(direction, slot_idx, block_idx)
        else:
            self.copy(direction, slot_idx, block_idx, chunks)

    def _run(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
             after: object | None, chunks: tuple[int, int] | None = None) -> Outcome:
        ok = np.zeros(slot_idx.size, dtype=np.bool_)
        try:
            _wait_after(after)
        except Exception as exc:
            return Outcome(ok, self.name, f"wait failed: {exc}")
        try:
            self._copy(direction, slot_idx, block_idx, chunks)
            ok[:] = True
            return Outcome(ok, self.name, None, time.perf_counter())
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}"
        for i in range(slot_idx.size):
            try:
                self._copy(direction, slot_idx[i:i + 1], block_idx[i:i + 1], chunks)
                ok[i] = True
            except Exception:
                ok[i] = False
        return Outcome(ok, self.name, first, time.perf_counter())

    def start(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
              after: object | None, chunks: tuple[int, int] | None = None) -> Future[Outcome]:
        return self._worker.submit(self._run, direction, slot_idx, block_idx, after, chunks)

    def done(self, pending: Future[Outcome]) -> bool:
        return pending.done()

    def finish(self, pending: Future[Outcome], timeout: float | None = None) -> Outcome:
        return pending.result(timeout)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
