"""`python -m bench.policy_sweep`: the fast one-policy sweep and its `--patch` variants."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier.sim.workloads import WORKLOADS
from tests.daemon_fixture import ROOT


def _sweep(tmp_path: Path, *args: str, env: dict[str, str] | None = None
           ) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.policy_sweep", "--trace", str(tmp_path / "none"),
         "--seeds", "1", "--requests", "150", "--jobs", "1", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, **(env or {})})
    return proc, out


def test_lru_against_itself_is_one_everywhere(tmp_path: Path) -> None:
    proc, out = _sweep(tmp_path, "--policy", "lru")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert {r["workload"] for r in doc["summary"]} == set(WORKLOADS)
    assert len(doc["summary"]) == len(WORKLOADS) * 6  # 5 DRAM-only capacities + two-tier
    assert all(r["vs_lru"] == 1.0 for r in doc["summary"])
    assert doc["totals"]["min_vs_lru"] == 1.0


def test_a_patch_changes_the_policy_under_test_only(tmp_path: Path) -> None:
    base, out = _sweep(tmp_path)
    assert base.returncode == 0, base.stderr
    plain = {(r["workload"], r["cell"]): r for r in json.loads(out.read_text())["summary"]}
    proc, out = _sweep(tmp_path, "--patch", "bench/variants/knockout.py",
                       env={"OFF": "choice-lfu"})
    assert proc.returncode == 0, proc.stderr
    patched = {(r["workload"], r["cell"]): r for r in json.loads(out.read_text())["summary"]}
    assert all(patched[k]["lru"] == plain[k]["lru"] for k in plain)  # LRU runs unpatched
    assert any(patched[k]["hit"] != plain[k]["hit"] for k in plain)
    proc, out = _sweep(tmp_path, "--patch", "bench/variants/knockout.py",
                       env={"OFF": "choice-s3"})
    assert proc.returncode == 0, proc.stderr
    patched = {(r["workload"], r["cell"]): r for r in json.loads(out.read_text())["summary"]}
    assert all(patched[k]["lru"] == plain[k]["lru"] for k in plain)  # LRU runs unpatched
    assert any(patched[k]["hit"] != plain[k]["hit"] for k in plain)


def test_missing_patch_file_is_a_usage_error(tmp_path: Path) -> None:
    proc, out = _sweep(tmp_path, "--patch", str(tmp_path / "nope.py"))
    assert proc.returncode == 2
    assert "no such file" in proc.stderr
    assert not out.exists()
