"""The whole GPU check in one command, on a CUDA machine: `scripts/gpu_check.sh` (docs/gpu.md).

    scripts/gpu_check.sh                    # install what is missing, run every step (<= 8 min)
    scripts/gpu_check.sh --steps engine     # a rerun of some steps
    scripts/gpu_check.sh --dry-run          # on a CPU: every step's setup and flags, in seconds

Steps, each a child process with a time budget (a step that fails or runs out of time is
recorded, the next one runs; the budgets add up to TOTAL_S):
  install       kvtier's requirements (pyproject.toml, and pytest's) the interpreter lacks, from
                the Python 3.12 manylinux wheels in .whl/ (scripts/fetch_gpu_wheels.sh), into a
                directory put first on the steps' PYTHONPATH; names any wheel that is missing
  pytest        `pytest -m gpu` over every test module with a gpu mark
  gpu-transfer  `bench.gpu_transfer`: bit-exact checks, chunk-size sweep, the goal shapes
  vllm-loads    `bench.vllm_loads --device cuda`: the connector's layer-by-layer loads
  calibrate     `kvtier calibrate`: copy, SSD and prefill rates
  engine        `bench.engine_ttft --device cuda`: reference-engine TTFT and logits, 8K and 32K
Writes gpu_check.json (every step's status, time, log tail and JSON, and the goals) and
gpu_check.log (all output) to --results (default: $OUT if set, else bench/results), the JSON
after each step; prints the table last. Exit status 0 when every step passed.

`--dry-run` runs each step's real command line with CPU overrides appended (argparse keeps the
last value, so every real flag is still parsed): pytest only collects, bench.gpu_transfer runs
`--quick` on the fake CuPy of tests/fake_cuda.py, the torch benches run `--device cpu` with tiny
sizes; install plans without installing. tests/test_gpu_check.py runs it in the normal suite.
This module imports only the standard library (and `packaging`, for the install step).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
TOTAL_S = 470
"""What the steps may take together (install included): within 8 minutes with the writing."""
INSTALL_S = 30
TEST_EXTRAS = ("pytest", "pytest-timeout", "hypothesis")
"""Of pyproject's dev extras, what the pytest step needs."""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: tuple[str, ...]
    """After the interpreter; "{work}" is the run's scratch directory."""
    budget_s: int
    dry: tuple[str, ...]
    """Appended to argv by --dry-run (CPU overrides: argparse keeps the last value)."""
    json: str | None = None
    """The step's JSON, in the scratch directory."""
    fake_cuda: bool = False
    """--dry-run runs it on tests/fake_cuda.py's CuPy."""


def gpu_test_files() -> list[str]:
    """Every test module with a gpu mark (so a new one cannot be left out)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if re.search(r"pytest\.mark\.gpu\b", p.read_text()))


def steps() -> tuple[Step, ...]:
    return (
        Step("pytest", ("-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        "--timeout", "120", "--junitxml", "{work}/pytest.xml",
                        *gpu_test_files()), 150, ("--collect-only",)),
        Step("gpu-transfer", ("-m", "bench.gpu_transfer", "--results", "{work}"), 90,
             ("--quick",), "gpu_transfer.json", fake_cuda=True),
        Step("vllm-loads", ("-m", "bench.vllm_loads", "--device", "cuda", "--layers", "32",
                            "--kv-heads", "8", "--head-size", "128", "--block-tokens", "16",
                            "--blocks", "128", "--repeats", "10",
                            "--json", "{work}/vllm_loads_cuda.json"), 45,
             ("--device", "cpu", "--layers", "2", "--blocks", "4", "--repeats", "1"),
             "vllm_loads_cuda.json"),
        Step("calibrate", ("-m", "kvtier", "calibrate", "--data-dir", "{work}/calibrate",
                           "--json"), 45, ("--quick",), "calibrate/calibration.json"),
        Step("engine", ("-m", "bench.engine_ttft", "--device", "cuda", "--contexts",
                        "8192,32768", "--repeats", "3", "--json", "{work}/engine_ttft.json"),
             110, ("--device", "cpu", "--quick"), "engine_ttft.json"),
    )


# -- install -----------------------------------------------------------------------------------

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """kvtier's runtime requirements and, of its dev extras, what the GPU tests need."""
    project = tomllib.loads(pyproject.read_text())["project"]
    dev = project["optional-dependencies"]["dev"]
    return [*project["dependencies"],
            *(r for r in dev if norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) in TEST_EXTRAS)]


