"""Transfer engine: moves KV blocks between DRAM slots and an engine's paged KV pool.

    engine = TransferEngine(KVPool.layered(k_caches, v_caches), slots)
    h = engine.submit(TransferJob(Direction.LOAD, slots=[4, 9], blocks=[0, 1]))
    res = engine.wait(h)            # or engine.poll() -> finished results, in any order
    res.ok                          # per pair: True only if that block was copied completely

Backends: "cpu" (kvtier.gpu.cpu, numpy/torch CPU, the reference) and "cuda"
(kvtier.gpu.backend: CuPy kernels or batched cudaMemcpyAsync, chosen per plan from a measured
Calibration). "auto" picks "cuda" when the pool lives on a GPU. CPU-only code never imports CuPy.

## Slot layout contract (shared with kvtier.tiers.dram clients and the reference engine)

The slot buffer is a uint8 array `[num_slots, slot_bytes]` (rows may be `slot_stride >=
slot_bytes` apart), normally a view of the daemon's shared-memory segment. A block occupies the
first `n_chunks * chunk_bytes` bytes of its slot; the rest of the slot is never read or written.

    layout (a) LAYERED, L layers, pool tensors K_l, V_l of shape [num_blocks, T, H, D], dtype d:
        chunk_bytes = T * H * D * sizeof(d)          (one layer's K, or V, of one block)
        slot = [K_0 | V_0 | K_1 | V_1 | ... | K_{L-1} | V_{L-1}]   chunk c = 2*layer + (0 K, 1 V)
        each chunk holds the block's [T, H, D] values in C order, native-endian, raw bytes.
    layout (b) CONTIGUOUS, one pool tensor whose block b is one contiguous region of B bytes:
        slot = the block's B bytes, unchanged.
    layout (c) PAGED, n chunk tensors P_0..P_{n-1} of equal shape [num_blocks, ...], dtype and
        block stride, each block's chunk one contiguous run of chunk_bytes:
        slot = [P_0[b] | P_1[b] | ... | P_{n-1}[b]]   (vLLM's per-layer pages, see
        kvtier.integrations.vllm.pages: one chunk per layer, or per head group of a layer).

Llama-3-8B bf16, 16-token blocks: chunk = 16*8*128*2 B = 32 KiB (one layer's K or V);
2*32 = 64 chunks; 64 * 32 KiB = 2 MiB per slot. Bytes are copied verbatim, so a block stored
from one pool loads bit-exact into any pool of the same layout, dtype and chunk shape (the layout
fingerprint in the key covers it).

## Contracts

- Pairs: `slots[i]` <-> `blocks[i]`, any order. A repeated destination (pool block for LOAD, slot
  for STORE) is a ValueError; repeated sources are fine. Invalid input raises ValueError at
  `submit` and nothing is written.
- Failures: a pair whose copy did not complete is reported `ok=False`; a failed copy is never
  reported as loaded. The engine recomputes failed LOAD blocks; a client aborts failed STORE slots.
- Chunk ranges: a job with `chunks=(lo, hi)` copies only chunks lo..hi-1 of each pair (one
  layer of a PAGED pool, say); the rest of the slot and block is untouched. `ok[i]` then means
  those chunks of pair i were copied completely.
- Ordering: jobs in one direction run in submission order. `after` (a CUDA stream or event, or on
  CPU any object with `.wait()`) is waited on before the job's copies start; pass the engine's
  compute stream so a STORE never reads a block the model is still writing. A LOAD's pool blocks
  may be read once its result is returned by `poll` or `wait`.
- Lifetimes: the pool tensors and slot buffer must outlive the engine; slots named in an unfinished
  job must stay leased. Threading: one thread drives an engine.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvtier.gpu.arrays import ArrayInfo, array_info
from kvtier.gpu.plan import (
    Calibration,
    Direction,
    IntArray,
    PoolGeometry,
    PoolKind,
    SlotGeometry,
    check_geometry,
    check_pairs,
)

__all__ = [
    "ArrayInfo", "Direction", "KVPool", "PoolKind", "TransferEngine", "TransferHandle",
    "TransferJob", "TransferResult", "array_info", "slot_geometry",
]


@dataclass(frozen=True)
class KVPool:
    """The engine's pool as chunk tensors.

    LAYERED chunks are [K_0, V_0, K_1, V_1, ...], each [num_blocks, block_tokens, kv_heads,
    head_dim]; CONTIGUOUS is one tensor with blocks on dim 0.
    """

    kind: PoolKind
    chunks: tuple[Any, ...]

    @classmethod
    def layered(cls, k_caches: Sequence[Any], v_caches: Sequence[Any]) -> KVPool:
        if len(k_caches) != len(v_caches) or not k_caches:
            raise ValueError(f"need one V per K tensor: {len(k_caches)} K, {len(v_caches)} V")
        pairs = zip(k_caches, v_caches, strict=True)
        return cls(PoolKind.LAYERED, tuple(t for kv in pairs for t in kv))

    @classmethod
    def stacked(cls, kv_caches: Sequence[Any]) -> KVPool:
        """vLLM flash-attn caches: one [2, num_blocks, T, H, D] tensor per layer."""
        for i, kv in enumerate(kv_caches):
            if len(kv.shape) != 5 or kv.shape[0] != 2:
                raise ValueError(f"layer {i}: expected [2, blocks, T, H, D], got {tuple(kv.shape)}")
        return cls.layered([kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches])

    @classmethod
    def contiguous(cls, pool: Any) -> KVPool:
        return cls(PoolKind.CONTIGUOUS, (pool,))

    @classmethod
    def paged(cls, chunks: Sequence[Any]) -> KVPool:
        """Layout (c): chunk tensors [num_blocks, ...] laid back to back in each slot."""
        if not chunks:
            raise ValueError("a paged pool needs at least one chunk tensor")
        return cls(PoolKind.PAGED, tuple(chunks))

    def geometry(self) -> PoolGeometry:
        """Check shapes, dtypes, devices and strides; ValueError names the first problem."""
        infos = [array_info(c) for c in self.chunks]
        first = infos[0]
        if self.kind is PoolKind.LAYERED and (len(infos) % 2 or len(first.shape) != 4):
            raise ValueError(f"layered pool needs K/V pairs of [blocks, T, H, D] tensors, got "
                             f"{len(infos)} tensors of shape {first.shape}")
        if self.kind is PoolKind.CONTIGUOUS and len(infos) != 1:
            raise ValueError("contiguous pool is one tensor")
        if self.kind is PoolKind.PAGED and len(first.shape) < 2:
            raise ValueError(f"paged pool tensors need [blocks, ...] shapes, got {first.shape}")
        for i, info in enumerate(infos):
            same = (info.shape, info.dtype, info.device, info.strides[0]) == (
                first.shape, first.dtype, first.device, first.strides[0])
            if not same:
                raise ValueError(f"pool tensor {i} ({info.shape}, {info.dtype}, {info.device}) "
                                 f"differs from tensor 0 ({first.shape}, {first.dtype}, "
                                 f"{first.device}) in shape, dtype, device or block stride")
            inner = info.shape[1:]
            want = tuple(info.itemsize * math.prod(inner[j + 1:]) for j in range(len(inner)))
            if info.strides[1:] != want:
                raise ValueError(f"pool tensor {i}: each block must be contiguous, strides "
                                 f"{info.strides} for shape {info.shape}")
        if not first.shape or first.shape[0] == 0:
            raise ValueError(f"pool tensor has no blocks: shape {first.shape}")
        chunk = first.itemsize * math.prod(first.shape[1:])
        return PoolGeometry(self.kind, first.shape[0], len(infos), chunk, first.strides[0])

    @property
    def device(self) -> str:
        return array_info(self.chunks[0]).device


def slot_geometry(slots: Any) -> SlotGeometry:
    info = array_info(slots)
    if info.dtype != "uint8" or len(info.shape) != 2 or info.strides[1] != 1:
        raise ValueError(f"slot buffer must be a uint8 [num_slots, slot_bytes] array with "
                         f"contiguous rows, got {info.dtype} {info.shape} strides {info.strides}")
    return SlotGeometry(info.shape[0], info.shape[1], info.strides[0])


@dataclass(frozen=True, slots=True)
class TransferJob:
    """Move blocks: LOAD copies slots[i] -> pool block blocks[i]; STORE the reverse.

    `after`: CUDA backend — a CuPy/torch event or stream, or a raw cudaStream_t; CPU backend — any
    object with `.wait()` or `.synchronize()` (a threading.Event, a torch.cuda.Event).
    """

    direction: Direction
    slots: Sequence[int] | npt.NDArray[np.integer[Any]]
    blocks: Sequence[int] | npt.NDArray[np.integer[Any]]
    after: object | None = None
    chunks: tuple[int, int] | None = None
    """Copy only chunks [lo, hi) of each pair (None: every chunk)."""


@dataclass(frozen=True, slots=True)
class TransferHandle:
    id: int


class TransferResult(NamedTuple):
    """A finished job. `ok[i]` is True only if pair (slots[i], blocks[i]) was copied completely."""

    handle: TransferHandle
    direction: Direction
    slots: IntArray
    blocks: IntArray
    ok: npt.NDArray[np.bool_]
    path: str  # "cpu" | "kernel" | "dma" | "none"
    error: str | None
    nbytes: int  # bytes of the pairs that completed
    seconds: float  # submit to completion (when the backend knows it: CPU), else to observed

    @property
    def all_ok(self) -> bool:
        return bool(self.ok.all())

    def failed_blocks(self) -> list[int]:
        return [int(b) for b in self.blocks[~self.ok]]

    def failed_slots(self) -> list[int]:
        return [int(s) for s in self.slots[~self.ok]]


class Backend(Protocol):
    name: str

    def start(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray,
              after: object | None, chunks: tuple[int, int] | None = None) -> Any: ...
    def done(self, pending: Any) -> bool: ...
    def finish(self, pending: Any, timeout: float | None = None) -> Any: ...
    def close(self) -> None: ...


class _Inflight(NamedTuple):
    direction: Direction
    slots: IntArray
    blocks: IntArray
    pending: Any
    t0: float
    pair_bytes: int


class TransferEngine:
    """Submit/poll/wait over one pool and one slot buffer (see the module contracts)."""

    def __init__(self, pool: KVPool, slots: Any, *, backend: str | Backend = "auto",
                 calibration: Calibration | None = None) -> None:
        self.pool_geometry = pool.geometry()
        self.slot_geometry = slot_geometry(slots)
        check_geometry(self.pool_geometry, self.slot_geometry)
        self._slots_writable = bool(getattr(getattr(slots, "flags", None), "writeable", True))
        if isinstance(backend, str):
            backend = _make_backend(backend, pool, slots, self.pool_geometry,
                                    self.slot_geometry, calibration)
        self.backend: Backend = backend
        self._ids = itertools.count(1)
        self._inflight: dict[TransferHandle, _Inflight] = {}

    def submit(self, job: TransferJob) -> TransferHandle:
        """Validate and start a job; ValueError (nothing written) on bad input."""
        direction = Direction(job.direction)
        if direction is Direction.STORE and not self._slots_writable:
            raise ValueError("slot buffer is read-only: STORE needs a writable mapping")
        s, b = check_pairs(direction, job.slots, job.blocks, self.pool_geometry,
                           self.slot_geometry)
        chunks = check_chunks(job.chunks, self.pool_geometry.n_chunks)
        handle = TransferHandle(next(self._ids))
        t0 = time.perf_counter()
        pending = None
        if s.size:  # `chunks` only when a range is asked for: whole-pair backends still work
            pending = (self.backend.start(direction, s, b, job.after) if chunks is None else
                       self.backend.start(direction, s, b, job.after, chunks=chunks))
        lo, hi = chunks or (0, self.pool_geometry.n_chunks)
        self._inflight[handle] = _Inflight(direction, s, b, pending, t0,
                                           (hi - lo) * self.pool_geometry.chunk_bytes)
        return handle

    def poll(self) -> list[TransferResult]:
        """Results of every job that has finished since the last poll/wait; never blocks."""
        ready = [h for h, f in self._inflight.items()
                 if f.pending is None or self.backend.done(f.pending)]
        return [self._collect(h, None) for h in ready]

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferResult:
        """Block until `handle` finishes; KeyError if unknown or already collected."""
        if handle not in self._inflight:
            raise KeyError(f"unknown or already collected transfer {handle.id}")
        return self._collect(handle, timeout)

    def pending(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        """Wait for every job, then release the backend (streams, worker threads)."""
        for h in list(self._inflight):
            self._collect(h, None)
        self.backend.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, handle: TransferHandle, timeout: float | None) -> TransferResult:
        f = self._inflight[handle]
        done_at = None
        if f.pending is None:
            ok, path, error = np.ones(0, dtype=np.bool_), "none", None
        else:
            out = self.backend.finish(f.pending, timeout)
            ok, path, error = out.ok, out.path, out.error
            done_at = getattr(out, "done_at", None)
        del self._inflight[handle]
        nbytes = int(ok.sum()) * f.pair_bytes
        return TransferResult(handle, f.direction, f.slots, f.blocks, ok, path, error, nbytes,
                              (done_at or time.perf_counter()) - f.t0)


def check_chunks(chunks: tuple[int, int] | None, n_chunks: int) -> tuple[int, int] | None:
    """A job's chunk range as (lo, hi), None for every chunk; ValueError when out of range."""
    if chunks is None:
        return None
    try:
        lo, hi = (int(c) for c in chunks)
    except (TypeError, ValueError):
        raise ValueError(f"chunks must be a (lo, hi) pair of integers, got {chunks!r}") from None
    if not 0 <= lo < hi <= n_chunks:
        raise ValueError(f"chunk range [{lo}, {hi}) is not within the pool's {n_chunks} chunks")
    return None if (lo, hi) == (0, n_chunks) else (lo, hi)


def _make_backend(name: str, pool: KVPool, slots: Any, geom: PoolGeometry,
                  slot_geom: SlotGeometry, calibration: Calibration | None) -> Backend:
    if name == "auto":
        name = "cuda" if pool.device == "cuda" else "cpu"
    if name == "cpu":
        from kvtier.gpu.cpu import CpuBackend

        return CpuBackend(geom, pool.chunks, slots, slot_geom)
    if name == "cuda":
        from kvtier.gpu.backend import CudaBackend

        return CudaBackend(geom, pool.chunks, slots, slot_geom, calibration)
    raise ValueError(f"unknown transfer backend {name!r}: use auto, cpu or cuda")
