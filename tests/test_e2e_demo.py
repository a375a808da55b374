"""`kvtier demo`: starts a temporary daemon when none runs, reports TTFT and hits, and fails
cleanly (one line, exit 2) without torch or with bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from tests.daemon_fixture import ROOT, DaemonProc

pytest.importorskip("torch")


def run_demo(args: list[str], env_extra: dict[str, str], code: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "kvtier", "demo"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=240)


def test_demo_starts_a_temporary_daemon_and_reports(tmp_path: Path) -> None:
    sock = tmp_path / "none" / "kvtier.sock"
    proc = run_demo(["--preset", "tiny", "--turns", "3", "--system-tokens", "64", "--json"],
                    {"KVTIER_SOCKET": str(sock)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["daemon"] == "temporary daemon"
    turns = out["turns"]
    assert [t["identical"] for t in turns] == [True] * 3
    assert turns[0]["loaded_blocks"] == 0
    # Turn 2's prompt = turn 1's prompt + reply + message; turn 1's prompt blocks are cached:
    # (64 + 160) // 16 = 14 full blocks. Turn 3's: turn 2's prompt, 224 + 24 + 160 = 408 tokens,
    # 408 // 16 = 25 blocks. The planner fetches all of them: one fetch costs an Acquire round
    # trip (~200 µs, the h2d seed) plus a few KiB per block, recomputing them costs the prefill
    # rate turn 1 measured (224 tokens in ~5 ms on dev-2c, ~1 ms on a fast core), and every
    # block fetched after the first saves more compute than its copy costs, so the cut is 0 or
    # all; a load on the machine slows the compute it prices, which favours fetching further.
    assert [(t["hit_blocks"], t["loaded_blocks"]) for t in turns] == [(0, 0), (14, 14), (25, 25)]
    assert out["blocks_fetched"] == 14 + 25
    # usable blocks per turn: (prompt - 1) // 16 of 224, 408, 592 tokens = 13 + 25 + 36
    assert out["block_hit_ratio"] == pytest.approx(39 / 74)
    assert not sock.exists()


def test_demo_uses_a_running_daemon_and_prints_a_table(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        proc = run_demo(["--preset", "tiny", "--turns", "2", "--system-tokens", "32",
                         "--socket", str(d.socket)], {})
        assert proc.returncode == 0, proc.stderr
        assert f"running daemon on {d.socket}" in proc.stdout
        assert "outputs identical: True" in proc.stdout
        assert "Traceback" not in proc.stderr
        assert "turn/s" not in proc.stderr  # no progress bar into a pipe or a log
    finally:
        d.stop()


def test_demo_without_torch_is_a_one_line_error() -> None:
    code = ("import sys; sys.modules['torch'] = None; from kvtier.cli import main; "
            "sys.exit(main(['demo'] + sys.argv[1:]))")
    proc = run_demo([], {}, code=code)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("kvtier demo: error: the demo needs torch (its CPU build: pip "
                                   "install 'torch==2.13.0+cpu' --extra-index-url "
                                   "https://download.pytorch.org/whl/cpu)")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--turns", "0"], "--turns must be"), (["--preset", "huge"], "unknown engine model"),
     (["--system-tokens", "5"], "--system-tokens must be"),
     (["--socket", "/nonexistent/kvtier.sock"], "no kvtier daemon at")],
)
def test_demo_bad_flags_exit_2(args: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_e2e_short_run_is_bit_exact(tmp_path: Path) -> None:
    """The default run's short version of the next test (~10 s): recompute against SSD hits
    after a daemon restart, every logit bit-exact, the follow-ups really loaded from SSD."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.e2e", "--quick", "--modes", "recompute,ssd",
         "--results", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "e2e.json").read_text())
    assert out["all_bit_exact"] is True
    assert {r["mode"] for r in out["records"]} == {"recompute", "ssd"}
    assert all(r["exact"] for r in out["records"])
    follow = [r for r in out["records"] if r["mode"] == "ssd" and r["cls"].endswith("/follow")
              and not r["cls"].startswith("short")]
    assert follow and all(r["ssd_blocks"] > 0 for r in follow), follow


@pytest.mark.slow
def test_bench_e2e_quick_run_is_bit_exact_and_complete(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.e2e", "--quick", "--results", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "e2e.json").read_text())
    assert out["all_bit_exact"] is True
    modes = {r["mode"] for r in out["records"]}
    assert modes == {"recompute", "dram", "ssd", "plan-dram", "plan-ssd"}
    ssd_follow = [r for r in out["records"] if r["mode"] == "ssd" and r["cls"] == "doc/follow"]
    assert ssd_follow and all(r["ssd_blocks"] > 0 for r in ssd_follow)
    assert "doc/follow" in out["summary"] and "planner" in out
