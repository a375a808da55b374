"""A real Prometheus server for tests: Debian's `prometheus` binary on 127.0.0.1 (a free port),
a temporary data dir, a short scrape and rule-evaluation interval, the rules of
deploy/prometheus/ loaded, scraping the /metrics ports it is given.

    with PrometheusProc(tmp, targets=["127.0.0.1:9464"]) as prom:
        prom.query("up")   # -> list of {"metric": {...}, "value": [t, "1"]}
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_fixture import ROOT

RULES = ROOT / "deploy" / "prometheus"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("KVTIER_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("prometheus not found (apt-get install -y prometheus)")
        pytest.skip("prometheus not found: apt-get install -y prometheus (bin/test does)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(RuntimeError):
    """prometheus could not bind its port: another process took it meanwhile."""


class PrometheusProc:
    def __init__(self, workdir: Path, targets: list[str], interval: str = "1s",
                 job: str = "kvtier") -> None:
        self.workdir = workdir
        self.targets = targets
        self.interval = interval
        self.job = job
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        rules = sorted(str(p) for p in RULES.glob("*.yml"))
        return json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": rules,
            "scrape_configs": [{
                "job_name": self.job,
                "static_configs": [{"targets": self.targets, "labels": {"cluster": "test"}}],
            }],
        }, indent=2)

    def __enter__(self) -> PrometheusProc:
        """Starts the server on a free port and waits until it is ready; a port another process
        took before the server bound it is replaced by another."""
        for _ in range(5):
            try:
                return self._start()
            except _PortTaken:
                continue
        raise RuntimeError("prometheus: no free port after 5 tries")

    def _start(self) -> PrometheusProc:
        binary = prometheus_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(self.config())
        self.port = free_port()
        (self.workdir / "prometheus.log").unlink(missing_ok=True)  # this start's lines only
        log = open(self.workdir / "prometheus.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log():
                    raise _PortTaken(self.log())
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"prometheus not ready after 30 s:\n{self.log()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        p = self.workdir / "prometheus.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return result
