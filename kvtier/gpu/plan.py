"""Pure planning for block transfers: geometry, pair validation, run merging, DMA copy lists.

No I/O and no GPU imports: both the CPU reference backend and the CUDA backend run these, and the
tests exercise them exhaustively on CPU. Addresses are byte offsets from a base (the slot buffer's
first byte, or a pool chunk tensor's first block), never raw pointers.

Geometry (see "Slot layout contract" in kvtier/gpu/transfer.py)::

    slot s   : [chunk 0 | chunk 1 | ... | chunk n-1 | (unused tail)]   at s * slot_stride
    chunk c  : pool tensor c, block b at b * block_stride, chunk_bytes long
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class PoolKind(enum.StrEnum):
    """How the engine's pool stores one block."""

    LAYERED = "layered"  # (a) per-layer K and V tensors: one block = 2 x layers chunks
    CONTIGUOUS = "contiguous"  # (b) one block = one contiguous region across layers
    PAGED = "paged"  # (c) any number of chunk tensors [num_blocks, ...], one chunk per block each


class Direction(enum.StrEnum):
    """LOAD: DRAM slots -> pool (scatter). STORE: pool blocks -> slots (gather)."""

    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Byte geometry of a pool: `n_chunks` tensors, each holding `num_blocks` chunks."""

    kind: PoolKind
    num_blocks: int
    n_chunks: int
    chunk_bytes: int
    block_stride: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block in a slot: every chunk, back to back."""
        return self.n_chunks * self.chunk_bytes


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Byte geometry of the DRAM slot buffer: `num_slots` rows `slot_stride` bytes apart."""

    num_slots: int
    slot_bytes: int
    slot_stride: int


class Run(NamedTuple):
    """`length` consecutive pairs (slot + i, block + i)."""

    slot: int
    block: int
    length: int


class Copy(NamedTuple):
    """One (2-D) memcpy between the slot buffer and pool chunk tensor `chunk`.

    `height` rows of `width` bytes; row i is at host_off + i*host_pitch in the slot buffer and at
    dev_off + i*dev_pitch in the chunk tensor. height == 1 is a plain 1-D copy.
    """

    chunk: int
    host_off: int
    host_pitch: int
    dev_off: int
    dev_pitch: int
    width: int
    height: int
    first_pair: int  # the op covers pairs [first_pair, first_pair + n_pairs) of the planned order
    n_pairs: int


def check_geometry(pool: PoolGeometry, slots: SlotGeometry) -> None:
    """Raise ValueError when a slot cannot hold a block of this pool."""
    if pool.num_blocks <= 0 or pool.n_chunks <= 0 or pool.chunk_bytes <= 0:
        raise ValueError(f"empty pool geometry: {pool}")
    if pool.block_stride < pool.chunk_bytes:
        raise ValueError(
            f"pool block stride {pool.block_stride} B is smaller than a chunk "
            f"({pool.chunk_bytes} B)"
        )
    if slots.slot_bytes < pool.payload_bytes:
        raise ValueError(
            f"slot of {slots.slot_bytes} B cannot hold a block of {pool.payload_bytes} B "
            f"({pool.n_chunks} chunks x {pool.chunk_bytes} B)"
        )
    if slots.slot_stride < slots.slot_bytes:
        raise ValueError(f"slot stride {slots.slot_stride} B < slot size {slots.slot_bytes} B")


def _as_index(name: str, values: Sequence[int] | npt.ArrayLike) -> IntArray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_pairs(
    direction: Direction,
    slot_idx: Sequence[int] | npt.ArrayLike,
    block_idx: Sequence[int] | npt.ArrayLike,
    pool: PoolGeometry,
    slots: SlotGeometry,
) -> tuple[IntArray, IntArray]:
    """Validate (slot, block) pairs; return them as int64 arrays in the caller's order.

    Indices may be unsorted. Sources may repeat (one slot loaded into two blocks, one block stored
    into two slots); a repeated destination is ambiguous and raises ValueError, as does an
    out-of-range index or mismatched lengths.
    """
    s = _as_index("slots", slot_idx)
    b = _as_index("blocks", block_idx)
    if s.shape != b.shape:
        raise ValueError(f"{s.size} slots but {b.size} blocks: pairs must match one to one")
    for name, arr, bound in (("slot", s, slots.num_slots), ("block", b, pool.num_blocks)):
        bad = np.flatnonzero((arr < 0) | (arr >= bound))
        if bad.size:
            raise ValueError(
                f"{name} index {int(arr[bad[0]])} at pair {int(bad[0])} is out of range "
                f"[0, {bound})"
            )
    dst, dst_name = (b, "pool block") if direction is Direction.LOAD else (s, "slot")
    uniq, counts = np.unique(dst, return_counts=True)
    if uniq.size != dst.size:
        dup = int(uniq[np.argmax(counts > 1)])
        raise ValueError(
            f"duplicate destination {dst_name} {dup}: each may be written once per job")
    return s, b


def sort_pairs(slot_idx: IntArray, block_idx: IntArray) -> IntArray:
    """Order of pairs by (slot, block): turns consecutive slot/block runs into adjacent pairs."""
    order: IntArray = np.lexsort((block_idx, slot_idx)).astype(np.int64)  # Any in numpy 2.3
    return order


def merge_runs(slot_idx: IntArray, block_idx: IntArray) -> list[Run]:
    """Merge adjacent pairs that advance by one on both sides, in the given order.

    (3,7),(4,8),(5,9),(9,1) -> [Run(3,7,3), Run(9,1,1)]
    """
    n = int(slot_idx.size)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(slot_idx) != 1) | (np.diff(block_idx) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [
        Run(int(slot_idx[a]), int(block_idx[a]), int(e - a))
        for a, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def copy_ops(runs: Sequence[Run], pool: PoolGeometry, slots: SlotGeometry) -> list[Copy]:
    """DMA copies for runs: one per (run, chunk); a 2-D copy collapses to 1-D when both sides
    are dense (pitch == width), e.g. layout (b) with slot_stride == block_stride == block size."""
    ops: list[Copy] = []
    first = 0
    for run in runs:
        for c in range(pool.n_chunks):
            width, height = pool.chunk_bytes, run.length
            hp, dp = slots.slot_stride, pool.block_stride
            if height > 1 and hp == width and dp == width:
                width, height, hp, dp = width * height, 1, width * height, width * height
            ops.append(
                Copy(
                    chunk=c,
                    host_off=run.slot * slots.slot_stride + c * pool.chunk_bytes,
                    host_pitch=hp,
                    dev_off=run.block * pool.block_stride,
                    dev_pitch=dp,
                    width=width,
                    height=height,
                    first_pair=first,
                    n_pairs=run.length,
                )
            )
        first += run.length
    return ops


def pairs_of_ops(n_pairs: int, order: IntArray, ops: Sequence[Copy],
                 op_idx: Sequence[int]) -> npt.NDArray[np.bool_]:
    """Mask over the caller's pairs touched by ops `op_idx` (ops planned over `order`)."""
    mask = np.zeros(n_pairs, dtype=np.bool_)
    for i in op_idx:
        op = ops[i]
        mask[order[op.first_pair:op.first_pair + op.n_pairs]] = True
    return mask


