"""Suite-wide guards: tests write only under their temporary directories; the hostile suite's
counts (cases tried, failures) at the end of a run; the `checkpoint` fixture.

At the end of the session, any file or directory that appeared in the checkout during the run
(untracked or git-ignored, tool caches aside) fails the session, naming the paths: a test that
writes into the repository (bench/results/, a stray config) leaves it behind for every later run.

The system temp dir likewise: the session runs with TMPDIR (and `tempfile.tempdir`) set to a
fresh directory of its own inside it, inherited by every daemon, engine and tool the tests start
(vLLM puts its IPC sockets there); whatever is left in it at the end fails the session, naming
the paths, and the directory is then removed. pytest's own tmp_path dirs stay where they were
(PYTEST_DEBUG_TEMPROOT: the real temp dir), so a failed test's files are kept as before, and so
does torch's compile cache (TORCHINDUCTOR_CACHE_DIR: its default place).

No silent skips: with KVTIER_REQUIRE_ALL=1 (bin/test sets it) a skipped test, or a module skipped
at collection (an `importorskip` of vllm, torch, redis...; a trace not found), is a failure,
unless its reason is one this machine cannot change (MAY_SKIP: no CUDA device, no CuPy, no nvcc,
a port taken by another program). The summary says how many tests ran of each marker.
"""

from __future__ import annotations

import functools
import getpass
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.model_weights import config_digest, llama_config, write_checkpoint

# Hypothesis: no per-example deadline in any property test (its 200 ms default measures speed,
# and a loaded CI machine can stall one example that long: a DeadlineExceeded/Flaky failure of
# a correct test). It never caught a hang either: it is checked once an example returned.
# (SGLang's venv, which runs tests/test_sglang_backend.py with this conftest, has none.)
if importlib.util.find_spec("hypothesis"):
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("kvtier", deadline=None)
    _hypothesis_settings.load_profile("kvtier")

# SGLang's own class runs only in SGLang's venv (.venv-sglang): test_sglang_engine.py runs that
# file there, and bin/test requires it; the main venv has no sglang to import, so no skip
collect_ignore = [] if importlib.util.find_spec("sglang") else ["test_sglang_backend.py"]

ROOT = Path(__file__).resolve().parents[1]
CACHES = (".pytest_cache/", ".mypy_cache/", ".ruff_cache/", ".hypothesis/",
          ".import_linter_cache/", ".venv/", ".whl/", ".gl/")


def untracked() -> set[str] | None:
    """Untracked and ignored paths of the checkout (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    return {p for p in paths if "__pycache__" not in p and not p.startswith(CACHES)}


_BEFORE: set[str] | None = None
_TMP: Path | None = None


def own_tempdir() -> Path:
    """Points TMPDIR and `tempfile` at a fresh directory in the system temp dir (see above)."""
    system = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)
    # torch's compile cache stays where torch keeps it by default (a cache, kept across runs)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(system, f"torchinductor_{getpass.getuser()}"))
    own = Path(tempfile.mkdtemp(prefix="kvtier-tests-", dir=system))
    own.chmod(0o711)  # other users may pass through (test_group_sharing's clients), not list
    os.environ["TMPDIR"] = str(own)
    tempfile.tempdir = str(own)
    return own


def left_in(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.is_dir()
                  or not any(p.iterdir()))


def pytest_configure(config: pytest.Config) -> None:
    global _TMP
    # a pytest run by a test (KVTIER_NESTED_PYTEST=1, in that test's tmp_path) leaves its temp
    # files to the test that runs it
    nested = os.environ.get("KVTIER_NESTED_PYTEST") == "1"
    if _TMP is None and not hasattr(config, "workerinput") and not nested:
        _TMP = own_tempdir()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _BEFORE
    _BEFORE = untracked()


def _fail(session: pytest.Session, text: str) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(text, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SEEN_IN: dict[str, str] = {}
"""Top-level entry of the session's temp dir -> the test during which it first appeared."""


def _listing() -> set[str]:
    try:
        return set(os.listdir(_TMP)) if _TMP is not None else set()
    except OSError:
        return set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = _listing()
    yield
    for name in _listing() - before:
        _SEEN_IN.setdefault(name, item.nodeid)


def _kill_leftovers() -> list[str]:
    """Kills the daemons and redis servers tests started and left running (`LIVE` in their
    fixture modules, when a test imported them); what they were."""
    left: list[str] = []
    for name in ("tests.daemon_fixture", "tests.redis_fixture"):
        module = sys.modules.get(name)
        for proc in list(getattr(module, "LIVE", ())):
            if proc.proc is not None and proc.proc.poll() is None:
                left.append(f"{type(proc).__name__} in {proc.workdir}")
            proc.kill()
    return left


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    engines = sys.modules.get("tests.support.vllm_engine")
    if engines is not None:  # the vLLM engines' fork server (its socket is in the temp dir)
        engines.stop_fork_server()
    left_running = _kill_leftovers()
    if left_running:
        _fail(session, "tests left processes running (killed now; stop them in a finally): "
              + ", ".join(left_running))
    if _TMP is not None and _TMP.exists():
        left = left_in(_TMP)
        shutil.rmtree(_TMP, ignore_errors=True)
        if left:
            tops = Counter(_SEEN_IN.get(p.split("/")[0], "outside any test") for p in left)
            _fail(session, f"tests left files in the system temp dir ({_TMP}, removed now): "
                  + ", ".join(left[:40]) + (f" and {len(left) - 40} more" if len(left) > 40
                                            else "")
                  + "; appeared during: " + "; ".join(f"{t} ({n})" for t, n in tops.items()))
    after = untracked()
    if _BEFORE is None or after is None:
        return
    left = sorted(after - _BEFORE)
    if left:
        _fail(session, "tests left files in the checkout (write under tmp_path instead): "
              + ", ".join(left))


