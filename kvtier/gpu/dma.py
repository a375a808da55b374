"""Batched DMA: enqueue a plan of (2-D) cudaMemcpyAsync calls (kvtier.gpu.plan.copy_ops).

Addresses are unified (cudaMemcpyDefault), so host slots must be pinned (registered) memory and
the copies run on the copy engines without a kernel. One Python call per op: merging runs first
(`merge_runs`) is what keeps the op count low.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.gpu.plan import Copy, Direction

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault


def enqueue(direction: Direction, ops: Sequence[Copy], slot_ptr: int, chunk_ptrs: Sequence[int],
            stream_ptr: int) -> list[int]:
    """Enqueue every op on the stream; return the indices of ops whose enqueue failed."""
    from cupy.cuda import runtime

    failed: list[int] = []
    for i, op in enumerate(ops):
        host = slot_ptr + op.host_off
        dev = chunk_ptrs[op.chunk] + op.dev_off
        dst, dpitch, src, spitch = (
            (dev, op.dev_pitch, host, op.host_pitch) if direction is Direction.LOAD
            else (host, op.host_pitch, dev, op.dev_pitch))
        try:
            if op.height == 1:
                runtime.memcpyAsync(dst, src, op.width, MEMCPY_DEFAULT, stream_ptr)
            else:
                runtime.memcpy2DAsync(dst, dpitch, src, spitch, op.width, op.height,
                                      MEMCPY_DEFAULT, stream_ptr)
        except runtime.CUDARuntimeError:
            failed.append(i)
    return failed
