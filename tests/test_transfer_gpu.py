"""CUDA backend equals the CPU reference bit for bit (run with `pytest -m gpu` on a GPU machine)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest

from kvtier.gpu import available
from kvtier.gpu.cpu import reference_copy
from kvtier.gpu.plan import Direction, PoolKind
from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob, slot_geometry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="needs CuPy + CUDA")]


def _host_slots(num: int, nbytes: int, seed: int) -> np.ndarray:
    """Slots in an anonymous shared mapping (like the DRAM tier), random bytes."""
    mapping = mmap.mmap(-1, num * nbytes)
    arr = np.frombuffer(mapping, dtype=np.uint8).reshape(num, nbytes)
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def _pool(kind: PoolKind, n_chunks: int, blocks: int, chunk_shape: tuple[int, ...],
          dtype: Any, seed: int) -> tuple[KVPool, list[Any]]:
    import cupy

    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    tensors = []
    for _ in range(n_chunks if kind is PoolKind.LAYERED else 1):
        shape = (blocks, *chunk_shape)
        raw = rng.integers(0, 256, int(np.prod(shape)) * itemsize, dtype=np.uint8)
        tensors.append(cupy.asarray(raw).view(dtype).reshape(shape))
    if kind is PoolKind.LAYERED:
        return KVPool.layered(tensors[0::2], tensors[1::2]), tensors
    return KVPool.contiguous(tensors[0]), tensors


def _check(kind: PoolKind, direction: Direction, path: str, n_chunks: int,
           chunk_shape: tuple[int, ...], dtype: Any, slot_pad: int, seed: int) -> None:
    import cupy

    from kvtier.gpu.backend import CudaBackend

    blocks = 11
    pool, tensors = _pool(kind, n_chunks, blocks, chunk_shape, dtype, seed)
    geom = pool.geometry()
    slots = _host_slots(9, geom.payload_bytes + slot_pad, seed)
    rng = np.random.default_rng(seed)
    if direction is Direction.LOAD:
        blk = rng.permutation(blocks)[:7]
        slt = rng.integers(0, 9, 7)  # repeated sources allowed
    else:
        slt = rng.permutation(9)[:7]
        blk = rng.integers(0, blocks, 7)
    want_slots = slots.copy()
    want_chunks = [cupy.asnumpy(t).view(np.uint8).reshape(blocks, -1).copy() for t in tensors]
    if kind is PoolKind.CONTIGUOUS:
        assert len(want_chunks) == 1
    reference_copy(direction, want_slots, want_chunks, geom, slt.astype(np.int64),
                   blk.astype(np.int64))

    backend = CudaBackend(geom, pool.chunks, slots, slot_geometry(slots), force_path=path)
    with TransferEngine(pool, slots, backend=backend) as eng:
        res = eng.wait(eng.submit(TransferJob(direction, slt, blk)))
    assert res.all_ok and res.path == path, res.error
    np.testing.assert_array_equal(slots, want_slots)
    for t, w in zip(tensors, want_chunks, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(t).view(np.uint8).reshape(blocks, -1), w)


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("kind", list(PoolKind))
def test_aligned_matches_reference(kind: PoolKind, direction: Direction, path: str) -> None:
    _check(kind, direction, path, 6, (16, 2, 64), np.float16, slot_pad=0, seed=1)


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("direction", list(Direction))
def test_unaligned_and_multi_tile_chunks(direction: Direction, path: str) -> None:
    # 3*1*5 fp16 = 30 B chunks (scalar tail), slot stride payload+3 (unaligned slot starts)
    _check(PoolKind.LAYERED, direction, path, 4, (3, 1, 5), np.float16, slot_pad=3, seed=2)
    # 100*1*1037 B = 103,700 B per chunk: two 64 KiB tiles, the second with a 4 B scalar tail
    _check(PoolKind.LAYERED, direction, path, 2, (100, 1, 1037), np.uint8, slot_pad=0, seed=3)


def test_torch_bf16_pool_and_stream_ordering() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    kv = [torch.zeros((2, 8, 16, 2, 64), dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    pool = KVPool.stacked(kv)
    slots = _host_slots(4, pool.geometry().payload_bytes, seed=4)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)  # keep the compute stream busy
        for layer in kv:
            layer[:, 5].fill_(1.5)
    with TransferEngine(pool, slots) as eng:
        res = eng.wait(eng.submit(TransferJob(Direction.STORE, [2], [5], after=compute)))
    assert res.all_ok
    want = torch.full((16, 2, 64), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy().ravel()
    np.testing.assert_array_equal(slots[2], np.tile(want, 6))


def test_host_registration_and_calibration() -> None:
    from kvtier.gpu import hostmem
    from kvtier.gpu.measure import calibrate_pool
    from kvtier.gpu.plan import PoolGeometry

    slots = _host_slots(2, 1 << 20, seed=5)
    reg = hostmem.register(slots)
    assert reg.nbytes == 2 << 20
    assert hostmem.device_pointer(slots.ctypes.data + 4096) == reg.device_ptr + 4096
    hostmem.unregister(reg)
    hostmem.unregister(hostmem.register(slots))  # unregistered cleanly: registers again
    cal = calibrate_pool(PoolGeometry(PoolKind.LAYERED, 8, 64, 32 << 10, 32 << 10))
    assert {r.direction for r in cal.rows} == set(Direction)
    assert all(r.kernel_gbps > 0 and r.dma_gbps > 0 for r in cal.rows)


TORCH_DTYPES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                "int8", "uint8"]


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("kind", list(PoolKind))
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize(("chunk_shape", "slot_pad"), [((16, 2, 64), 0), ((3, 1, 5), 3)],
                         ids=["aligned", "odd"])
def test_every_dtype_on_torch_pools(dtype: str, kind: PoolKind, direction: Direction, path: str,
                                    chunk_shape: tuple[int, ...], slot_pad: int) -> None:
    """Torch CUDA pools of every KV dtype an engine uses (the bytes move as bytes: random bit
    patterns, NaNs included), each pool kind, both directions, both paths; "odd": 3*1*5
    elements per chunk (15 B for one-byte dtypes) and slot rows 3 bytes longer than the payload,
    so no chunk or slot start is aligned."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from kvtier.gpu.backend import CudaBackend

    tdtype = getattr(torch, dtype)
    blocks, n_tensors = 11, {PoolKind.LAYERED: 6, PoolKind.CONTIGUOUS: 1, PoolKind.PAGED: 3}[kind]
    shape = (blocks, *chunk_shape) if kind is not PoolKind.CONTIGUOUS else (blocks, 4, *chunk_shape)
    g = torch.Generator().manual_seed(TORCH_DTYPES.index(dtype) + 10 * list(PoolKind).index(kind))
    itemsize = torch.empty((), dtype=tdtype).element_size()
    tensors = [torch.randint(0, 256, (int(np.prod(shape)) * itemsize,), generator=g,
                             dtype=torch.uint8).view(tdtype).view(shape).cuda()
               for _ in range(n_tensors)]
    pool = {PoolKind.LAYERED: lambda: KVPool.layered(tensors[0::2], tensors[1::2]),
            PoolKind.CONTIGUOUS: lambda: KVPool.contiguous(tensors[0]),
            PoolKind.PAGED: lambda: KVPool.paged(tensors)}[kind]()
    geom = pool.geometry()
    slots = _host_slots(9, geom.payload_bytes + slot_pad, seed=11)
    rng = np.random.default_rng(12)
    if direction is Direction.LOAD:
        blk, slt = rng.permutation(blocks)[:7], rng.integers(0, 9, 7)
    else:
        slt, blk = rng.permutation(9)[:7], rng.integers(0, blocks, 7)
    want_slots = slots.copy()
    want = [t.view(torch.uint8).reshape(blocks, -1).cpu().numpy().copy() for t in tensors]
    reference_copy(direction, want_slots, want, geom, slt.astype(np.int64), blk.astype(np.int64))
    backend = CudaBackend(geom, pool.chunks, slots, slot_geometry(slots), force_path=path)
    with TransferEngine(pool, slots, backend=backend) as eng:
        res = eng.wait(eng.submit(TransferJob(direction, slt, blk)))
    assert res.all_ok and res.path == path, res.error
    np.testing.assert_array_equal(slots, want_slots)
    for t, w in zip(tensors, want, strict=True):
        np.testing.assert_array_equal(t.view(torch.uint8).reshape(blocks, -1).cpu().numpy(), w)