# -- no silent skips; runs per marker ----------------------------------------------------------

REQUIRE_ALL = os.environ.get("KVTIER_REQUIRE_ALL") == "1"
MAY_SKIP = re.compile(r"CUDA|CuPy|cupy installed|nvcc|on a GPU machine|port \d+ is in use|"
                      r"PYTHONHASHSEED is set")
"""Skip reasons bin/test cannot do anything about on this machine (hardware, the environment)."""
MARKERS = ("vllm", "sglang", "slow", "gpu")
_ran: Counter[tuple[str, str]] = Counter()
_skipped: Counter[str] = Counter()


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _refuse_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under KVTIER_REQUIRE_ALL a skip not allowed by MAY_SKIP becomes a failure."""
    if not (REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = _skip_reason(report.longrepr)
    if MAY_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under bin/test (KVTIER_REQUIRE_ALL=1), which makes a skip of a "
                       f"test that should run here a failure: {reason}")


def _marker_of(item: pytest.Item) -> str:
    names = [m for m in MARKERS if item.get_closest_marker(m) is not None]
    return names[0] if names else "unmarked"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    _refuse_skip(report)
    # the marker travels with the report (pytest-xdist sends a report's attributes to the
    # controller, which counts and collects no items of its own)
    report.kvtier_marker = _marker_of(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _refuse_skip(outcome.get_result())  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The engine modules (markers vllm, sglang: minutes each) run first, each module's tests
    staying together and in order: under pytest-xdist (bin/test) their worker starts on them at
    once (`pytest_xdist_make_scheduler`), instead of finishing alone on one core at the end."""
    engines = {item.path for item in items
               if item.get_closest_marker("vllm") or item.get_closest_marker("sglang")}
    items.sort(key=lambda item: item.path not in engines)  # stable: else as collected


_ENGINE_MARK = re.compile(r"pytest\.mark\.(?:vllm|sglang)\b")


@functools.cache
def _engine_module(path: str) -> bool:
    """Whether the test module at `path` (relative to the checkout) runs real engines (a vllm or
    sglang marker in its text: the controller of pytest-xdist sees node ids only)."""
    file = ROOT / path
    return file.suffix == ".py" and file.is_file() and bool(_ENGINE_MARK.search(file.read_text()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadfile` (bin/test), every engine module is one work unit: one worker runs
    them one after another while the other takes the remaining modules a file at a time. Two
    engine modules at once (a tensor-parallel engine's ranks busy-poll their queues) starved
    each other and the daemons beside them, whose calls and shutdowns then ran past their
    timeouts."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EnginesTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "(engine modules)" if _engine_module(path) else path

    return EnginesTogether(config, log)


def _count(report: pytest.TestReport) -> None:
    marker = str(getattr(report, "kvtier_marker", "unmarked"))
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            _skipped[_skip_reason(report.longrepr)[:80]] += 1
        _ran[(marker, report.outcome)] += 1


def _summary(terminalreporter: Any) -> None:
    parts = []
    for marker in (*MARKERS, "unmarked"):
        outcomes = {o: n for (m, o), n in _ran.items() if m == marker}
        if outcomes:
            detail = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
            parts.append(f"{marker} {sum(outcomes.values())} ({detail})")
    if parts:
        terminalreporter.write_line("tests by marker: " + "; ".join(parts))
    if _skipped:
        terminalreporter.write_line("skipped: " + "; ".join(
            f"{n} x {reason}" for reason, n in _skipped.most_common()))


# -- the hostile suite's counts (tests/test_service_hostile.py) ---------------------------------

HOSTILE = "test_service_hostile.py"
_counts = {"tried": 0, "failed": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _count(report)
    if HOSTILE not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _counts["tried"] += 1
        _counts["failed"] += int(report.failed)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _summary(terminalreporter)
    if _counts["tried"]:
        terminalreporter.write_line(
            f"hostile suite: {_counts['tried']} cases tried, failures: {_counts['failed']}")


# -- the event loop of tests that drive a Cache in-process (tests/cache_calls.py) ------------


@pytest.fixture(autouse=True)
def _cache_calls_loop() -> Iterator[None]:
    """Closes the loop `tests.cache_calls.run` made for the test, if it made one."""
    yield
    module = sys.modules.get("tests.cache_calls")
    if module is not None:
        module.close()


# -- model checkpoints for the engine tests (tests/support/model_weights.py) -----------------

Checkpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """`checkpoint(config=None, seed=0, auto_class="AutoModelForCausalLM")`: the directory of a
    local checkpoint of HF config dict `config` (default: `llama_config()`, the engine tests'
    model) with the model's own initializer's weights, written once per session and shared."""
    root = tmp_path_factory.mktemp("weights")

    def make(config: dict[str, Any] | None = None, seed: int = 0,
             auto_class: str = "AutoModelForCausalLM") -> Path:
        cfg = llama_config() if config is None else config
        return write_checkpoint(root / config_digest(cfg, seed), cfg, seed=seed,
                                auto_class=auto_class)
    return make
