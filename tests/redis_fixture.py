"""Real `redis-server` processes for tests: one per test on 127.0.0.1, a free port, a temp dir,
no persistence; `RedisCluster3` starts three cluster-enabled nodes and joins them with
`redis-cli --cluster create`. `bin/test` installs Debian's redis-server when it is missing and sets
KVTIER_REQUIRE_REDIS=1 (a missing server is then an error); elsewhere the tests are skipped with
the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
REDIS_CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")
if (REDIS_SERVER is None or REDIS_CLI is None) and os.environ.get("KVTIER_REQUIRE_REDIS") == "1":
    raise RuntimeError("redis-server / redis-cli not found (apt-get install -y redis-server)")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server not installed (bin/test installs it: apt-get install -y redis-server)",
)


def free_port(bus: bool = False) -> int:
    """A free loopback port (and, with `bus`, port + 10000 free too: the cluster bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port")


class _PortTaken(RuntimeError):
    """redis-server could not bind its port: another process took it meanwhile."""


LIVE: set[RedisServer] = set()
"""The servers started and not yet stopped: `conftest.pytest_sessionfinish` kills any a test
left running and fails the session."""


class RedisServer:
    def __init__(self, workdir: Path, args: Sequence[str] = (), port: int = 0,
                 bus: bool = False, password: str = "") -> None:
        self.workdir = workdir
        self.port = port or free_port(bus)
        self.bus = bus
        self._may_move = not port  # a port of our choosing, until a start got it
        self.password = password
        self.args = list(args) + (["--requirepass", password] if password else [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Starts the server and waits until it answers; a free port another process took
        before the server bound it is replaced by another, on a first start only (a restart
        keeps the port its clients know)."""
        for _ in range(5):
            try:
                self._start(timeout)
            except _PortTaken:
                if not self._may_move:
                    raise
                self.port = free_port(self.bus)
                continue
            self._may_move = False
            return self
        raise RuntimeError("redis-server: no free port after 5 tries")

    def _start(self, timeout: float) -> None:
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "redis.log").unlink(missing_ok=True)  # this start's lines only
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
             "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", *self.args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        LIVE.add(self)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text()
                if "Address already in use" in log:
                    raise _PortTaken(log)
                raise RuntimeError(f"redis-server exited {self.proc.returncode}: {log[-2000:]}")
            try:  # ours answers (not another process's server on the port)
                if self._probe().info("server")["process_id"] == self.proc.pid:
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("redis-server did not answer")

    def _probe(self) -> Any:
        """A client that gives up at once (no retries, 0.5 s timeouts): the start's probe."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5,
                           socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0),
                           password=self.password or None)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                           password=self.password or None)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        LIVE.discard(self)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        LIVE.discard(self)


class RedisCluster3:
    """Three master nodes on loopback ports, all 16384 slots assigned, cluster_state:ok."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            RedisServer(workdir / f"n{i}", ["--cluster-enabled", "yes", "--cluster-config-file",
                                            "nodes.conf", "--cluster-node-timeout", "2000"],
                        bus=True)
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> RedisCluster3:
        assert REDIS_CLI is not None
        for n in self.nodes:
            n.start()
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                   for n in self.nodes):
                return self
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
