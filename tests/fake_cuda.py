"""A fake CuPy whose "device" memory is host memory: the CUDA backend's plumbing on a CPU.

    with installed() as rt: ...            # cupy, cupy.cuda, cupy.cuda.runtime stand-ins
    python -m tests.fake_cuda MODULE ARGS  # runs MODULE as __main__ with the fake installed

Copies really move bytes (memmove); the block-copy kernel is emulated after checking its
arguments against `kernels/kv_blocks.cu`'s parameter order and types; streams and events record
what was ordered after what. Not a GPU: timings mean nothing and nothing runs asynchronously.
Used by tests/test_transfer_fakecuda.py, tests/test_vllm_loads.py and the dry run of
`bench.gpu_check` (every GPU section of `bench.gpu_transfer` on a CPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import runpy
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.gpu import backend, kernels

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


@contextlib.contextmanager
def installed() -> Iterator[FakeRuntime]:
    """The fake CuPy in sys.modules for the block (what was there before is put back)."""
    rt = FakeRuntime()
    cuda = types.SimpleNamespace(
        runtime=rt, Stream=FakeStream, Event=FakeEvent,
        Device=lambda: types.SimpleNamespace(id=0),
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
    module = types.ModuleType("cupy")
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
    caches = (kernels._function, kernels._sm_count, backend.measured)
    for cache in caches:
        cache.cache_clear()
    try:
        yield rt
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        for cache in caches:
            cache.cache_clear()


def main(argv: list[str]) -> int:
    """`python -m tests.fake_cuda MODULE ARGS...`: MODULE's `__main__` with the fake installed."""
    if not argv:
        print("usage: python -m tests.fake_cuda MODULE [ARGS...]", file=sys.stderr)
        return 2
    sys.argv = [argv[0], *argv[1:]]
    with installed():
        try:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
