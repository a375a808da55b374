"""`kvtier top`: the view's arithmetic (pure), `--once`/`--json` against a real daemon under
load, and the live view driven in a real terminal (tmux) until Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.commands.top_view import Sample, from_metrics, row, sparkline
from kvtier.index.mrc import MIN_SAMPLES
from tests.daemon_fixture import ROOT, DaemonProc
from tests.fleet_load import load


def sample(t: float, hit: float, missed: float, **kw: object) -> Sample:
    return Sample("s", t, True, blocks_hit=hit, blocks_missed=missed, **kw)  # type: ignore[arg-type]


def test_interval_and_total_hit_ratio() -> None:
    a = sample(0.0, 30, 70, lookups=10)
    b = sample(2.0, 120, 80, lookups=30)  # +90 hit, +10 missed in 2 s
    r = row(a, b, trend=[0.3])
    assert r.hit_ratio == pytest.approx(0.9)
    assert r.hit_ratio_total == pytest.approx(0.6)
    assert r.lookups_per_s == pytest.approx(10.0)
    assert r.trend == [0.3, pytest.approx(0.9)]
    assert row(b, b).hit_ratio is None  # no lookups in the interval: no ratio, no trend point


def test_mrc_headroom_and_planner_share() -> None:
    mrc = {("none", 1.0): 0.40, ("dram", 2.0): 0.46, ("dram", 8.0): 0.55, ("dram", 0.5): 0.3,
           ("ssd", 2.0): 0.41}
    a = sample(0.0, 0, 0, plan_decisions={"fetch_dram": 10, "recompute": 10})
    b = sample(1.0, 0, 0, mrc=mrc, plan_decisions={"fetch_dram": 40, "recompute": 20})
    r = row(a, b)
    assert r.mrc_headroom == {"dram": pytest.approx(0.15), "ssd": pytest.approx(0.01)}
    assert r.plan_share == {"use_hbm": 0.0, "fetch_dram": 0.75, "fetch_ssd": 0.0,
                            "recompute": 0.25}


def test_sparkline() -> None:
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.2] * 50, width=5) == "▂" * 5


def test_metrics_text_parsing() -> None:
    text = "\n".join([
        'kvtier_blocks_hit_total{model="m",tenant="t",tier="dram"} 30',
        'kvtier_blocks_hit_total{model="m2",tenant="t",tier="ssd"} 10',
        'kvtier_blocks_missed_total{model="m",tenant="t"} 60',
        'kvtier_pool_capacity_bytes{tier="dram"} 100',
        'kvtier_pool_used_bytes{tier="dram"} 25',
        'kvtier_mrc_hit_ratio{factor="2",scaled="dram"} 0.5',
        'kvtier_build_info{python="3.11.7",version="9.9"} 1', ""])
    s = from_metrics("u", 1.0, text)
    assert (s.blocks_hit, s.blocks_missed, s.version) == (40, 60, "9.9")
    assert s.hits_by_tier == {"dram": 30, "ssd": 10} and s.mrc == {("dram", 2.0): 0.5}
    assert row(None, s).fill == {"dram": 0.25}


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("top") / "d").start()
    try:
        with load([d.socket], ["org/top-model"]):
            # hits and leases to show (a fixed 1 s was too short on a loaded machine)
            deadline = time.monotonic() + 60
            while d.metric_sum("kvtier_blocks_hit_total") < 1:
                assert time.monotonic() < deadline, "the load never hit"
                time.sleep(0.1)
            while d.metric_sum("kvtier_mrc_sampled_blocks_total") < MIN_SAMPLES:  # its curve
                assert time.monotonic() < deadline + 60, "the MRC never warmed up"
                time.sleep(0.1)
            yield d
    finally:
        d.stop()


def kvtier(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})


def test_once_json_against_a_real_daemon(busy: DaemonProc) -> None:
    url = f"http://127.0.0.1:{busy.metrics_port}"
    out = kvtier("top", "--json", "--interval", "1", str(busy.socket), url)
    assert out.returncode == 0, out.stderr
    sock, metrics = json.loads(out.stdout)
    for r in (sock, metrics):
        assert r["ok"] and r["version"]
        assert 0.0 <= r["hit_ratio"] <= 1.0 and 0.0 < r["hit_ratio_total"] <= 1.0
        assert set(r["fill"]) == {"dram", "ssd"} and r["fill"]["dram"] > 0
        assert r["lookups_per_s"] > 1
        assert len(r["mrc"]) == 11 and set(r["mrc_headroom"]) == {"dram", "ssd"}
    assert sock["traffic_bytes_per_s"] is None and sock["plan_share"] is None
    assert metrics["traffic_bytes_per_s"]["dram/to_client"] > 0
    assert sum(metrics["plan_share"].values()) == pytest.approx(1.0)
    assert set(metrics["leases"]) == {"read", "write"}


def test_once_table_and_bad_sources(busy: DaemonProc, tmp_path: Path) -> None:
    out = kvtier("top", "--once", "--interval", "0.5", str(busy.socket),
                 str(tmp_path / "nobody.sock"))
    assert out.returncode == 0, out.stderr
    assert "hit ratio" in out.stdout and "down" in out.stdout and "%" in out.stdout
    gone = kvtier("top", "--once", "--interval", "0.2", str(tmp_path / "nobody.sock"))
    assert gone.returncode == 2 and gone.stdout == ""  # one line, as kvtier stats says it
    assert gone.stderr.splitlines() == [f"kvtier top: error: no kvtier daemon at "
                                        f"{tmp_path / 'nobody.sock'} (start one: kvtier serve)"]
    bad = kvtier("top", "--once", "ftp://x")
    assert bad.returncode == 2 and "socket path, HOST:PORT or an http(s)://" in bad.stderr
    assert kvtier("top", "--interval", "0").returncode == 2


def test_live_view_in_tmux(busy: DaemonProc, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux not found: apt-get install -y tmux (bin/test does)")
    server = f"kvtier-top-{uuid.uuid4().hex[:8]}"
    # tmux's socket dir (TMUX_TMPDIR, else /tmp/tmux-UID) under this test's own tmp_path
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))  # for this test only
    tmux = ["tmux", "-L", server]
    url = f"http://127.0.0.1:{busy.metrics_port}"
    cmd = (f"unset COLUMNS LINES; cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m kvtier top "
           f"--interval 0.5 "
           f"{busy.socket} {url}; echo EXITED $?; sleep 60")
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "200", "-y", "40", cmd],
                   check=True)
    try:
        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], check=True,
                                  capture_output=True, text=True).stdout

        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = screen()
            if "kvtier top" in text and url in text and "dram" in text:
                break
            time.sleep(0.3)
        assert "kvtier top" in text and url[:18] in text, text
        assert "hit ratio" in text and "MRC headroom" in text and "%" in text, text
        # it keeps refreshing: the trend column grows
        first = sum(text.count(c) for c in "▁▂▃▄▅▆▇█")
        deadline = time.monotonic() + 30  # seen growing, however slowly the machine redraws
        later = screen()
        while sum(later.count(c) for c in "▁▂▃▄▅▆▇█") <= first:
            assert time.monotonic() < deadline, later
            time.sleep(0.2)
            later = screen()
        subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True)
        deadline = time.monotonic() + 10
        while "EXITED" not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            text = screen()
        assert "EXITED 0" in text, text
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_a_refused_token_is_said_not_called_no_daemon(tmp_path: Path) -> None:
    """Defect: `kvtier top` without the token a daemon with tenants needs said "no kvtier daemon
    at ..."; it names what the daemon answered and where the token goes."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.a]\ntoken = "top-token-a1"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        env_token = os.environ.pop("KVTIER_TOKEN", None)
        try:
            out = kvtier("top", "--once", "--interval", "0.1", str(d.socket))
            wrong = kvtier("top", "--once", "--interval", "0.1", "--token", "not-the-token",
                           str(d.socket))
        finally:
            if env_token is not None:
                os.environ["KVTIER_TOKEN"] = env_token
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.splitlines() == [
            f"kvtier top: error: {d.socket}: UNAUTHENTICATED: missing 'authorization: Bearer "
            "<token>' metadata (give --token TOKEN or $KVTIER_TOKEN)"]
        assert wrong.returncode == 2 and "UNAUTHENTICATED: unknown token" in wrong.stderr
        ok = kvtier("top", "--once", "--interval", "0.1", "--token", "top-token-a1",
                    str(d.socket))
        assert ok.returncode == 0, ok.stderr
    finally:
        d.stop()


