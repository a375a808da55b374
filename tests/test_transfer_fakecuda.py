"""The CUDA backend's plumbing on CPU, through a fake CuPy whose "device" memory is host memory.

Not a GPU test (that is tests/test_transfer_gpu.py, `-m gpu`): this drives kvtier.gpu's real
code — pointer arithmetic of the DMA plan (copies really move bytes with memmove), argument order
of the kernel launch (checked against the .cu signature; the kernel itself is emulated), path
choice, event/stream ordering calls and per-pair failure mapping — so a GPU session does not
discover plumbing bugs.
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.gpu import kernels
from kvtier.gpu.cpu import reference_copy
from kvtier.gpu.plan import Calibration, CalibrationRow, Direction
from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob, slot_geometry

KERNEL_PARAMS = ["slots", "slot_stride", "bases", "block_stride", "chunk_bytes", "n_chunks",
                 "pairs", "n_pairs", "tile_bytes"]


class CudaError(Exception):
    pass


class DevArray:
    """A "device" array: host numpy memory exposed only through __cuda_array_interface__."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.dtype, self.ndim, self.shape, self.flags = a.dtype, a.ndim, a.shape, a.flags
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "strides": self.a.strides,
                "data": (self.a.ctypes.data, False), "version": 3}


class FakeStream:
    _next = 0x1000

    def __init__(self, non_blocking: bool = False) -> None:
        FakeStream._next += 1
        self.ptr = FakeStream._next
        self.waited: list[Any] = []

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class FakeEvent:
    def __init__(self, disable_timing: bool = False) -> None:
        self.ptr = id(self)
        self.done = True
        self.fail: str | None = None
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        if self.fail:
            raise CudaError(self.fail)


class FakeRuntime:
    CUDARuntimeError = CudaError
    cudaDevAttrMultiProcessorCount = 16

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.recorded: list[tuple[int, int]] = []
        self.poison: tuple[int, int] | None = None  # copies into [lo, hi) fail
        self.calls = 0

    def getDeviceCount(self) -> int:
        return 1

    def getDeviceProperties(self, dev: int) -> dict[str, Any]:
        return {"name": b"FakeGPU (host memory)"}

    def deviceGetAttribute(self, attr: int, dev: int) -> int:
        assert attr == 16
        return 4

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        assert flags & 2, "must be mapped for kernels to reach it"
        self.registered.append((ptr, size))

    def hostUnregister(self, ptr: int) -> None:
        self.registered = [r for r in self.registered if r[0] != ptr]

    def pointerGetAttributes(self, ptr: int) -> Any:
        inside = any(lo <= ptr < lo + n for lo, n in self.registered)
        return types.SimpleNamespace(devicePointer=ptr if inside else 0)

    def eventRecord(self, event: int, stream: int) -> None:
        self.recorded.append((event, stream))

    def _move(self, dst: int, src: int, n: int) -> None:
        if self.poison and self.poison[0] <= dst < self.poison[1]:
            raise CudaError("cudaErrorInvalidValue (injected)")
        ctypes.memmove(dst, src, n)

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        assert kind == 4
        self.calls += 1
        self._move(dst, src, n)

    def memcpy2DAsync(self, dst: int, dp: int, src: int, sp: int, w: int, h: int,
                      kind: int, stream: int) -> None:
        assert kind == 4 and dp >= w and sp >= w
        self.calls += 1
        for r in range(h):
            self._move(dst + r * dp, src + r * sp, w)


