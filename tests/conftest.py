"""Suite-wide reporting: the hostile suite's counts (cases tried, failures) at the end of a run."""

from __future__ import annotations

from typing import Any

import pytest

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