def test_mrc_is_absent_until_it_has_enough_samples(tmp_path: Path) -> None:
    """Defect: before the MRC had `MIN_SAMPLES` sampled block references, /metrics and `top`
    showed its hit ratios as 0.0 (charts and the rules built on them read zeros). Now the series
    are absent, `kvtier_mrc_sampled_blocks_total` counts toward them, and `top` says it is
    warming up; from `MIN_SAMPLES` on the curve is there."""
    from kvtier.client.sync_client import Client, LayoutDecl

    d = DaemonProc(tmp_path / "d").start()
    try:
        text = d.metrics_text()
        assert "kvtier_mrc_hit_ratio{" not in text and "kvtier_mrc_dram_hit_ratio{" not in text
        assert "kvtier_mrc_sampled_blocks_total 0.0" in text
        url = f"http://127.0.0.1:{d.metrics_port}"
        out = kvtier("top", "--json", "--interval", "0.1", str(d.socket), url)
        assert out.returncode == 0, out.stderr
        for r in json.loads(out.stdout):
            assert r["mrc"] == {} and r["mrc_headroom"] == {} and r["mrc_samples"] == 0
        table = kvtier("top", "--once", "--interval", "0.1", str(d.socket))
        assert f"warming up (0 of {MIN_SAMPLES} sampled blocks)" in table.stdout
        layout = LayoutDecl(fingerprint=b"mrc-warmup-fp-01", block_bytes=4096,
                            block_tokens=16, model_id="mrc/warmup")
        with Client(d.socket, layout=layout) as kv:
            for n in range(8):  # chains of 512 keys, sampled (nearly all) at this size
                if d.metric_sum("kvtier_mrc_sampled_blocks_total") >= MIN_SAMPLES:
                    break
                kv.lookup([(n * 512 + i).to_bytes(4, "big") * 8 for i in range(512)])
        assert d.metric_sum("kvtier_mrc_sampled_blocks_total") >= MIN_SAMPLES
        text = d.metrics_text()
        assert 'kvtier_mrc_hit_ratio{factor="1",scaled="none"}' in text
        out = kvtier("top", "--json", "--interval", "0.1", str(d.socket), url)
        for r in json.loads(out.stdout):
            assert len(r["mrc"]) >= 1 and r["mrc_samples"] >= MIN_SAMPLES
    finally:
        d.stop()
