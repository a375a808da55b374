"""`bench.gpu_check` (scripts/gpu_check.sh) without a GPU: its dry run runs every step's real
command line with CPU overrides (so a step whose flags or setup rot fails here), and the install
step plans from pyproject.toml and carried wheels and says which wheel is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import INSTALL_S, TOTAL_S, Step, plan_install, wheels_here

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_runs_every_step(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--results",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    failed = {k: (v.get("error"), v.get("log_tail", "")[-3000:]) for k, v in steps.items()
              if v["status"] != "ok"}
    assert proc.returncode == 0 and not failed, (proc.stdout[-3000:], failed)
    assert list(steps) == ["install", *(s.name for s in gpu_check.steps())]
    assert report["dry_run"] and report["ok"] and report["seconds"] < TOTAL_S
    assert steps["install"]["missing"] == [] and steps["install"]["install"] == []
    assert report["environment"]["torch"].startswith("2.") and "vllm" in report["environment"]
    assert steps["pytest"]["counts"]["collected"] >= 200  # the dtype matrix alone is 192
    transfer = steps["gpu-transfer"]["json"]
    assert transfer["gpu"] == "FakeGPU (host memory)"  # the GPU sections ran, on the fake
    assert all(s["ok"] for s in transfer["sections"].values())
    assert set(transfer["sections"]) == {"cpu", "gpu_check", "gpu_sweep", "gpu_goals",
                                         "gpu_calib"}
    loads = steps["vllm-loads"]["json"]
    assert loads["args"]["device"] == "cpu" and loads["args"]["layers"] == "2"  # overridden
    assert loads["args"]["kv_heads"] == "8" and set(loads["summary"]) == {
        "torch", "engine", "one copy"}
    assert "dram_read" in steps["calibrate"]["json"]["links"]
    engine = steps["engine"]["json"]
    assert [c["tokens"] for c in engine["contexts"]] == [128, 256]
    assert all(c["hits_exact"] and c["all_hit"] for c in engine["contexts"])
    names = {g["goal"].split(",")[0] for g in report["goals"]}
    assert names == {"2 MiB blocks vs one contiguous copy", "16-token blocks vs per-chunk loop",
                     "logits with kvtier hits = recompute"}  # no 32K context in a dry run
    assert "GPU check (dry run)" in proc.stdout and "goals:" in proc.stdout
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.log"]


def test_the_pytest_step_covers_every_gpu_module() -> None:
    files = gpu_check.gpu_test_files()
    assert {"tests/test_transfer_gpu.py", "tests/test_daemon_gpu.py", "tests/test_dram.py",
            "tests/test_vllm_loads_gpu.py", "tests/test_calibrate_gpu.py",
            "tests/test_engine.py"} <= set(files)
    step = next(s for s in gpu_check.steps() if s.name == "pytest")
    assert set(files) <= set(step.argv) and "gpu" in step.argv


def test_budgets_fit_in_eight_minutes() -> None:
    assert INSTALL_S + sum(s.budget_s for s in gpu_check.steps()) <= TOTAL_S <= 480 - 10


def test_a_failed_or_timed_out_step_is_recorded_and_the_next_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check, "steps", lambda: (
        Step("hangs", ("-c", "import time; time.sleep(600)"), 1, ()),
        Step("fails", ("-c", "raise SystemExit(3)"), 60, ()),
        Step("works", ("-c", "print('fine')"), 60, ()),
    ))
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_check.main(["--dry-run", "--results", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    got = {k: (v["status"], v.get("rc")) for k, v in report["steps"].items()}
    assert got == {"install": ("ok", None), "hangs": ("timed out", -9), "fails": ("failed", 3),
                   "works": ("ok", 0)}
    assert "fine" in report["steps"]["works"]["log_tail"]
    assert "timed out" in capsys.readouterr().out


def test_bad_steps_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--steps", "pytest,nope"])
    assert exc.value.code == 2 and "--steps: choose from" in capsys.readouterr().err


def wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = (),
          module: str | None = None) -> Path:
    """A pure-Python wheel pip can install (py3-none-any)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        if module:
            z.writestr(f"{module}.py", f"NAME = {name!r}\n")
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def test_install_plan_names_the_missing_wheel(tmp_path: Path) -> None:
    wheels, notes = wheels_here(tmp_path)
    plan = plan_install(["lmdb>=1.4", "numpy>=1.26"], {"numpy": "2.0.1"}.get,
                        lambda k: [], wheels)
    assert plan.install == [] and plan.satisfied == {"numpy": "2.0.1"} and notes == []
    assert plan.missing == ["lmdb>=1.4: not installed here, no wheel in .whl/"]


