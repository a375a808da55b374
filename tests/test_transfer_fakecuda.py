"""The CUDA backend's plumbing on CPU, through the fake CuPy of tests/fake_cuda.py ("device"
memory is host memory).

Not a GPU test (that is tests/test_transfer_gpu.py, `-m gpu`): this drives kvtier.gpu's real
code — pointer arithmetic of the DMA plan (copies really move bytes with memmove), argument order
of the kernel launch (checked against the .cu signature; the kernel itself is emulated), path
choice, event/stream ordering calls and per-pair failure mapping — so a GPU session does not
discover plumbing bugs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.gpu import kernels
from kvtier.gpu.cpu import reference_copy
from kvtier.gpu.plan import Calibration, CalibrationRow, Direction
from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob, slot_geometry
from tests.fake_cuda import (
    KERNEL_PARAMS,
    DevArray,
    FakeEvent,
    FakeRuntime,
    FakeStream,
    installed,
)


@pytest.fixture
def fake() -> Iterator[FakeRuntime]:
    with installed() as rt:
        yield rt


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


def test_first_use_calibration_is_measured_once_per_chunk_size(
        fake: FakeRuntime, monkeypatch: Any) -> None:
    """A backend built per transfer (the reference engine's adapter builds one per copy) does
    not measure again: the first measurement of a (device, chunk size) serves the process."""
    from kvtier.gpu import measure

    calls: list[int] = []
    real = measure.calibrate_pool

    def counted(pool: Any, *args: Any) -> Calibration:
        calls.append(pool.chunk_bytes)
        return real(pool, 1 << 16)

    monkeypatch.setattr(measure, "calibrate_pool", counted)
    for _ in range(3):
        res, *_ = _run(Direction.LOAD, "auto", [0, 1], [2, 3])
        assert res.all_ok
    assert calls == [48]
