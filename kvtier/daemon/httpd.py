"""The daemon's HTTP endpoint (the `metrics` address): Prometheus metrics and the probes.

    GET /metrics   the daemon's registry in the Prometheus text format (OpenMetrics when the
                   scraper asks for it), 200
    GET /healthz   liveness: 200 "ok" while the process serves HTTP at all
    GET /readyz    readiness: 200 "ready" once the daemon serves (socket bound, tiers opened),
                   503 with the reason before that and once a drain began
    anything else  404; a method other than GET or HEAD: 405

One thread per request (`ThreadingHTTPServer`, daemon threads), so a slow scraper never blocks a
probe. Requests are not logged (a probe every second would flood the log).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

Readiness = Callable[[], str | None]
"""None when ready, else why not (one line)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    readiness: Readiness


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, encoder(self.server.registry), content_type)
        elif path == "/healthz":
            self._reply(200, b"ok\n")
        elif path == "/readyz":
            why = self.server.readiness()
            if why is None:
                self._reply(200, b"ready\n")
            else:
                self._reply(503, f"not ready: {why}\n".encode())
        else:
            self._reply(404, b"not found: /metrics, /healthz and /readyz are served\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self) -> None:
        self._reply(405, b"method not allowed\n", extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
               extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class HttpEndpoint:
    """Serves on a daemon thread from construction until `close()`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 readiness: Readiness) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.registry = registry
        self._server.readiness = readiness
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-http",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
