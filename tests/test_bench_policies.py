"""`python -m bench.policies --quick`: the CI smoke run writes its JSON, table and plots; the
summary, goals and min row on a small input whose figures are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import policies
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
    assert workloads == {"chat", "docqa", "agentic", "rag", "longreuse", "docchat", "tenants",
                         "drift", "conversation"}
    assert {s["workload"] for s in doc["summary"] if s["held_out"]} == {"drift", "conversation"}
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
    assert doc["goals"]["min_row"]["vs_peer"] == doc["goals"]["min_vs_best_peer_anywhere"]
    assert "| **min** (DRAM cells) |" in md and "| **min** (held-out DRAM cells) |" in md
    held = doc["goals"]["held_out_min_row"]
    assert {held["vs_lru_at"].split()[0], held["vs_peer_at"].split()[0]} <= {"drift",
                                                                             "conversation"}


def row(workload: str, tiers: str, fraction: float, seed: int, policy: str, hit: float,
        belady: float = 0.0, cpu_s: float = 1.0, ssd_written: int = 0) -> dict[str, Any]:
    return {"workload": workload, "tiers": tiers, "fraction": fraction, "seed": seed,
            "policy": policy, "hit_ratio": hit, "belady_hit_ratio": belady, "cpu_s": cpu_s,
            "ssd_blocks_written": ssd_written, "dram_blocks": 100}


def test_summary_goals_and_min_row_on_a_hand_worked_input() -> None:
    """Three cells written here, their ratios worked out by hand (not by the bench's code).

    chat, DRAM, 2%, two seeds: kvtier 0.30 / 0.50 (mean 0.40), LRU 0.20 / 0.30 (0.25), sieve
    0.34 / 0.30 (0.32), Belady 0.6 / 0.8 (0.7): x LRU 1.6, x best peer (sieve) 1.25, x Belady
    0.4 / 0.7, Belady x LRU 2.8, worst seed x LRU min(1.5, 0.5 / 0.3) = 1.5.
    rag, DRAM, 10%, one seed: kvtier 0.45, LRU 0.50, vllm-arc 0.60: x LRU 0.9, x peer 0.75.
    rag, DRAM+SSD, 10%: kvtier 0.1 vs LRU 0.5 (x LRU 0.2) is not a DRAM cell, so not the min.
    """
    rows = [
        row("chat", "dram", 0.02, 1, "kvtier", 0.30, 0.6, cpu_s=2.0),
        row("chat", "dram", 0.02, 2, "kvtier", 0.50, 0.8, cpu_s=3.0),
        row("chat", "dram", 0.02, 1, "lru", 0.20, cpu_s=1.0),
        row("chat", "dram", 0.02, 2, "lru", 0.30, cpu_s=2.0),
        row("chat", "dram", 0.02, 1, "sieve", 0.34),
        row("chat", "dram", 0.02, 2, "sieve", 0.30),
        row("rag", "dram", 0.10, 1, "kvtier", 0.45, 0.9),
        row("rag", "dram", 0.10, 1, "lru", 0.50),
        row("rag", "dram", 0.10, 1, "vllm-arc", 0.60),
        row("rag", "dram+ssd", 0.10, 1, "kvtier", 0.1, 0.9, ssd_written=7),
        row("rag", "dram+ssd", 0.10, 1, "lru", 0.5, ssd_written=40),
    ]
    summary = policies.summarise(rows)
    got = [(s["workload"], s["tiers"], s["fraction"], s["best_peer"]) for s in summary]
    assert got == [("chat", "dram", 0.02, "sieve"), ("rag", "dram", 0.10, "vllm-arc"),
                   ("rag", "dram+ssd", 0.10, "lru")]
    chat, rag, rag_ssd = summary
    assert chat["kvtier"] == pytest.approx(0.40) and chat["lru"] == pytest.approx(0.25)
    assert chat["best_peer_hit"] == pytest.approx(0.32)
    assert chat["vs_lru"] == pytest.approx(1.6) and chat["vs_peer"] == pytest.approx(1.25)
    assert chat["vs_belady"] == pytest.approx(0.4 / 0.7)
    assert chat["belady_vs_lru"] == pytest.approx(2.8)
    assert chat["worst_seed_vs_lru"] == pytest.approx(1.5)
    assert rag["vs_lru"] == pytest.approx(0.9) and rag["vs_peer"] == pytest.approx(0.75)
    assert rag_ssd["vs_lru"] == pytest.approx(0.2)
    assert rag_ssd["ssd_written"] == {"kvtier": 7, "lru": 40}

    lo = policies.minimum(summary)
    # no vllm-reuse rows: x max(LRU, filter) is x LRU (1.6 and 0.9)
    assert lo == {"vs_lru": pytest.approx(0.9), "vs_lru_at": "rag 10%",
                  "vs_filter": pytest.approx(0.9), "vs_filter_at": "rag 10%",
                  "vs_peer": pytest.approx(0.75), "vs_peer_at": "rag 10% (vllm-arc)"}
    assert policies.minimum(summary, held_out=True) is None
    g = policies.goals(summary, rows)
    assert g["min_vs_best_peer_anywhere"] == pytest.approx(0.75)
    assert g["min_vs_lru_anywhere"] == pytest.approx(0.9)
    assert g["goal_never_below_lru_1pct"] is False  # 0.9 < 0.99
    assert g["geomean_vs_lru"] == pytest.approx(1.2)  # sqrt(1.6 * 0.9)
    # only chat 2% is at <= 5%
    assert g["min_vs_lru_at_1_5pct"] == pytest.approx(1.6)
    assert g["goal_1_2x_lru_at_1_5pct"] is True
    assert g["min_vs_best_peer_at_1_5pct"] == pytest.approx(1.25)
    assert g["cells_1_5pct_where_belady_under_1_2x_lru"] == []
    # replay time kvtier / LRU per (workload, seed, fraction) of DRAM rows: 2/1, 3/2, 1/1
    assert g["median_replay_time_vs_lru"] == pytest.approx(1.5)
    assert g["max_replay_time_vs_lru"] == pytest.approx(2.0)
    md = policies.markdown(summary).splitlines()
    assert md[2] == ("| chat | dram | 2% | 0.4000 | 0.2500 | sieve | 0.3200 | 1.60 | 1.25 | 0.57 | "
                     "2.80 | 1.50 | 0.0 |  |  |")
    assert md[-1] == ("| **min** (DRAM cells) | dram | 1–20% | | | rag 10% (vllm-arc) | | "
                      "**0.900** (rag 10%) | **0.750** | | | | | | |")