@dataclass(frozen=True, slots=True)
class Wheel:
    path: Path
    name: str
    version: str

    def requires(self) -> list[str]:
        with zipfile.ZipFile(self.path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
        return [line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("Requires-Dist:")]


def wheels_here(directory: Path) -> tuple[dict[str, Wheel], list[str]]:
    """The wheels this interpreter can install, by normalized name; and notes on the rest."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours = set(sys_tags())
    found: dict[str, Wheel] = {}
    notes = []
    for path in sorted(directory.glob("*.whl")) if directory.is_dir() else []:
        name, version, _, tags = parse_wheel_filename(path.name)
        if not tags & ours:
            notes.append(f"{path.name}: not for this interpreter ({platform.python_version()}, "
                         f"{platform.machine()})")
        elif norm(name) in found:
            notes.append(f"{path.name}: a second wheel of {name} (keep one version)")
        else:
            found[norm(name)] = Wheel(path, str(name), str(version))
    return found, notes


@dataclass(slots=True)
class InstallPlan:
    install: list[Wheel]
    missing: list[str]
    """One line per requirement neither here nor among the wheels: says what is needed."""
    satisfied: dict[str, str]


def plan_install(reqs: list[str], have: Callable[[str], str | None],
                 have_requires: Callable[[str], list[str]],
                 wheels: dict[str, Wheel]) -> InstallPlan:
    """What to install from `wheels` so that every requirement holds: a requirement the
    interpreter meets (`have(name)` -> its version) stays; else its wheel is installed and that
    wheel's own requirements are planned too. Extras (`redis[hiredis]`) pull in their
    requirements from the installed package or the wheel."""
    from packaging.requirements import Requirement

    plan = InstallPlan([], [], {})
    chosen: dict[str, str] = {}
    queue = list(reqs)
    while queue:
        req = Requirement(queue.pop(0))
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = norm(req.name)
        version = chosen.get(key)
        source: Callable[[], list[str]] | None = None
        if version is None:
            here = have(key)
            wheel = wheels.get(key)
            if here is not None and req.specifier.contains(here, prereleases=True):
                version = chosen[key] = plan.satisfied[key] = here
                source = lambda key=key: have_requires(key)  # noqa: E731
            elif wheel is not None and req.specifier.contains(wheel.version, prereleases=True):
                version = chosen[key] = wheel.version
                plan.install.append(wheel)
                queue.extend(r for r in wheel.requires() if "extra ==" not in r)
                source = wheel.requires
            else:
                plan.missing.append(
                    f"{req}: {'version ' + here if here else 'not installed'} here, "
                    f"{'wheel ' + wheel.path.name if wheel else 'no wheel'} in .whl/")
                chosen[key] = "missing"
                continue
        elif version != "missing" and not req.specifier.contains(version, prereleases=True):
            plan.missing.append(f"{req}: {req.name} {version} is planned (conflict)")
            continue
        if req.extras and source is not None:
            for r in source():
                needed = Requirement(r)
                if needed.marker is not None and any(
                        needed.marker.evaluate({"extra": e}) for e in req.extras):
                    needed.marker = None  # evaluated here, for the extras asked for
                    queue.append(str(needed))
    return plan


def distributions(paths: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """Installed distributions by normalized name; the first on `paths` wins, as imports do."""
    out: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=paths):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(norm(name), dist)
    return out


def install(site: Path, dry: bool, reqs: list[str] | None = None,
            wheel_dir: Path = WHEELS) -> dict[str, Any]:
    """The install step: plan against this interpreter (and `site`), install unless dry."""
    paths = [str(site), *sys.path]
    dists = distributions(paths)
    wheels, notes = wheels_here(wheel_dir)
    plan = plan_install(
        requirements() if reqs is None else reqs,
        lambda k: dists[k].version if k in dists else None,
        lambda k: list(dists[k].requires or []) if k in dists else [], wheels)
    out: dict[str, Any] = {
        "python": platform.python_version(), "wheel_dir": str(wheel_dir),
        "wheels_found": sorted(w.path.name for w in wheels.values()), "notes": notes,
        "install": [w.path.name for w in plan.install], "missing": plan.missing,
        "satisfied": plan.satisfied}
    for line in plan.missing:
        print(f"install: MISSING WHEEL for {line} (on a machine with PyPI: "
              "scripts/fetch_gpu_wheels.sh, then carry .whl)")
    for note in notes:
        print(f"install: {note}")
    if plan.install and not dry:
        site.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
             *(str(w.path) for w in plan.install)],
            capture_output=True, text=True, timeout=INSTALL_S)
        out["pip_rc"], out["pip_output"] = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        if proc.returncode != 0:
            print(f"install: pip failed ({proc.returncode}):\n{out['pip_output']}")
    verb = "would install" if dry else "installed"
    print(f"install: {verb} {len(plan.install)} wheel(s)"
          + (": " + ", ".join(w.name + " " + w.version for w in plan.install)
             if plan.install else "") + f"; {len(plan.missing)} missing")
    out["ok"] = not plan.missing and out.get("pip_rc", 0) == 0
    return out


PROBE = """
import importlib.util, json, shutil, sys
out = {"python": sys.version.split()[0], "vllm": importlib.util.find_spec("vllm") is not None}
try:
    out["shm_free_bytes"] = shutil.disk_usage("/dev/shm").free
except OSError:
    out["shm_free_bytes"] = None
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
except Exception as exc:
    out["torch"] = f"{type(exc).__name__}: {exc}"
try:
    import cupy
    out["cupy"] = cupy.__version__
    rt = cupy.cuda.runtime
    out["cuda_runtime"], out["cuda_driver"] = rt.runtimeGetVersion(), rt.driverGetVersion()
    out["cupy_devices"] = rt.getDeviceCount()
except Exception as exc:
    out["cupy"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
"""What the steps will find: versions, the device, /dev/shm's free space (the daemon's pool)."""


def probe(env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    nvcc = shutil.which("nvcc")
    if nvcc:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                   timeout=10).stdout.strip().splitlines()
            out["nvcc"] = lines[-1] if lines else None
    return out


# -- steps -------------------------------------------------------------------------------------

def step_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "KVTIER_CONFIG")}
    path = [str(site), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    return env


def command(step: Step, work: Path, dry: bool) -> list[str]:
    argv = [a.replace("{work}", str(work)) for a in step.argv]
    if dry:
        argv += step.dry
        if step.fake_cuda:
            argv = ["-m", "tests.fake_cuda", *argv[1:]]  # drop the "-m": the runner's argument
    return [sys.executable, *argv]


def run_step(step: Step, argv: list[str], env: dict[str, str], timeout: float,
             log: Any) -> dict[str, Any]:
    log.write(f"\n===== {step.name}: {' '.join(argv)} (budget {timeout:.0f} s)\n")
    log.flush()
    started = time.monotonic()
    begin = log.tell()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    status = "ok"
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = "timed out"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the step and what it started (daemons)
        rc = proc.wait()
    else:
        if rc != 0:
            status = "failed"
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(begin)
        tail = f.read().decode(errors="replace")[-4000:]
    return {"status": status, "rc": rc, "seconds": round(time.monotonic() - started, 1),
            "budget_s": round(timeout), "command": " ".join(argv[1:]), "log_tail": tail}


def pytest_counts(xml: Path, tail: str) -> dict[str, int]:
    """passed/failed/errors/skipped from the JUnit file, else from the closing line."""
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    try:
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        for k, attr in (("tests", "tests"), ("failed", "failures"), ("errors", "errors"),
                        ("skipped", "skipped")):
            counts[k] = int(suite.get(attr, 0))
    except (OSError, ElementTree.ParseError, IndexError):
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail):
            key = {"passed": "tests", "error": "errors"}.get(what, what)
            counts[key] = counts.get(key, 0) + int(n)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
    if m:
        counts["collected"] = int(m.group(1))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def check_step(step: Step, rec: dict[str, Any], work: Path, dry: bool) -> None:
    """Reads the step's JSON into `rec` and tightens its status where the exit code is not
    enough (a gpu test skipped, nothing collected)."""
    if step.json is not None:
        path = work / step.json
        try:
            rec["json"] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            rec["json"] = None
            if rec["status"] == "ok":
                rec["status"], rec["error"] = "failed", f"no JSON from the step: {exc}"
    if step.name == "pytest":
        counts = pytest_counts(work / "pytest.xml", rec["log_tail"])
        rec["counts"] = counts
        if rec["status"] == "ok" and dry and not counts.get("collected"):
            rec["status"], rec["error"] = "failed", "no gpu test collected"
        if rec["status"] == "ok" and not dry and (counts["skipped"] or not counts["passed"]):
            rec["status"] = "incomplete"
            rec["error"] = f"{counts['skipped']} gpu test(s) skipped on the GPU machine"


