"""`kvtier calibrate` measurements and their JSON file, which seeds the daemon's `RateBook`.

Measures, each with the fastest path present:

* copy (DRAM ↔ GPU): with a CUDA device, pinned-host ↔ device copies timed by CUDA events (CuPy's
  `cudaMemcpyAsync`, else torch's `copy_`; H2D = dram_read, D2H = dram_write); otherwise a host
  memcpy (`numpy.copyto`) of >= 256 MiB buffers (16 MiB with `quick`), the stand-in for a CPU
  engine. Per-call latency: the median of 4 KiB copies.
* SSD read on the data dir: write a temp file, fsync, drop it from the page cache with
  ``posix_fadvise(DONTNEED)``, read it back in 2 MiB (block-sized) reads; latency = median of 4 KiB
  reads at random offsets after another drop. The file is always removed. On a file system that
  ignores the advice (tmpfs, some overlays) the read comes from memory: a result above 20 GB/s is
  flagged ``suspect_cached``.
* prefill FLOP rate: a bf16 matmul of Llama-MLP shape (8192×4096 @ 4096×14336) on a CUDA GPU via
  torch; on CPU a transformer-layer-shaped fp32 forward (QKV, attention over the block, output
  projection, gated MLP) in torch, or numpy when torch is absent.

Per-request latency also includes the daemon's control-plane round trip (Acquire/Release), which
calibration cannot time without a daemon; `CONTROL_RTT_S` (assumed, recorded in the file) is added
to each measured per-call latency when seeding the planner.

File format (``<data_dir>/calibration.json``, version 1): ``{"version", "created_utc", "host",
"quick", "control_rtt_s", "links": {link: {"bytes_per_s", "latency_s", "method", ...}},
"prefill": {"flops_per_s", "method", ...} | null}``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.errors import UsageError
from kvtier.daemon.rates.book import Link, LinkRate

FORMAT_VERSION = 1
FILE_NAME = "calibration.json"
CONTROL_RTT_S = 150e-6
"""Assumed Acquire + Release round trip over a Unix socket (grpc.aio), added to copy latency."""
SUSPECT_CACHED_BYTES_PER_S = 20e9
STEPS = ("copy", "ssd", "prefill")


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured rates. `links` holds measured links only; `details[name]` describes each step."""

    links: Mapping[Link, LinkRate]
    prefill_flops_per_s: float | None
    details: Mapping[str, Any] = field(default_factory=dict)
    control_rtt_s: float = CONTROL_RTT_S

    def seed_links(self) -> dict[Link, LinkRate]:
        """Links as the planner should see them: latency + the control-plane round trip."""
        return {k: LinkRate(v.bytes_per_s, v.latency_s + self.control_rtt_s)
                for k, v in self.links.items()}

    def to_json(self) -> dict[str, Any]:
        links = {
            str(k): {"bytes_per_s": v.bytes_per_s, "latency_s": v.latency_s,
                     **self.details.get(str(k), {})}
            for k, v in self.links.items()
        }
        prefill = None
        if self.prefill_flops_per_s is not None:
            prefill = {"flops_per_s": self.prefill_flops_per_s,
                       **self.details.get("prefill", {})}
        return {
            "version": FORMAT_VERSION,
            "created_utc": self.details.get("created_utc", ""),
            "host": self.details.get("host", ""),
            "quick": bool(self.details.get("quick", False)),
            "control_rtt_s": self.control_rtt_s,
            "links": links,
            "prefill": prefill,
        }


