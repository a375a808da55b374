"""`python -m bench.policies --quick`: the CI smoke run writes its JSON, table and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.daemon_fixture import ROOT


def test_quick_run_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.policies", "--quick", "--trace", str(tmp_path / "none"),
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "shared trace is skipped" in proc.stdout
    doc = json.loads((out / "policies.json").read_text())
    workloads = {s["workload"] for s in doc["summary"]}
    assert workloads == {"chat", "docqa", "agentic", "rag"}
    assert {r["policy"] for r in doc["rows"]} >= {"lru", "kvtier", "vllm-arc", "sieve"}
    assert all(r["stranded_blocks"] == 0 for r in doc["rows"])
    assert any(r["ssd_blocks_written"] for r in doc["rows"] if r["tiers"] == "dram+ssd")
    assert set(doc["goals"]) >= {"min_vs_lru_at_1_5pct", "median_replay_time_vs_lru"}
    for w in workloads:
        assert (out / f"policies_{w}.png").stat().st_size > 10_000
    md = (out / "policies.md").read_text()
    assert "| chat | dram | 2% |" in md
    assert "| Belady ×LRU |" in md.splitlines()[0]
    for s in doc["summary"]:  # the clairvoyant bound is above every online policy, per cell
        if s["tiers"] == "dram":
            assert s["belady"] >= max(s["hit"].values()) - 1e-9, s
            assert s["belady"] > 0 and s["lru"] > 0, s
    small = {f"{s['workload']} {s['fraction']:.0%}" for s in doc["summary"]
             if s["tiers"] == "dram" and s["belady_vs_lru"] < 1.2}
    assert set(doc["goals"]["cells_1_5pct_where_belady_under_1_2x_lru"]) == small
