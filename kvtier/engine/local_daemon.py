"""A `kvtier serve` child process for the demo and benchmarks: start, wait until healthy, stop.

    with LocalDaemon(workdir, ["--dram-bytes", "64MiB"]) as d:
        ... Client(d.socket, ...) ...

The child gets its own socket and data dir under `workdir` and no metrics port unless asked.
`stop()` is SIGTERM (the daemon drains, flushes write-back and closes LMDB) and waits;
`kill()` is SIGKILL. The log goes to `workdir/daemon.log`. Not thread-safe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.tiers import segment_owner


def daemon_alive(socket: Path, timeout: float = 1.0) -> bool:
    """True when a daemon answers gRPC health checks with SERVING on `socket`."""
    if not socket.exists():
        return False
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class LocalDaemon:
    def __init__(self, workdir: Path, args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.socket = workdir / "kvtier.sock"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "daemon.log"
        self.args = ["--socket", str(self.socket), "--data-dir", str(self.data_dir),
                     "--metrics", "", *args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> LocalDaemon:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_CONFIG"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {self.proc.returncode}; see "
                                   f"{self.log_path}:\n{self.log()[-2000:]}")
            if daemon_alive(self.socket):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"kvtier serve not healthy after {timeout:.0f} s; see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (the daemon drains); returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            # A SIGKILLed daemon cannot unlink its shared-memory segment: do it for it.
            segment_owner.reclaim(segment_owner.record_path(self.socket), self.proc.pid)

    def restart(self) -> LocalDaemon:
        self.stop()
        return self.start()

    def __enter__(self) -> LocalDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()