# -- report ------------------------------------------------------------------------------------

def _rows(rec: dict[str, Any] | None, *path: str) -> list[dict[str, Any]]:
    doc: Any = (rec or {}).get("json") or {}
    for p in path:
        doc = doc.get(p, {}) if isinstance(doc, dict) else {}
    return doc if isinstance(doc, list) else []


def goals(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals on an H200, from the steps' JSON: measured value, target, met (a JSON of
    another shape gives no goals rather than an error)."""
    try:
        return _goals(records)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return [{"goal": f"goals unreadable ({type(exc).__name__}: {exc})", "value": float("nan"),
                 "target": "-", "met": False}]


def _goals(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    rows = _rows(records.get("gpu-transfer"), "sections", "gpu_goals", "rows")
    for r in rows:
        tp = "TP1" if r.get("goal_ceiling") is not None else "TP8 rank"
        if tp == "TP1":
            out.append({"goal": f"2 MiB blocks vs one contiguous copy, {r['direction']}",
                        "value": r["kernel_over_ceiling"], "target": ">= 0.85x",
                        "met": r["kernel_over_ceiling"] >= 0.85})
        out.append({"goal": f"16-token blocks vs per-chunk loop, {tp} {r['direction']}",
                    "value": r["kernel_over_loop"], "target": ">= 5x",
                    "met": r["kernel_over_loop"] >= 5.0})
    for c in _rows(records.get("engine"), "contexts"):
        exact = c["hits_exact"] and c["cold_exact"]
        out.append({"goal": f"logits with kvtier hits = recompute, {c['tokens']} tokens",
                    "value": 0.0 if exact else c["hits_max_abs_diff"],
                    "target": f"exact, or <= the engine's spread {c['recompute_spread']:.3g}",
                    "met": exact or c["hits_max_abs_diff"] <= c["recompute_spread"]})
        if c["tokens"] >= 32768:
            out.append({"goal": f"TTFT DRAM hits vs recompute, {c['tokens']} tokens",
                        "value": c["speedup_p50"], "target": ">= 10x",
                        "met": c["speedup_p50"] >= 10.0})
    return out


def figures(name: str, rec: dict[str, Any]) -> str:
    """A few words of what a step measured, for the table (never raises: a JSON of another
    shape is said to be so)."""
    try:
        return _figures(name, rec)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        return f"figures unreadable ({type(exc).__name__}: {exc})"


def _figures(name: str, rec: dict[str, Any]) -> str:
    doc = rec.get("json") or {}
    if name == "install":
        return (f"{len(rec.get('install', []))} installed, {len(rec.get('missing', []))} "
                "missing")
    if name == "pytest":
        c = rec.get("counts", {})
        if "collected" in c and not c.get("tests"):
            return f"{c['collected']} collected"
        return (f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
                f"{c.get('errors', 0)} errors, {c.get('skipped', 0)} skipped")
    if name == "gpu-transfer":
        bad = [k for k, v in doc.get("sections", {}).items() if not v.get("ok")]
        return f"GPU {doc.get('gpu')}; sections failed: {', '.join(bad) or 'none'}"
    if name == "vllm-loads" and doc:
        e = doc["summary"]["engine"]
        return (f"engine {e['p50_ms']:.1f} ms ({e['over_one_copy']:.2f}x one copy), layer 0 "
                f"{e['layer0_p50_ms']:.1f} ms; torch {doc['summary']['torch']['p50_ms']:.1f} ms")
    if name == "calibrate" and doc:
        links = doc.get("links", {})
        parts = [f"{k} {v['bytes_per_s'] / 1e9:.1f} GB/s" for k, v in links.items()]
        if doc.get("prefill"):
            parts.append(f"prefill {doc['prefill']['flops_per_s'] / 1e12:.3g} TFLOP/s")
        return ", ".join(parts)
    if name == "engine" and doc:
        return "; ".join(f"{c['tokens']}: {c['speedup_p50']:.1f}x, exact "
                         f"{c['hits_exact'] and c['cold_exact']}" for c in doc["contexts"])
    return rec.get("error", "")


def table(report: dict[str, Any]) -> str:
    lines = [f"\nGPU check ({'dry run' if report['dry_run'] else 'GPU'}), "
             f"{report['date']}, {report['gpu'] or 'no GPU'}"]
    env = report.get("environment", {})
    shm = env.get("shm_free_bytes")
    lines.append(f"  python {env.get('python')}, torch {env.get('torch')} (CUDA "
                 f"{env.get('torch_cuda')}), cupy {env.get('cupy')}, device {env.get('device')}, "
                 f"/dev/shm free {shm / 2**30:.1f} GiB" if shm else "")
    for name, rec in report["steps"].items():
        spent = f"{rec.get('seconds', 0):.0f}/{rec.get('budget_s', 0)} s"
        lines.append(f"  {name:<13} {rec['status']:<10} {spent:>10}  {figures(name, rec)}"[:160])
    if report["goals"]:
        lines.append("goals:")
        for g in report["goals"]:
            lines.append(f"  {'met    ' if g['met'] else 'NOT MET'} {g['goal']}: "
                         f"{g['value']:.3g} (target {g['target']})")
    lines.append(f"total {report['seconds']:.0f} s of {TOTAL_S}; all steps ok: "
                 f"{report['ok']}; JSON {report['json']}")
    return "\n".join(lines)


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


# -- main --------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    names = [s.name for s in steps()]
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="on a CPU: every step's setup and flags (fake CuPy, CPU overrides)")
    ap.add_argument("--steps", default=",".join(names),
                    help=f"comma-separated subset (default: {','.join(names)}); the install "
                         "step always runs")
    ap.add_argument("--results", type=Path, default=None, metavar="DIR",
                    help="where gpu_check.json and gpu_check.log go (default: $OUT if set, "
                         "else bench/results)")
    ap.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "kvtier-gpu-site",
                    help="where missing packages are installed (put first on PYTHONPATH)")
    a = ap.parse_args(argv)
    a.steps = [s for s in a.steps.split(",") if s]
    bad = sorted(set(a.steps) - set(names))
    if bad or not a.steps:
        ap.error(f"--steps: choose from {','.join(names)}; got {','.join(bad) or '-'}")
    if a.results is None:
        a.results = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench/results"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    started = time.monotonic()
    a.results.mkdir(parents=True, exist_ok=True)
    out_json, out_log = a.results / "gpu_check.json", a.results / "gpu_check.log"
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "dry_run": a.dry_run,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "python": sys.version.split()[0], "gpu": gpu_name(), "total_budget_s": TOTAL_S,
        "steps": {}, "goals": [], "json": str(out_json), "log": str(out_log)}

    def save() -> None:
        report["seconds"] = round(time.monotonic() - started, 1)
        report["goals"] = goals(report["steps"])
        report["ok"] = all(r["status"] == "ok" for r in report["steps"].values())
        out_json.write_text(json.dumps(report, indent=1, default=str))

    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-check-"))
    try:
        with open(out_log, "w") as log:
            t0 = time.monotonic()
            try:
                rec = install(a.site, a.dry_run)
                rec["status"] = "ok" if rec["ok"] else "failed"
            except Exception as exc:  # recorded; the steps still run
                rec = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            env = step_env(a.site)
            report["environment"] = probe(env, max(5.0, INSTALL_S - (time.monotonic() - t0)))
            print(f"environment: {json.dumps(report['environment'])}", flush=True)
            rec.update(seconds=round(time.monotonic() - t0, 1), budget_s=INSTALL_S)
            report["steps"]["install"] = rec
            log.write(json.dumps({"install": rec}, indent=1) + "\n")
            save()
            for step in (s for s in steps() if s.name in a.steps):
                left = TOTAL_S - (time.monotonic() - started)
                if left < 5:
                    report["steps"][step.name] = {"status": "skipped", "seconds": 0,
                                                  "budget_s": step.budget_s,
                                                  "error": "no time left in the total budget"}
                    continue
                print(f"== {step.name} (budget {min(step.budget_s, left):.0f} s)", flush=True)
                rec = run_step(step, command(step, work, a.dry_run), env,
                               min(step.budget_s, left), log)
                check_step(step, rec, work, a.dry_run)
                report["steps"][step.name] = rec
                print(f"   {rec['status']} in {rec['seconds']:.0f} s: {figures(step.name, rec)}",
                      flush=True)
                save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
