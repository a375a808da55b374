"""Thin wrapper over kernels/kv_blocks.cu: locate, compile once per specialization, check, launch.

Source of truth: the repository's `kernels/` directory. `kernel_dir()` looks in
$KVTIER_KERNELS_DIR, then `<repo>/kernels` (a source checkout), then the installed package data
`kvtier/_kernels/` (a symlink to `../kernels` in the repo, so a wheel carries the same files).
Compiled kernels are cached by CuPy under `$XDG_CACHE_HOME/kvtier/cupy` (`kvtier.core.paths`)
unless $CUPY_CACHE_DIR names another place.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.paths import cache_dir
from kvtier.gpu.plan import Direction, PoolGeometry, SlotGeometry

SOURCE = "kv_blocks.cu"
THREADS = 256
TILE_BYTES = 64 * 1024
CTAS_PER_SM = 8


def kernel_dir() -> Path:
    """Directory holding the .cu sources; FileNotFoundError lists where it looked."""
    tried = []
    env = os.environ.get("KVTIER_KERNELS_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "kernels")
    candidates.append(Path(str(resources.files("kvtier") / "_kernels")))
    for d in candidates:
        tried.append(str(d))
        if (d / SOURCE).is_file():
            return d
    raise FileNotFoundError(f"{SOURCE} not found in: {', '.join(tried)}")


@functools.cache
def _function(name: str, threads: int) -> Any:
    os.environ.setdefault("CUPY_CACHE_DIR", str(cache_dir(os.environ) / "cupy"))
    import cupy

    code = (kernel_dir() / SOURCE).read_text()
    module = cupy.RawModule(code=code, options=("-std=c++17", f"-DKV_THREADS={threads}"))
    return module.get_function(name)


@functools.cache
def _sm_count(device: int) -> int:
    import cupy

    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device))


def check_launch(pool: PoolGeometry, slots: SlotGeometry, pairs: Any, bases: Any) -> None:
    """Shape/dtype/stride checks on device arguments; ValueError before anything launches."""
    if pairs.dtype != np.int64 or pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be int64 [n, 2], got {pairs.dtype} {pairs.shape}")
    if not pairs.flags.c_contiguous:
        raise ValueError("pairs must be C-contiguous")
    if bases.dtype != np.uint64 or bases.shape != (pool.n_chunks,):
        raise ValueError(f"bases must be uint64 [{pool.n_chunks}], got {bases.dtype} {bases.shape}")
    if pool.block_stride < pool.chunk_bytes or slots.slot_bytes < pool.payload_bytes:
        raise ValueError(f"geometry does not fit: {pool} vs {slots}")


def launch(direction: Direction, slot_ptr: int, slots: SlotGeometry, bases: Any,
           pool: PoolGeometry, pairs: Any, stream: Any, threads: int = THREADS) -> None:
    """Enqueue one scatter (LOAD) or gather (STORE) of every pair on `stream`.

    `slot_ptr` is a device-visible address of slot 0 (a mapped pinned host pointer or device
    memory); `bases` a device uint64 array of the chunk tensors' block-0 addresses; `pairs` a device
    int64 [n, 2] array of (slot, block). The arrays must stay alive until the stream passes this.
    """
    import cupy

    check_launch(pool, slots, pairs, bases)
    n = int(pairs.shape[0])
    if n == 0:
        return
    tiles = -(-pool.chunk_bytes // TILE_BYTES)
    sms = _sm_count(cupy.cuda.Device().id)
    grid = max(1, min(n * pool.n_chunks * tiles, sms * CTAS_PER_SM))
    name = "kv_scatter" if direction is Direction.LOAD else "kv_gather"
    args = (np.uint64(slot_ptr), np.int64(slots.slot_stride), bases, np.int64(pool.block_stride),
            np.int64(pool.chunk_bytes), np.int32(pool.n_chunks), pairs, np.int64(n),
            np.int64(TILE_BYTES))
    fn = _function(name, threads)
    with stream:
        fn((grid,), (threads,), args)