def test_install_plan_takes_wheels_their_needs_and_extras(tmp_path: Path) -> None:
    wheel(tmp_path, "grpcio-health-checking", "1.85.1",
          ("protobuf<8.0.0,>=7.35.1", "grpcio>=1.85.1"))
    wheel(tmp_path, "grpcio", "1.85.3", ("typing-extensions~=4.12",))
    wheel(tmp_path, "redis", "8.2.0",
          ("async-timeout>=4.0.3; python_full_version < '3.11.3'",
           'hiredis>=3.2.0; extra == "hiredis"'))
    wheel(tmp_path, "hiredis", "3.5.0")
    wheel(tmp_path, "cbor2", "5.0.0")  # too old for the requirement below
    wheels, _ = wheels_here(tmp_path)
    have = {"grpcio": "1.80.0", "protobuf": "7.36.2", "typing-extensions": "4.15.0",
            "async-timeout": "5.0.1"}
    plan = plan_install(["grpcio-health-checking>=1.60", "redis[hiredis]>=5", "cbor2>=5.6",
                         "protobuf>=7.35.1"], have.get, lambda k: [], wheels)
    assert sorted(w.name for w in plan.install) == ["grpcio", "grpcio-health-checking",
                                                   "hiredis", "redis"]
    assert plan.missing == ["cbor2>=5.6: not installed here, wheel cbor2-5.0.0-py3-none-any.whl "
                            "in .whl/"]
    assert plan.satisfied == {"protobuf": "7.36.2", "typing-extensions": "4.15.0"}
    wheel(tmp_path, "hiredis", "3.4.0")
    assert "a second wheel of hiredis" in " ".join(wheels_here(tmp_path)[1])


def test_install_step_installs_into_its_site(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    wheel(wheels, "kvtier-probe", "1.0", module="kvtier_probe")
    site = tmp_path / "site"
    out = gpu_check.install(site, dry=False, reqs=["kvtier-probe>=1", "numpy>=1.26"],
                            wheel_dir=wheels)
    assert out["ok"] and out["install"] == ["kvtier_probe-1.0-py3-none-any.whl"], out
    proc = subprocess.run([sys.executable, "-c", "import kvtier_probe; print(kvtier_probe.NAME)"],
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip() == "kvtier-probe", proc.stderr
    again = gpu_check.install(site, dry=False, reqs=["kvtier-probe>=1"], wheel_dir=wheels)
    assert again["install"] == [] and again["satisfied"] == {"kvtier-probe": "1.0"}


def test_the_requirements_are_pyprojects() -> None:
    reqs = gpu_check.requirements()
    assert "lmdb>=1.4" in reqs and "redis[hiredis]>=5" in reqs and "pytest>=8" in reqs
    assert not any(r.startswith(("ruff", "mypy")) for r in reqs)
    pins = (ROOT / "scripts/gpu_wheels.txt").read_text().split()
    named = {gpu_check.norm(p.split("==")[0]) for p in pins if "==" in p}
    assert {"lmdb", "cbor2", "grpcio-health-checking", "redis", "hiredis", "msgspec",
            "pyzmq"} <= named


def test_test_daemons_see_the_install_steps_packages(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The install step's directory is on the steps' PYTHONPATH: a daemon a test starts keeps
    it (after the checkout), or it could not import what was installed there (lmdb...)."""
    from tests.daemon_fixture import DaemonProc

    site = tmp_path / "site"
    env = gpu_check.step_env(site)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(site), str(ROOT)]
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    paths = DaemonProc(tmp_path / "d").env["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(ROOT) and str(site) in paths


def test_goals_from_the_steps_json() -> None:
    transfer = {"sections": {"gpu_goals": {"rows": [
        {"direction": "load", "goal_ceiling": True, "kernel_over_ceiling": 0.9,
         "kernel_over_loop": 6.0},
        {"direction": "store", "goal_ceiling": None, "kernel_over_ceiling": 0.2,
         "kernel_over_loop": 4.0}]}}}
    engine = {"contexts": [
        {"tokens": 8192, "hits_exact": False, "cold_exact": True, "hits_max_abs_diff": 0.01,
         "recompute_spread": 0.02, "speedup_p50": 3.0},
        {"tokens": 32768, "hits_exact": True, "cold_exact": True, "hits_max_abs_diff": 0.0,
         "recompute_spread": 0.0, "speedup_p50": 9.5}]}
    got = {g["goal"]: g["met"] for g in gpu_check.goals(
        {"gpu-transfer": {"json": transfer}, "engine": {"json": engine}})}
    assert got == {
        "2 MiB blocks vs one contiguous copy, load": True,
        "16-token blocks vs per-chunk loop, TP1 load": True,
        "16-token blocks vs per-chunk loop, TP8 rank store": False,
        "logits with kvtier hits = recompute, 8192 tokens": True,  # within the spread
        "logits with kvtier hits = recompute, 32768 tokens": True,
        "TTFT DRAM hits vs recompute, 32768 tokens": False}
    odd = {"vllm-loads": {"json": {"something": "else"}}, "engine": {"json": {"contexts": [{}]}}}
    assert "unreadable" in gpu_check.figures("vllm-loads", odd["vllm-loads"])
    assert [g["met"] for g in gpu_check.goals(odd)] == [False]
