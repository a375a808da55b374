"""The daemon's metric names follow Prometheus naming (docs/fleet.md), the renamed
ones are gone, and tenant/model labels stay bounded."""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.daemon.metrics import MAX_MODEL_LABELS, MAX_TENANT_LABELS, OTHER, DaemonMetrics
from tests.daemon_fixture import ROOT

OLD = ("kvtier_bytes_moved_total", "kvtier_ssd_bytes_written_total",
       "kvtier_predicted_prefill_seconds_saved_total", "kvtier_active_leases")
UNITS = ("_bytes", "_seconds", "_ratio", "_per_second", "_blocks", "_keys", "_depth", "_info",
         "_leases", "_samples", "_active", "_total")


def families(m: DaemonMetrics) -> dict[str, str]:
    text = generate_latest(m.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_names_and_types() -> None:
    m = DaemonMetrics()
    fams = families(m)
    assert "kvtier_build_info" in fams
    for name, kind in fams.items():
        assert re.fullmatch(r"kvtier_[a-z0-9_]+", name), name
        if kind == "counter":
            # the parser strips _total from counter family names; the unit comes before it
            assert not name.endswith(("_total", "_bytes_written", "_seconds_saved")), name
    # every gauge and histogram names its unit last (counters: before the _total the parser
    # strips); a counter's `_created` timestamp family goes with its counter
    for name, kind in fams.items():
        if kind == "counter" or (name.endswith("_created") and name[:-8] in fams):
            continue
        assert name.endswith(UNITS), (name, kind)
    assert sum(k != "counter" for k in fams.values()) >= 3  # the rule above checked something
    text = generate_latest(m.registry).decode()
    for old in OLD:
        assert f"{old} " not in text and f"{old}{{" not in text, old


def test_tenant_and_model_labels_are_capped() -> None:
    m = DaemonMetrics()
    for i in range(MAX_TENANT_LABELS + 10):
        m.record_lookup(f"tenant-{i}", f"model-{i % (MAX_MODEL_LABELS + 5)}", {"dram": 1}, 1)
    text = generate_latest(m.registry).decode()
    tenants, models = set(), set()
    for f in text_string_to_metric_families(text):
        if f.name == "kvtier_blocks_hit":
            for s in f.samples:
                tenants.add(s.labels["tenant"])
                models.add(s.labels["model"])
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER in tenants
    assert len(models) == MAX_MODEL_LABELS + 1 and OTHER in models
    # nothing is lost: the capped series still sum to every block counted
    assert m.total("kvtier_blocks_hit_total") == MAX_TENANT_LABELS + 10
    assert m.total("kvtier_blocks_missed_total") == MAX_TENANT_LABELS + 10
    # a tenant literally named "other" cannot take a slot of its own
    m2 = DaemonMetrics()
    m2.record_lookup(OTHER, "m", {}, 1)
    assert m2.tenants.label("a") == "a"


def test_fleet_page_lists_the_renames() -> None:
    page = (ROOT / "docs" / "fleet.md").read_text()
    section = page[page.index("### Metric renames"):]
    for old in OLD:
        assert f"`{old}`" in section, old
