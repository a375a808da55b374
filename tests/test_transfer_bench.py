"""`python -m bench.gpu_transfer` runs its CPU reference section and exits 0 without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.gpu import available

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(available(), reason="on a GPU machine the script runs the GPU sections")
def test_bench_without_gpu_runs_cpu_section(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_transfer", "--results",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert proc.returncode == 0, proc.stderr
    assert "no GPU" in proc.stdout and "CPU reference" in proc.stdout
    report = json.loads((tmp_path / "gpu_transfer.json").read_text())
    assert report["gpu"] is None and list(report["sections"]) == ["cpu"]
    rows = report["sections"]["cpu"]["rows"]
    assert len(rows) == 4 and all(r["loop_equals_fancy"] and r["fancy_gbps"] > 0 for r in rows)
