"""deploy/prometheus/: the recording rules and alerts load, and their `promtool test rules` unit
tests (deploy/prometheus/tests/) pass. promtool comes from Debian's `prometheus` package, which
bin/test installs (and then sets KVTIER_REQUIRE_PROMETHEUS=1, so a missing binary fails here
instead of skipping)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.daemon_fixture import ROOT

DEPLOY = ROOT / "deploy" / "prometheus"
RULES = sorted(DEPLOY.glob("*.yml"))
TESTS = sorted((DEPLOY / "tests").glob("*.test.yml"))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("KVTIER_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool not found (apt-get install -y prometheus)")
        pytest.skip("promtool not found: apt-get install -y prometheus (bin/test does)")
    return path


def test_rule_files_exist() -> None:
    assert [p.name for p in RULES] == ["kvtier.alerts.yml", "kvtier.rules.yml"]
    assert TESTS


def test_rules_check() -> None:
    out = subprocess.run([promtool(), "check", "rules", *map(str, RULES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("test_file", TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(test_file: os.PathLike[str]) -> None:
    out = subprocess.run([promtool(), "test", "rules", str(test_file)],
                         capture_output=True, text=True, timeout=120, cwd=DEPLOY / "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_unit_test() -> None:
    import yaml

    alerts = {r["alert"] for g in yaml.safe_load((DEPLOY / "kvtier.alerts.yml").read_text())
              ["groups"] for r in g["rules"]}
    tested = set()
    for t in TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            tested |= {a["alertname"] for a in case.get("alert_rule_test", [])
                       if a.get("exp_alerts")}
    assert alerts <= tested, f"alerts without a firing test: {sorted(alerts - tested)}"


def test_every_recording_rule_has_a_unit_test() -> None:
    import yaml

    records = {r["record"] for g in yaml.safe_load((DEPLOY / "kvtier.rules.yml").read_text())
               ["groups"] for r in g["rules"]}
    tested = set()
    for t in TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            tested |= {e["expr"] for e in case.get("promql_expr_test", [])}
    missing = records - tested
    assert not missing, f"recording rules without a promql_expr_test: {sorted(missing)}"


def test_fleet_page_lists_every_alert_and_a_valid_scrape_config() -> None:
    import yaml

    page = (ROOT / "docs" / "fleet.md").read_text()
    section = page[page.index("## Watching a fleet"):]
    alerts = {r["alert"] for g in yaml.safe_load((DEPLOY / "kvtier.alerts.yml").read_text())
              ["groups"] for r in g["rules"]}
    for a in alerts:
        assert f"`{a}`" in section, a
    block = section[section.index("```yaml") + 7:]
    cfg = yaml.safe_load(block[: block.index("```")])
    assert cfg["scrape_configs"][0]["job_name"] == "kvtier"
    assert [Path(p).name for p in cfg["rule_files"]] == ["kvtier.rules.yml", "kvtier.alerts.yml"]
