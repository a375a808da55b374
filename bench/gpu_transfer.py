"""Block transfer benchmark: CPU reference always; on a CUDA machine, kernels vs DMA vs ceiling.

    python -m bench.gpu_transfer            # a few minutes on an H200; seconds without a GPU
    python -m bench.gpu_transfer --quick    # tiny sizes: a smoke run of every section

Sections (each fails on its own; the JSON records the error and the rest still runs):
  cpu        reference path (numpy fancy index) vs a per-(block, chunk) copy loop vs one contiguous
             np.copyto of the same bytes, Llama-3-8B shapes; results checked equal.
  gpu_check  CUDA kernel and DMA paths vs the CPU reference, bit exact: both layouts, both
             directions, aligned/unaligned/multi-tile chunks.
  gpu_sweep  H2D/D2H GB/s against chunk size 4 KiB..16 MiB: kernel, per-chunk cudaMemcpyAsync loop,
             merged DMA plan, and one contiguous cudaMemcpyAsync of the same bytes (the ceiling).
  gpu_goals  Llama-3-8B layout (a), 16-token blocks: TP1 (32 KiB chunks, 2 MiB blocks) and a TP8
             rank (4 KiB chunks): kernel >= 0.85x ceiling (2 MiB blocks), kernel >= 5x loop.
  gpu_calib  the calibration table the CUDA backend loads ($KVTIER_TRANSFER_CALIBRATION).
JSON goes to bench/results/gpu_transfer.json (`--results DIR` for another directory) and, if $OUT
is set, $OUT/gpu_transfer.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.gpu.cpu import copy_loop, reference_copy
from kvtier.gpu.plan import Direction, PoolGeometry, PoolKind

RESULTS = Path(__file__).resolve().parent / "results"
KIB, MIB = 1 << 10, 1 << 20
LLAMA = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "block_tokens": 16}


def _median_s(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n{title}")
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _cpu_case(name: str, heads: int, n_blocks: int, n_pairs: int) -> list[dict[str, Any]]:
    chunk = LLAMA["block_tokens"] * heads * LLAMA["head_dim"] * LLAMA["dtype_bytes"]
    n_chunks = 2 * LLAMA["layers"]
    pool = PoolGeometry(PoolKind.LAYERED, n_blocks, n_chunks, chunk, chunk)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, (n_blocks, chunk), dtype=np.uint8) for _ in range(n_chunks)]
    slots = rng.integers(0, 256, (n_pairs, pool.payload_bytes), dtype=np.uint8)
    s = rng.permutation(n_pairs).astype(np.int64)
    b = rng.permutation(n_blocks)[:n_pairs].astype(np.int64)
    nbytes = n_pairs * pool.payload_bytes
    flat_src, flat_dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    orig = (slots.copy(), [c.copy() for c in chunks])

    def reset() -> None:
        slots[...] = orig[0]
        for c, o in zip(chunks, orig[1], strict=True):
            c[...] = o

    out = []
    for d in Direction:
        reset()
        reference_copy(d, slots, chunks, pool, s, b)
        want = (slots.copy(), [c.copy() for c in chunks])
        reset()
        copy_loop(d, slots, chunks, pool, s, b)
        same = np.array_equal(want[0], slots) and all(
            np.array_equal(x, y) for x, y in zip(want[1], chunks, strict=True))
        fancy = _median_s(functools.partial(reference_copy, d, slots, chunks, pool, s, b))
        loop = _median_s(functools.partial(copy_loop, d, slots, chunks, pool, s, b))
        ceil = _median_s(lambda: np.copyto(flat_dst, flat_src))
        out.append({"shape": name, "direction": d.value, "chunk_bytes": chunk, "pairs": n_pairs,
                    "bytes": nbytes, "fancy_gbps": _gbps(nbytes, fancy),
                    "loop_gbps": _gbps(nbytes, loop), "copyto_gbps": _gbps(nbytes, ceil),
                    "fancy_over_loop": loop / fancy, "fancy_over_copyto": ceil / fancy,
                    "loop_equals_fancy": same})
    return out


def cpu_section() -> dict[str, Any]:
    """Reference backend throughput on this machine, for Llama-3-8B TP1 and TP8-rank chunks."""
    out = _cpu_case("llama3-8b tp1", 8, 24, 16) + _cpu_case("llama3-8b tp8 rank", 1, 96, 64)
    rows = [[r["shape"], r["direction"], f"{r['chunk_bytes'] // KIB} KiB", r["pairs"],
             r["fancy_gbps"], r["loop_gbps"], r["copyto_gbps"], r["fancy_over_loop"],
             r["fancy_over_copyto"], r["loop_equals_fancy"]] for r in out]
    _table("CPU reference (numpy) — GB/s, median of 5",
           ["shape", "dir", "chunk", "blocks", "fancy", "loop", "copyto", "fancy/loop",
            "fancy/copyto", "equal"], rows)
    if not all(r["loop_equals_fancy"] for r in out):
        raise AssertionError("copy loop and reference differ")
    return {"rows": out}


def gpu_check() -> dict[str, Any]:
    """Kernel and DMA vs the CPU reference on the GPU, bit exact."""
    import cupy

    from kvtier.gpu.backend import CudaBackend
    from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob, slot_geometry

    cases = [("layered aligned", PoolKind.LAYERED, 8, (16, 2, 64), 0),
             ("contiguous aligned", PoolKind.CONTIGUOUS, 1, (4, 2, 2, 16, 64), 0),
             ("layered 30 B chunks, odd slot stride", PoolKind.LAYERED, 4, (3, 1, 10), 3),
             ("layered 103,700 B chunks (2 tiles + tail)", PoolKind.LAYERED, 2, (100, 1, 1037),
              0)]
    results, rows = [], []
    rng = np.random.default_rng(7)
    for label, kind, n_chunks, shape, pad in cases:
        blocks, nslots = 13, 11
        tensors = [cupy.asarray(rng.integers(0, 256, (blocks, *shape), dtype=np.uint8))
                   for _ in range(n_chunks)]
        pool = (KVPool.layered(tensors[0::2], tensors[1::2]) if kind is PoolKind.LAYERED
                else KVPool.contiguous(tensors[0]))
        geom = pool.geometry()
        for d in Direction:
            for path in ("kernel", "dma"):
                slots = rng.integers(0, 256, (nslots, geom.payload_bytes + pad), dtype=np.uint8)
                if d is Direction.LOAD:
                    b = rng.permutation(blocks)[:9]
                    s = rng.integers(0, nslots, 9)
                else:
                    s = rng.permutation(nslots)[:9]
                    b = rng.integers(0, blocks, 9)
                want_slots = slots.copy()
                want = [cupy.asnumpy(t).reshape(blocks, -1).copy() for t in tensors]
                reference_copy(d, want_slots, want, geom, s.astype(np.int64), b.astype(np.int64))
                backend = CudaBackend(geom, pool.chunks, slots, slot_geometry(slots),
                                      force_path=path)
                with TransferEngine(pool, slots, backend=backend) as eng:
                    res = eng.wait(eng.submit(TransferJob(d, s, b)))
                exact = bool(res.all_ok and np.array_equal(slots, want_slots) and all(
                    np.array_equal(cupy.asnumpy(t).reshape(blocks, -1), w)
                    for t, w in zip(tensors, want, strict=True)))
                results.append({"case": label, "direction": d.value, "path": path,
                                "bit_exact": exact, "error": res.error})
                rows.append([label, d.value, path, exact])
    _table("GPU vs CPU reference", ["case", "dir", "path", "bit exact"], rows)
    if not all(r["bit_exact"] for r in results):
        raise AssertionError("GPU result differs from the CPU reference")
    return {"rows": results}


def _run_shape(kind: PoolKind, n_chunks: int, chunk: int, total: int, max_pairs: int,
               stream: Any) -> list[dict[str, Any]]:
    from kvtier.gpu.measure import Scratch, measure, scattered_pairs

    n = int(min(max_pairs, max(4, total // (n_chunks * chunk))))
    scr = Scratch.make(kind, n_chunks, chunk, n)
    try:
        s, b = scattered_pairs(n, n)
        out = []
        for d in Direction:
            t = measure(scr, d, s, b, stream)
            gb = {k: _gbps(t["bytes"], t[k]) for k in ("kernel", "dma", "loop", "ceiling")}
            out.append({"direction": d.value, "chunk_bytes": chunk, "n_chunks": n_chunks,
                        "pairs": n, "bytes": t["bytes"], **{f"{k}_gbps": v for k, v in gb.items()},
                        "kernel_over_ceiling": gb["kernel"] / gb["ceiling"],
                        "kernel_over_loop": gb["kernel"] / gb["loop"]})
        return out
    finally:
        scr.close()


SWEEP_CHUNKS = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 2 * MIB, 4 * MIB, 16 * MIB)


def gpu_sweep(chunks: tuple[int, ...] = SWEEP_CHUNKS, total: int = 256 * MIB,
              max_pairs: int = 4096) -> dict[str, Any]:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    rows, out = [], []
    for chunk in chunks:
        for r in _run_shape(PoolKind.CONTIGUOUS, 1, chunk, total, max_pairs, stream):
            out.append(r)
            rows.append([f"{chunk // KIB} KiB", r["direction"], r["pairs"], r["kernel_gbps"],
                         r["loop_gbps"], r["dma_gbps"], r["ceiling_gbps"],
                         r["kernel_over_ceiling"], r["kernel_over_loop"]])
    _table("GPU sweep, scattered blocks (GB/s, median of 5)",
           ["chunk", "dir", "blocks", "kernel", "loop", "dma", "ceiling", "k/ceil", "k/loop"],
           rows)
    return {"rows": out}


def gpu_goals(total: int = 512 * MIB, max_pairs: int = 1024) -> dict[str, Any]:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    out, rows = [], []
    for name, heads in (("llama3-8b tp1 (2 MiB blocks)", 8), ("llama3-8b tp8 rank", 1)):
        chunk = LLAMA["block_tokens"] * heads * LLAMA["head_dim"] * LLAMA["dtype_bytes"]
        for r in _run_shape(PoolKind.LAYERED, 2 * LLAMA["layers"], chunk, total, max_pairs,
                            stream):
            r["shape"] = name
            r["goal_ceiling"] = None if heads != 8 else r["kernel_over_ceiling"] >= 0.85
            r["goal_loop"] = r["kernel_over_loop"] >= 5.0
            out.append(r)
            rows.append([name, r["direction"], f"{chunk // KIB} KiB", r["pairs"],
                         r["kernel_gbps"], r["loop_gbps"], r["ceiling_gbps"],
                         r["kernel_over_ceiling"], r["kernel_over_loop"],
                         r["goal_ceiling"], r["goal_loop"]])
    _table("Goals: layout (a), Llama-3-8B, 16-token blocks (GB/s)",
           ["shape", "dir", "chunk", "blocks", "kernel", "loop", "ceiling", "k/ceil", "k/loop",
            ">=0.85 ceil", ">=5x loop"], rows)
    return {"rows": out}


def gpu_calib(results: Path = RESULTS, budget_bytes: int = 32 * MIB) -> dict[str, Any]:
    from kvtier.gpu.measure import calibrate_pool

    rows: list[Any] = []
    for heads in (8, 1):
        chunk = LLAMA["block_tokens"] * heads * LLAMA["head_dim"] * LLAMA["dtype_bytes"]
        cal = calibrate_pool(PoolGeometry(PoolKind.LAYERED, 1, 64, chunk, chunk), budget_bytes)
        rows.extend(cal.to_json()["rows"])  # type: ignore[arg-type]
    table = {"source": f"bench.gpu_transfer {datetime.now(UTC).isoformat()}", "rows": rows}
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu_transfer_calibration.json").write_text(json.dumps(table, indent=1))
    return table


def _gpu_device() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:
        print(f"no GPU: {type(exc).__name__}: {exc}".splitlines()[0])
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.gpu_transfer",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), metavar="DIR",
                    help="where the JSON goes (default bench/results)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (a smoke run: every section's setup, no meaningful numbers)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": "python -m bench.gpu_transfer" + (" --quick" if args.quick else ""),
        "sections": {}}
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [("cpu", cpu_section)]
    device = _gpu_device()
    report["gpu"] = device
    if device is None:
        print("\nno GPU: CuPy/CUDA not available — ran the CPU reference section only; GPU "
              "numbers are pending a GPU session (run this script there).")
    else:
        print(f"\nGPU: {device}")
        quick = {"sweep": {"chunks": (4 * KIB, 64 * KIB), "total": MIB, "max_pairs": 64},
                 "goals": {"total": 4 * MIB, "max_pairs": 4}, "calib": {"budget_bytes": MIB}}
        size = quick if args.quick else {"sweep": {}, "goals": {}, "calib": {}}
        sections += [("gpu_check", gpu_check),
                     ("gpu_sweep", functools.partial(gpu_sweep, **size["sweep"])),
                     ("gpu_goals", functools.partial(gpu_goals, **size["goals"])),
                     ("gpu_calib", functools.partial(gpu_calib, results, **size["calib"]))]
    failed = []
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            report["sections"][name] = {"ok": True, **fn()}
        except Exception as exc:
            failed.append(name)
            traceback.print_exc()
            report["sections"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report["sections"][name]["seconds"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1, default=str)
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu_transfer.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_transfer.json").write_text(text)
    print(f"\nsections failed: {failed or 'none'}; JSON in {results / 'gpu_transfer.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