def per_chunk_ops(slot_idx: IntArray, block_idx: IntArray, pool: PoolGeometry,
                  slots: SlotGeometry) -> list[Copy]:
    """The naive plan: one 1-D copy per (pair, chunk) with no merging (the bench baseline)."""
    return copy_ops([Run(int(s), int(b), 1) for s, b in zip(slot_idx, block_idx, strict=True)],
                    pool, slots)


# --- choosing kernel vs DMA from measurement -------------------------------------------------


class CalibrationRow(NamedTuple):
    """One measurement: at DMA copies of `chunk_bytes`, the kernel moved `kernel_gbps` and the
    per-copy DMA path moved `dma_gbps` (both including per-call overheads) in `direction`."""

    direction: Direction
    chunk_bytes: int
    kernel_gbps: float
    dma_gbps: float


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured kernel/DMA throughput by copy size; `choose` picks the faster path for a plan.

    The rows come from `bench.gpu_transfer` (saved JSON) or from the CUDA backend's own quick
    measurement on its pool geometry; nothing here is a guessed constant.
    """

    rows: tuple[CalibrationRow, ...]
    source: str = "measured"

    def choose(self, direction: Direction, ops: Sequence[Copy]) -> str:
        """'kernel' or 'dma' for a plan whose DMA copies are `ops`; the row nearest (in log size)
        to the plan's mean copy size decides. Raises LookupError with no row for `direction`."""
        rows = [r for r in self.rows if r.direction is direction]
        if not rows:
            raise LookupError(f"no calibration rows for {direction.value}")
        total = sum(op.width * op.height for op in ops)
        mean = total / max(1, len(ops))
        near = min(rows, key=lambda r: abs(math.log2(r.chunk_bytes) - math.log2(max(mean, 1.0))))
        return "kernel" if near.kernel_gbps >= near.dma_gbps else "dma"

    def to_json(self) -> dict[str, object]:
        rows = [dict(r._asdict(), direction=r.direction.value) for r in self.rows]
        return {"source": self.source, "rows": rows}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Calibration:
        raw = data.get("rows")
        if not isinstance(raw, list):
            raise ValueError("calibration JSON needs a 'rows' list")
        rows = tuple(
            CalibrationRow(Direction(r["direction"]), int(r["chunk_bytes"]),
                           float(r["kernel_gbps"]), float(r["dma_gbps"]))
            for r in raw
        )
        return cls(rows, str(data.get("source", "file")))
