"""Every kernels/*.cu compiles with nvcc for sm_80 and sm_90, warnings as errors (no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.gpu.kernels import SOURCE, kernel_dir

NVCC = shutil.which("nvcc")
KERNELS = sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.cu"))


def test_kernel_sources_exist_and_resolve() -> None:
    assert [p.name for p in KERNELS] == [SOURCE]
    assert (kernel_dir() / SOURCE).read_bytes() == KERNELS[0].read_bytes()


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_compiles_for_sm80_and_sm90(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "k.fatbin"
    cmd = [
        str(NVCC), "-fatbin", "-std=c++17", "-DKV_THREADS=128", "-Werror", "all-warnings",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        "-o", str(out), str(source),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    image = out.read_bytes()
    assert image.count(b"kv_scatter") >= 2 and image.count(b"kv_gather") >= 2  # one per arch
