"""Suite-wide guard: tests write only under their temporary directories; and the hostile suite's
counts (cases tried, failures) at the end of a run.

At the end of the session, any file or directory that appeared in the checkout during the run
(untracked or git-ignored, tool caches aside) fails the session, naming the paths: a test that
writes into the repository (bench/results/, a stray config) leaves it behind for every later run.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.model_weights import config_digest, llama_config, write_checkpoint

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


def pytest_sessionstart(session: pytest.Session) -> None:
    global _BEFORE
    _BEFORE = untracked()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    after = untracked()
    if _BEFORE is None or after is None:
        return
    left = sorted(after - _BEFORE)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "tests left files in the checkout (write under tmp_path instead): " + ", ".join(
            left)
        if reporter is not None:
            reporter.write_line(text, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- the hostile suite's counts (tests/test_service_hostile.py) ---------------------------------

HOSTILE = "test_service_hostile.py"
_counts = {"tried": 0, "failed": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if HOSTILE not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _counts["tried"] += 1
        _counts["failed"] += int(report.failed)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _counts["tried"]:
        terminalreporter.write_line(
            f"hostile suite: {_counts['tried']} cases tried, failures: {_counts['failed']}")


# -- model checkpoints for the engine tests (bench/model_weights.py) ---------------------------

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
