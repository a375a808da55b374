"""deploy/grafana/: the committed dashboards are what deploy/grafana/dashboards.py builds
(grafana-foundation-sdk), and every panel's PromQL returns data from a REAL Prometheus (started
here on 127.0.0.1 with the deploy/prometheus rules) scraping two real daemons under load."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.daemon_fixture import ROOT, DaemonProc
from tests.fleet_load import load
from tests.prometheus_fixture import PrometheusProc, prometheus_binary

GRAFANA = ROOT / "deploy" / "grafana"
FILES = ("kvtier-fleet.json", "kvtier-node.json")


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_dashboards", GRAFANA / "dashboards.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def committed(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GRAFANA / name).read_text())
    return doc


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every committed panel."""
    out = []
    for name in FILES:
        for p in committed(name)["panels"]:
            for t in p["targets"]:
                out.append((name, p["title"], t["expr"]))
    return out


def test_committed_dashboards_are_what_the_code_builds() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk "
                        "(a dev dependency in pyproject.toml)")
    mod = builder()
    for name, doc in mod.dashboards().items():
        assert (GRAFANA / name).read_text() == mod.render(doc), (
            f"{name} is stale: run python deploy/grafana/dashboards.py")


def test_dashboards_are_well_formed() -> None:
    for name in FILES:
        doc = committed(name)
        assert doc["uid"] == name.removesuffix(".json") and "kvtier" in doc["tags"]
        titles = [p["title"] for p in doc["panels"]]
        assert len(titles) == len(set(titles)), name
        for p in doc["panels"]:
            assert p["description"] and p["targets"], p["title"]
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert {t["refId"] for t in p["targets"]} == {
                chr(ord("A") + i) for i in range(len(p["targets"]))}
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
    names = [v["name"] for v in committed("kvtier-node.json")["templating"]["list"]]
    assert names == ["datasource", "instance"]


def concrete(expr: str) -> str:
    """A panel's PromQL as Grafana would send it with every daemon selected."""
    return expr.replace("$__rate_interval", "15s").replace('"$instance"', '".*"')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusProc]:
    prometheus_binary()  # skip (or fail under bin/test) before starting anything
    tmp = tmp_path_factory.mktemp("fleet")
    daemons = [DaemonProc(tmp / f"d{i}", args=["--ssd-admit-after", "2"]).start()
               for i in range(2)]
    try:
        targets = [f"127.0.0.1:{d.metrics_port}" for d in daemons]
        with load([d.socket for d in daemons] * 2,
                  ["org/model-a", "org/model-b", "org/model-b", "org/model-c"]), \
                PrometheusProc(tmp / "prom", targets) as prom:
            yield prom
    finally:
        for d in daemons:
            d.stop()


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def test_every_panel_query_returns_data(fleet: PrometheusProc) -> None:
    queries = panel_queries()
    assert len(queries) > 25
    missing: list[tuple[str, str, str]] = queries
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        missing = [q for q in missing if not has_data(fleet.query(concrete(q[2])))]
        if missing:
            time.sleep(1)
    assert not missing, "no data for:\n" + "\n".join(f"{d} / {t}: {e}" for d, t, e in missing)


def test_fleet_numbers_add_up(fleet: PrometheusProc) -> None:
    """The dashboards' numbers mean what they say: both daemons up, three models, per-node hit
    ratios inside [0, 1], the MRC reporting all 11 capacities per node."""
    deadline = time.monotonic() + 60  # both scraped once (alone, this test runs first)
    while len(up := fleet.query('up{job="kvtier"}')) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert sorted(float(r["value"][1]) for r in up) == [1.0, 1.0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        models = {r["metric"]["model"] for r in fleet.query("model:kvtier_hit_ratio:rate5m")}
        if models >= {"org/model-a", "org/model-b", "org/model-c"}:
            break
        time.sleep(1)
    assert models == {"org/model-a", "org/model-b", "org/model-c"}
    for r in fleet.query("instance:kvtier_hit_ratio:rate5m"):
        assert 0.0 <= float(r["value"][1]) <= 1.0
        assert r["metric"]["job"] == "kvtier"
    mrc = fleet.query("count by (instance) (kvtier_mrc_hit_ratio)")
    assert sorted(float(r["value"][1]) for r in mrc) == [11.0, 11.0]
    # node identity comes from the scrape config, not from the daemon
    assert {r["metric"].get("cluster") for r in fleet.query("kvtier_build_info")} == {"test"}


def test_fleet_page_explains_every_panel() -> None:
    page = (ROOT / "docs" / "fleet.md").read_text()
    section = page[page.index("## Watching a fleet"):]
    for name in FILES:
        for p in committed(name)["panels"]:
            assert f"| {p['title']} |" in section, f"docs/fleet.md lacks panel {p['title']!r}"