def _emulated_kernel(name: str) -> Any:
    scatter = name == "kv_scatter"

    def run(grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
        assert len(args) == len(KERNEL_PARAMS)
        a = dict(zip(KERNEL_PARAMS, args, strict=True))
        assert isinstance(a["slots"], np.uint64) and isinstance(a["n_chunks"], np.int32)
        for k in ("slot_stride", "block_stride", "chunk_bytes", "n_pairs", "tile_bytes"):
            assert isinstance(a[k], np.int64), k
        bases, pairs = a["bases"].a, a["pairs"].a
        assert bases.dtype == np.uint64 and pairs.dtype == np.int64
        cb = int(a["chunk_bytes"])
        for p in range(int(a["n_pairs"])):
            slot, blk = int(pairs[p, 0]), int(pairs[p, 1])
            for c in range(int(a["n_chunks"])):
                host = int(a["slots"]) + slot * int(a["slot_stride"]) + c * cb
                dev = int(bases[c]) + blk * int(a["block_stride"])
                dst, src = (dev, host) if scatter else (host, dev)
                ctypes.memmove(dst, src, cb)

    return run


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    rt = FakeRuntime()
    cuda = types.SimpleNamespace(
        runtime=rt, Stream=FakeStream, Event=FakeEvent,
        Device=lambda: types.SimpleNamespace(id=0),
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
    module = types.ModuleType("cupy")
    module.cuda = cuda  # type: ignore[attr-defined]
    module.asarray = lambda x: DevArray(np.ascontiguousarray(x))  # type: ignore[attr-defined]
    module.asnumpy = lambda x: x.a.copy()  # type: ignore[attr-defined]
    module.zeros = lambda shape, dtype: DevArray(np.zeros(shape, dtype))  # type: ignore[attr-defined]
    module.uint8 = np.uint8  # type: ignore[attr-defined]
    module.RawModule = lambda code, options: types.SimpleNamespace(  # type: ignore[attr-defined]
        get_function=_emulated_kernel)
    runtime_mod = types.ModuleType("cupy.cuda.runtime")
    runtime_mod.__dict__.update({k: getattr(rt, k) for k in dir(rt) if not k.startswith("_")})
    cuda_mod = types.ModuleType("cupy.cuda")
    cuda_mod.__dict__.update(vars(cuda), runtime=runtime_mod)
    module.cuda = cuda_mod  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda", "cupy.cuda.runtime")}
    sys.modules.update({"cupy": module, "cupy.cuda": cuda_mod, "cupy.cuda.runtime": runtime_mod})
    kernels._function.cache_clear()
    kernels._sm_count.cache_clear()
    try:
        yield rt
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        kernels._function.cache_clear()
        kernels._sm_count.cache_clear()


def test_kernel_signature_matches_the_wrapper() -> None:
    src = (kernels.kernel_dir() / kernels.SOURCE).read_text()
    for name in ("kv_scatter", "kv_gather"):
        m = re.search(name + r"\(([^)]*)\)", src)
        assert m is not None
        names = [p.split()[-1].lstrip("*") for p in m.group(1).replace("\n", " ").split(",")]
        assert names == KERNEL_PARAMS


def _setup(n_chunks: int, pad: int, seed: int) -> tuple[KVPool, list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = [rng.integers(0, 256, (9, 3, 2, 8), dtype=np.uint8) for _ in range(n_chunks)]
    pool = KVPool.layered([DevArray(r) for r in raw[0::2]], [DevArray(r) for r in raw[1::2]])
    slots = rng.integers(0, 256, (7, n_chunks * 48 + pad), dtype=np.uint8)
    return pool, raw, slots


def _run(direction: Direction, path: str, s: list[int], b: list[int], pad: int = 0,
         seed: int = 0, **kw: Any) -> tuple[Any, np.ndarray, list[np.ndarray], np.ndarray,
                                             list[np.ndarray]]:
    from kvtier.gpu.backend import CudaBackend

    pool, raw, slots = _setup(4, pad, seed)
    geom = pool.geometry()
    want_slots, want = slots.copy(), [r.reshape(9, -1).copy() for r in raw]
    reference_copy(direction, want_slots, want, geom, np.array(s), np.array(b))
    eng = TransferEngine(pool, slots, backend=CudaBackend(
        geom, pool.chunks, slots, slot_geometry(slots),
        force_path=path if path != "auto" else None, **kw))
    with eng:
        res = eng.wait(eng.submit(TransferJob(direction, s, b)))
    return res, slots, [r.reshape(9, -1) for r in raw], want_slots, want


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("direction", list(Direction))
def test_both_paths_move_the_reference_bytes(fake: FakeRuntime, direction: Direction,
                                             path: str) -> None:
    # slots 2,3,4 -> blocks 5,6,7 merge into one run; 0 -> 1 alone; unsorted on purpose
    s, b = [4, 0, 2, 3], [7, 1, 5, 6]
    res, slots, got, want_slots, want = _run(direction, path, s, b, pad=5)
    assert res.all_ok and res.path == path
    np.testing.assert_array_equal(slots, want_slots)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert fake.registered == []  # the backend registered the slot buffer and released it
    if path == "dma":
        assert fake.calls == 2 * 4  # two runs x four chunks, one (2-D) copy each


def test_failed_dma_copy_fails_exactly_its_pairs(fake: FakeRuntime) -> None:
    from kvtier.gpu.backend import CudaBackend

    pool, raw, slots = _setup(4, 0, seed=1)
    lo = raw[2].ctypes.data + 1 * 48  # chunk 2 (K of layer 1), block 1
    fake.poison = (lo, lo + 48)
    geom = pool.geometry()
    sg = slot_geometry(slots)
    with TransferEngine(pool, slots,
                        backend=CudaBackend(geom, pool.chunks, slots, sg, force_path="dma")) as e:
        res = e.wait(e.submit(TransferJob(Direction.LOAD, [3, 0, 6], [4, 1, 8])))
    assert res.ok.tolist() == [True, False, True]
    assert res.failed_blocks() == [1] and res.error is not None and "1 of 12" in res.error


def test_error_at_completion_fails_every_pair(fake: FakeRuntime, monkeypatch: Any) -> None:
    def failing_event(disable_timing: bool = False) -> FakeEvent:
        ev = FakeEvent()
        ev.fail = "cudaErrorIllegalAddress"
        return ev

    monkeypatch.setattr(sys.modules["cupy.cuda"], "Event", failing_event)
    res, *_ = _run(Direction.STORE, "kernel", [1, 2], [3, 4])
    assert res.ok.tolist() == [False, False] and "IllegalAddress" in (res.error or "")


def test_measured_calibration_picks_the_path(fake: FakeRuntime) -> None:
    slow_dma = Calibration((CalibrationRow(Direction.LOAD, 48, 10.0, 1.0),))
    res, *_ = _run(Direction.LOAD, "auto", [0, 1], [2, 3], calibration=slow_dma)
    assert res.path == "kernel" and res.all_ok
    fast_dma = Calibration((CalibrationRow(Direction.LOAD, 48, 1.0, 10.0),))
    res, *_ = _run(Direction.LOAD, "auto", [0, 1], [2, 3], calibration=fast_dma)
    assert res.path == "dma" and res.all_ok


def test_orders_after_streams_and_events(fake: FakeRuntime) -> None:
    from kvtier.gpu.backend import wait_on

    ours, scratch = FakeStream(), FakeEvent()
    theirs = FakeEvent()
    wait_on(theirs, ours, scratch)
    assert ours.waited == [theirs]
    compute = FakeStream()
    wait_on(compute, ours, scratch)
    assert fake.recorded == [(scratch.ptr, compute.ptr)] and ours.waited[-1] is scratch
    wait_on(0x77, ours, scratch)
    assert fake.recorded[-1] == (scratch.ptr, 0x77)
    with pytest.raises(ValueError, match="cannot order after"):
        wait_on("soon", ours, scratch)


def test_bench_gpu_sections_run_on_fake_cuda(fake: FakeRuntime, tmp_path: Any,
                                             monkeypatch: Any) -> None:
    import bench.gpu_transfer as bench
    from kvtier.gpu.measure import calibrate_pool
    from kvtier.gpu.plan import PoolGeometry, PoolKind

    assert bench._gpu_device() == "FakeGPU (host memory)"
    check = bench.gpu_check()
    assert len(check["rows"]) == 16 and all(r["bit_exact"] for r in check["rows"])
    sweep = bench.gpu_sweep(chunks=(4096, 65_536), total=1 << 20, max_pairs=64)
    assert [r["chunk_bytes"] for r in sweep["rows"]] == [4096, 4096, 65_536, 65_536]
    goals = bench.gpu_goals(total=4 << 20, max_pairs=4)
    assert {r["shape"] for r in goals["rows"]} == {"llama3-8b tp1 (2 MiB blocks)",
                                                   "llama3-8b tp8 rank"}
    assert all(r["kernel_gbps"] > 0 and r["ceiling_gbps"] > 0 for r in goals["rows"])
    cal = calibrate_pool(PoolGeometry(PoolKind.LAYERED, 1, 64, 4096, 4096), budget_bytes=1 << 18)
    assert sorted({r.chunk_bytes for r in cal.rows}) == [4096, 16_384, 65_536, 262_144]
    assert fake.registered == []
