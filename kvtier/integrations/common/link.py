"""An engine integration's connection to the daemon, for one layout, with the failure rule of
DESIGN invariant 7: an unreachable daemon makes `client()` answer None (the engine recomputes)
for `retry_after_s`, with one warning per outage, then it reconnects — sooner when a new daemon
takes the socket (its file is another one, checked at most every `PROBE_S`: a restarted
daemon, whose kept DRAM tier the engine then uses again at once; a daemon still draining keeps
its file, so it is not asked again before `retry_after_s`). Thread-safe (a vLLM worker's loads
and its background saves share one link; SGLang calls a backend from several threads).

    link = DaemonLink(settings, decl, "worker 0")   # settings: any `LinkSettings` (both
                                                    # engines' extra-config dataclasses);
                                                    # clock=: the time source of the outage
                                                    # window (a test's, to step it)
    client = link.client()                          # None while the daemon is down
    link.failed(exc, "Lookup")                      # a call failed: outage or one warning
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import grpc

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl, default_socket

log = logging.getLogger("kvtier.integrations.common")


class LinkSettings(Protocol):
    """The keys of an engine's extra config that the link reads (each engine's settings
    dataclass has them, with the same meaning and defaults)."""

    @property
    def socket(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def retry_after_s(self) -> float: ...
    @property
    def lease_ttl_s(self) -> float: ...


def unreachable(exc: BaseException) -> bool:
    """The daemon is gone or not answering (as opposed to refusing one request)."""
    if isinstance(exc, KvtierRpcError):
        return exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(exc, TimeoutError | ConnectionError | OSError)


PROBE_S = 0.25
"""During an outage, how often the link looks whether a new daemon took the socket."""


def socket_id(path: Path) -> tuple[int, int, int] | None:
    """Which file is at `path` now (device, inode, change time); None when none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def listening(path: Path) -> bool:
    """A process accepts connections on the Unix socket `path` (instant, unlike an RPC that
    waits for a daemon that is not there)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


class DaemonLink:
    def __init__(self, settings: LinkSettings, decl: LayoutDecl, role: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.decl = decl
        self.role = role
        self.socket = Path(settings.socket) if settings.socket else default_socket()
        self._client: Client | None = None
        self._down_until = 0.0
        self._down = False
        self._gone_from: tuple[int, int, int] | None = None  # the socket file the outage began on
        self._probe_at = 0.0
        self.outages = 0
        self._lock = threading.RLock()

    def down(self) -> bool:
        """Within an outage's `retry_after_s` (`client()` would answer None), unless a new
        daemon took the socket; no I/O but a stat of the socket at most every `PROBE_S`."""
        if self._client is not None:
            return False
        now = self.clock()
        return now < self._down_until and not self._replaced(now)

    def _replaced(self, now: float) -> bool:
        """Whether another socket file than the outage's is at the socket path (a new daemon
        bound it), looked at most every `PROBE_S`; once seen, the outage ends."""
        if now < self._probe_at:
            return False
        self._probe_at = now + PROBE_S
        found = socket_id(self.socket)
        if found is None or found == self._gone_from:
            return False
        self._down_until = 0.0
        return True

    def client(self) -> Client | None:
        if self._client is not None:
            return self._client
        with self._lock:
            return self._connect()

    def _connect(self) -> Client | None:
        if self._client is not None:
            return self._client
        now = self.clock()
        if now < self._down_until and not self._replaced(now):
            return None
        if not listening(self.socket):
            self._mark_down(ConnectionError(f"no daemon listening on {self.socket}"), "connect")
            return None
        s = self.settings
        try:
            self._client = Client(self.socket, layout=self.decl, token=s.token or None,
                                  timeout=s.timeout_s, lease_ttl_s=s.lease_ttl_s)
        except Exception as exc:
            self._mark_down(exc, "connect")
            return None
        if not self._client.uses_shm:
            self._client.close()
            self._client = None
            self._mark_down(ConnectionError(
                "the daemon's shared-memory segment cannot be mapped from this process "
                "(another host or user?); the engine integration needs it"), "connect")
            return None
        if self._down:
            log.warning("kvtier %s: daemon on %s reachable again", self.role, self.socket)
        self._down = False
        return self._client

    def failed(self, exc: BaseException, what: str) -> None:
        """A call failed: an unreachable daemon starts an outage, anything else is one warning."""
        with self._lock:
            self._failed(exc, what)

    def _failed(self, exc: BaseException, what: str) -> None:
        if unreachable(exc):
            self._mark_down(exc, what)
        else:
            log.warning("kvtier %s: %s failed, recomputing instead: %s: %s", self.role, what,
                        type(exc).__name__, exc)

    def _mark_down(self, exc: BaseException, what: str) -> None:
        if not self._down:
            self.outages += 1
            log.warning("kvtier %s: daemon unavailable or refusing (%s: %s: %s); the engine "
                        "runs without kvtier, retrying every %g s", self.role, what,
                        type(exc).__name__, exc, self.settings.retry_after_s)
        self._down = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None
        self._gone_from = socket_id(self.socket)
        self._down_until = self.clock() + self.settings.retry_after_s

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
