"""A real daemon subprocess for tests: `python -m kvtier serve` on a temp socket and data dir.

    from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

    def test_x(daemon: DaemonProc) -> None:
        with Client(daemon.socket, layout=...) as kv: ...

`DaemonProc.start()` waits until gRPC health reports SERVING; the log goes to `log_path`.
`kill()` (SIGKILL) also unlinks the dead daemon's shared-memory segment, which it could not.
Small pools by default (16 MiB DRAM of 64 KiB slots) so tests are fast.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client
from kvtier.tiers import segment_owner

ROOT = Path(__file__).resolve().parents[1]

ENGINE_CALL_TIMEOUT_S = 300.0
"""The connector's `timeout_s` for engines whose tests restart the daemon and plant blocks the
engine must load (a call that times out starts an outage: nothing is loaded or stored until
`retry_after_s`). The default 1 s is too short on a shared 2-core machine, and this VM stops
every process at times — seen for 8-163 s here (the kernel's "workqueue lockup" lines), no steal
time counted; a 30 s bound failed a CI run, and a 120 s one a full run here. A call to a live
daemon never waits this long otherwise; a module that SIGKILLs the daemon keeps 1 s (a call to
a killed daemon waits its whole timeout)."""


DAEMON_START_S = 300.0
"""How long `DaemonProc.start` waits for a daemon to answer its health check, and `stop` for it
to exit: hang checks only (a daemon does either within seconds), above the VM's stalls (a 120 s
start bound failed a full run here during a 163 s one, a 30 s stop bound during a 59 s one)."""


LIVE: set[DaemonProc] = set()
"""The daemons started and not yet seen to exit: `conftest.pytest_sessionfinish` kills any a
test left running (one whose start raised before its `try`, say) and fails the session."""


class DaemonProc:
    def __init__(self, workdir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 launcher: Sequence[str] = ()):
        """`launcher`: a command that runs the daemon's command line given as its arguments
        (e.g. one that drops capabilities first)."""
        self.workdir = workdir
        self.launcher = list(launcher)
        self.socket = workdir / "run" / "kvtier.sock"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "daemon.log"
        self.args = [
            "--socket", str(self.socket), "--data-dir", str(self.data_dir),
            "--dram-bytes", "16MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "64MiB",
            "--metrics", "127.0.0.1:0", "--grace-s", "2", *args,
        ]
        # the checkout first; what the caller's PYTHONPATH adds stays (packages installed
        # beside the interpreter's, as bench.gpu_check's install step does)
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env or {})}
        self.env.pop("KVTIER_CONFIG", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0

    def start(self, timeout: float = DAEMON_START_S) -> DaemonProc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "kvtier", "serve", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
        )
        log.close()
        LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self._healthy():
                found = re.findall(r"metrics http://[\d.]+:(\d+)/metrics", self.log())
                self.metrics_port = int(found[-1]) if found else 0
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"daemon not healthy after {timeout} s:\n{self.log()}")

    def _healthy(self) -> bool:
        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def healthy(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._healthy()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = DAEMON_START_S, keep: bool = False) -> int:
        """SIGTERM (drain) and wait; returns the exit code. `keep`: what a daemon with
        `--keep-dram` left for the next one stays (else it is reclaimed, as a stop without
        `--keep-dram` leaves nothing)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if not keep:
            self._reclaim_segment()  # a no-op after a clean exit without --keep-dram
        LIVE.discard(self)
        return code

    def _reclaim_segment(self) -> None:
        assert self.proc is not None
        segment_owner.reclaim(segment_owner.record_path(self.socket), self.proc.pid)

    def kill(self, keep: bool = False) -> None:
        """SIGKILL; then unlinks the segment the dead daemon could not (it is RAM in /dev/shm),
        unless `keep` (the next daemon, with `--keep-dram`, adopts it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None and not keep:
            self._reclaim_segment()
        LIVE.discard(self)

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return str(r.read().decode())

    def metric_sum(self, name: str) -> float:
        """The samples of metric `name` (e.g. "kvtier_lookups_total") summed over its labels."""
        return sum(float(line.split()[-1]) for line in self.metrics_text().splitlines()
                   if line.startswith((name + " ", name + "{")))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d").start()
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop()  # also reclaims the segment of a daemon that died during the test


def ssd_blocks(kv: Client) -> int:
    """The SSD tier's block count in `kv`'s Stats."""
    return int(next(t.blocks for t in kv.stats().tiers if t.tier == pb.TIER_SSD))


def wait_ssd_blocks(kv: Client, want: int, timeout: float = 30.0) -> int:
    """Waits until the SSD tier holds `want` blocks (write-back is asynchronous), at most
    `timeout` seconds; returns the count then."""
    deadline = time.monotonic() + timeout
    while ssd_blocks(kv) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return ssd_blocks(kv)


def wait_for(pred: Callable[[], object], timeout: float = 15.0) -> None:
    """Polls `pred` every 50 ms until it is true; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


SAVES_SETTLE_S = 20.0
"""How long a test waits for an engine's background saves (and their write leases) to finish
after its request returned: well under the daemon's default 30 s lease TTL, so a lease that was
leaked rather than released still fails the wait instead of expiring inside it."""