def calibration_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / FILE_NAME


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """Writes atomically (temp file + rename), creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _positive(doc: Mapping[str, Any], key: str, where: str, zero_ok: bool = False) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or (
        v < 0 if zero_ok else v <= 0
    ):
        raise UsageError(f"{where}: {key} must be a finite number {'>=' if zero_ok else '>'} 0")
    return float(v)


def load_calibration(path: str | Path) -> Calibration:
    """Reads a calibration file. A missing, unreadable or malformed file raises `UsageError`."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"no calibration at {path} (run `kvtier calibrate`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read calibration {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise UsageError(f"{path}: not a version-{FORMAT_VERSION} kvtier calibration file")
    links_doc = doc.get("links")
    if not isinstance(links_doc, dict):
        raise UsageError(f"{path}: 'links' must be an object")
    links: dict[Link, LinkRate] = {}
    details: dict[str, Any] = {k: doc.get(k) for k in ("created_utc", "host", "quick")}
    for name, entry in links_doc.items():
        try:
            link = Link(name)
        except ValueError:
            raise UsageError(f"{path}: unknown link {name!r}") from None
        if not isinstance(entry, dict):
            raise UsageError(f"{path}: links.{name} must be an object")
        where = f"{path}: links.{name}"
        links[link] = LinkRate(
            _positive(entry, "bytes_per_s", where), _positive(entry, "latency_s", where, True)
        )
        details[name] = {k: v for k, v in entry.items() if k not in ("bytes_per_s", "latency_s")}
    prefill = doc.get("prefill")
    flops = None
    if prefill is not None:
        if not isinstance(prefill, dict):
            raise UsageError(f"{path}: 'prefill' must be an object or null")
        flops = _positive(prefill, "flops_per_s", f"{path}: prefill")
        details["prefill"] = {k: v for k, v in prefill.items() if k != "flops_per_s"}
    rtt = _positive(doc, "control_rtt_s", str(path), True) if "control_rtt_s" in doc else 0.0
    return Calibration(links, flops, details, rtt)


def load_calibration_if_present(data_dir: str | Path) -> Calibration | None:
    """The daemon's start-up call: None when the data dir has no calibration file yet."""
    path = calibration_path(data_dir)
    return load_calibration(path) if path.exists() else None


# ---- measurements ---------------------------------------------------------------------------


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cuda_ready() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no cupy, no driver, no device: all mean "host path"
        return False


def measure_copy(nbytes: int, repeats: int = 5) -> tuple[dict[Link, LinkRate], dict[str, Any]]:
    """DRAM↔GPU copy bandwidth and per-call latency (host memcpy without a GPU)."""
    if _cuda_ready():
        return _measure_cuda_copy(nbytes, repeats)
    torch = _torch_cuda()
    if torch is not None:
        return _measure_torch_copy(torch, nbytes, repeats)
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    bw_read = nbytes / _median_time(lambda: np.copyto(dst, src), repeats)
    bw_write = nbytes / _median_time(lambda: np.copyto(src, dst), repeats)
    small_src, small_dst = src[:4096], dst[:4096]
    lat = _median_time(lambda: np.copyto(small_dst, small_src), 2001)
    info = {"method": "host-memcpy (no CUDA device)", "buffer_bytes": nbytes}
    return {Link.DRAM_READ: LinkRate(bw_read, lat), Link.DRAM_WRITE: LinkRate(bw_write, lat)}, info


def _measure_cuda_copy(nbytes: int, repeats: int) -> tuple[dict[Link, LinkRate], dict[str, Any]]:
    import cupy as cp

    rt = cp.cuda.runtime
    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(pinned, np.uint8, nbytes)
    host[:] = 1
    dev = cp.empty(nbytes, cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    h_ptr, d_ptr = host.ctypes.data, dev.data.ptr

    def timed(dst: int, src: int, size: int, kind: int) -> float:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        rt.memcpyAsync(dst, src, size, kind, stream.ptr)
        end.record(stream)
        end.synchronize()
        return float(cp.cuda.get_elapsed_time(start, end)) / 1e3

    out: dict[Link, LinkRate] = {}
    for link, dst, src, kind in (
        (Link.DRAM_READ, d_ptr, h_ptr, rt.memcpyHostToDevice),
        (Link.DRAM_WRITE, h_ptr, d_ptr, rt.memcpyDeviceToHost),
    ):
        timed(dst, src, nbytes, kind)  # warm-up
        bw = nbytes / statistics.median(timed(dst, src, nbytes, kind) for _ in range(repeats))

        def small(dst: int = dst, src: int = src, kind: int = kind) -> None:
            rt.memcpyAsync(dst, src, 4096, kind, stream.ptr)
            stream.synchronize()

        out[link] = LinkRate(bw, _median_time(small, 201))
    name = rt.getDeviceProperties(0)["name"]
    device = name.decode() if isinstance(name, bytes) else str(name)
    return out, {"method": "cuda-memcpy pinned", "device": device, "buffer_bytes": nbytes}


def _torch_cuda() -> Any:
    """torch when it is importable and sees a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _measure_torch_copy(
    torch: Any, nbytes: int, repeats: int
) -> tuple[dict[Link, LinkRate], dict[str, Any]]:
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[Link, LinkRate] = {}
    for link, dst, src in ((Link.DRAM_READ, dev, host), (Link.DRAM_WRITE, host, dev)):

        def timed(dst: Any = dst, src: Any = src) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        timed()
        bw = nbytes / statistics.median(timed() for _ in range(repeats))
        small_dst, small_src = dst[:4096], src[:4096]

        def small(d: Any = small_dst, s: Any = small_src) -> None:
            d.copy_(s, non_blocking=True)
            torch.cuda.synchronize()

        out[link] = LinkRate(bw, _median_time(small, 201))
    info = {"method": "torch cuda copy pinned", "device": torch.cuda.get_device_name(0),
            "buffer_bytes": nbytes}
    return out, info


def measure_ssd_read(directory: str | Path, nbytes: int, repeats: int = 2) -> tuple[
    LinkRate, dict[str, Any]
]:
    """Sequential read bandwidth of a fresh file in `directory` with the page cache dropped."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create data dir {directory}: {exc.strerror}") from None
    path = directory / f".kvtier-calibrate-{os.getpid()}.tmp"
    chunk = 2 << 20
    nbytes = max(chunk, nbytes - nbytes % chunk)
    payload = os.urandom(chunk)
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise UsageError(f"cannot write in data dir {directory}: {exc.strerror}") from None
        try:
            for _ in range(nbytes // chunk):
                os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        buf = bytearray(chunk)
        view = memoryview(buf)

        def read_all() -> float:
            rfd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                while os.readv(rfd, [view]) == chunk:
                    pass
                return time.perf_counter() - t0
            finally:
                os.close(rfd)

        times = [read_all() for _ in range(repeats)]
        bw = nbytes / statistics.median(times)
        rfd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            rng = np.random.default_rng(0)
            offsets = rng.integers(0, nbytes // 4096, 64) * 4096
            lats = []
            for off in offsets:
                t0 = time.perf_counter()
                os.pread(rfd, 4096, int(off))
                lats.append(time.perf_counter() - t0)
        finally:
            os.close(rfd)
    finally:
        path.unlink(missing_ok=True)
    info = {
        "method": "read() after posix_fadvise(DONTNEED)",
        "path": str(directory),
        "file_bytes": nbytes,
        "suspect_cached": bw > SUSPECT_CACHED_BYTES_PER_S,
    }
    return LinkRate(bw, statistics.median(lats)), info


def measure_prefill(quick: bool = False) -> tuple[float, dict[str, Any]]:
    """Achieved prefill FLOP rate: bf16 matmul on a CUDA GPU, else a CPU layer-shaped forward."""
    cuda = _torch_cuda()
    if cuda is not None:
        return _torch_cuda_matmul(cuda, quick)
    try:
        import torch
    except ImportError:
        return _cpu_layer(None, quick)
    return _cpu_layer(torch, quick)


def _torch_cuda_matmul(torch: Any, quick: bool) -> tuple[float, dict[str, Any]]:
    m, k, n = (2048 if quick else 8192), 4096, 14336
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 5 if quick else 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    info = {"method": "torch bf16 matmul (cuda)", "device": torch.cuda.get_device_name(0),
            "shape": [m, k, n]}
    return 2.0 * m * k * n / seconds, info


def _cpu_layer(torch: Any, quick: bool) -> tuple[float, dict[str, Any]]:
    t, d, ff = (128, 512, 1536) if quick else (512, 1024, 3584)
    weights = [(d, 3 * d), (d, d), (d, 2 * ff), (ff, d)]
    flops = 2.0 * t * sum(a * b for a, b in weights) + 2.0 * 2.0 * t * t * d
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal(s, dtype=np.float32) / 32 for s in weights]
    x0 = rng.standard_normal((t, d), dtype=np.float32)
    if torch is not None:
        mm: Callable[[Any, Any], Any] = torch.matmul
        wsx: list[Any] = [torch.from_numpy(w) for w in ws]
        x: Any = torch.from_numpy(x0)
        method = f"torch fp32 layer forward (cpu, {torch.get_num_threads()} threads)"
    else:
        mm, wsx, x, method = np.matmul, list(ws), x0, "numpy fp32 layer forward (cpu)"

    def layer() -> None:
        qkv = mm(x, wsx[0])
        q, kk, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
        att = mm(mm(q, kk.T), v)
        h = mm(att, wsx[1])
        up = mm(h, wsx[2])
        mm(up[:, :ff] * up[:, ff:], wsx[3])

    layer()
    seconds = _median_time(layer, 5 if quick else 15)
    return flops / seconds, {"method": method, "tokens": t, "d_model": d, "d_ff": ff}


def run_calibration(
    data_dir: str | Path,
    quick: bool = False,
    skip: tuple[str, ...] = (),
    progress: bool = True,
) -> Calibration:
    """Runs the steps not in `skip` (see `STEPS`) with a tqdm bar on stderr."""
    from tqdm import tqdm

    copy_bytes = (16 << 20) if quick else (256 << 20)
    ssd_bytes = (16 << 20) if quick else (256 << 20)
    links: dict[Link, LinkRate] = {}
    details: dict[str, Any] = {
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "quick": quick,
    }
    flops: float | None = None
    steps = [s for s in STEPS if s not in skip]
    with tqdm(steps, desc="calibrate", unit="step", disable=not progress, leave=False) as bar:
        for step in bar:
            bar.set_postfix_str(step)
            if step == "copy":
                copy, info = measure_copy(copy_bytes)
                links.update(copy)
                details[str(Link.DRAM_READ)] = details[str(Link.DRAM_WRITE)] = info
            elif step == "ssd":
                rate, info = measure_ssd_read(data_dir, ssd_bytes)
                links[Link.SSD_READ] = rate
                details[str(Link.SSD_READ)] = info
            else:
                flops, details["prefill"] = measure_prefill(quick)
    return Calibration(links, flops, details)
