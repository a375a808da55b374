"""A prefill/decode proxy for a fleet without a router (and for the tests): one OpenAI-style
endpoint in front of prefill engines (`kv_role: kv_producer`) and decode engines
(`kv_consumer`), as vLLM's own disaggregation examples do it.

    POST /v1/completions, /v1/chat/completions
        1. the request, with max_tokens (and max_completion_tokens) 1, not streamed, to a
           prefill server: it computes the prompt and its connector stores the KV (its blocks
           pending at the daemon before it answers); its answer is dropped, except
           `kv_transfer_params` (a transfer engine's, e.g. NIXL's under MultiConnector)
        2. the request as it came (plus those kv_transfer_params) to a decode server, whose
           answer goes back as it comes (status, headers, body; a stream chunk by chunk): its
           connector loads the prefix, waiting for blocks still being written
    GET /health      200 when every server answers its /health, else 503 naming those that do
                     not ({"prefill": {url: "ok" | why}, "decode": {...}})
    GET /v1/models   the first decode server's
    anything else    404

Servers are taken in turn (round robin per side). A server that cannot be reached, or answers
with a 5xx, is a 502 to the client naming the side and the server ("prefill server
http://h:8100 unreachable: ..."); a 4xx from the prefill server (a bad request) goes back as it
is, and the decode server is not asked. Both requests carry the same `X-Request-Id`.
`kv_transfer_params` asks the prefill server for a remote decode (`do_remote_decode`), as
vLLM's examples do: kvtier's connector ignores it; a transfer engine beside it reads it.

Standard library only (one thread per connection, `ThreadingHTTPServer`): a small fleet's
front, not a load balancer.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvtier.pd_proxy")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 << 20
PREFILL_TRANSFER = {"do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                    "remote_port": None}
HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length",
                         "proxy-connection", "upgrade", "te", "trailer"))


class Upstream(Exception):
    """A server could not be reached or failed (5xx): the client gets a 502 with this text."""


def check_url(url: str) -> str:
    """A server's base URL (http://host:port, no path), or ValueError saying why not."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.path not in ("", "/") or u.query:
        raise ValueError(f"expected http://HOST:PORT, got {url!r}")
    return f"http://{u.netloc}"


class Side:
    """The servers of one side (prefill or decode), taken in turn."""

    def __init__(self, name: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"no {name} server given")
        self.name = name
        self.urls = [check_url(u) for u in urls]
        self._next = itertools.cycle(self.urls)
        self._lock = threading.Lock()

    def pick(self) -> str:
        with self._lock:
            return next(self._next)


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout)


def call(side: Side, url: str, method: str, path: str, body: bytes | None,
         headers: dict[str, str], timeout: float
         ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Sends one request; the open connection and its response (the caller reads and closes).
    Upstream when the server cannot be reached or answers a 5xx (its body in the message)."""
    conn = _connect(url, timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise Upstream(f"{side.name} server {url} unreachable: {type(exc).__name__}: "
                       f"{exc}") from None
    if resp.status >= 500:
        text = resp.read(2000).decode(errors="replace").strip()
        conn.close()
        raise Upstream(f"{side.name} server {url} failed: HTTP {resp.status}: {text}")
    return conn, resp


def health(sides: Sequence[Side], timeout: float) -> dict[str, dict[str, str]]:
    """Each server's /health: "ok", or why not."""
    out: dict[str, dict[str, str]] = {}
    for side in sides:
        got = out.setdefault(side.name, {})
        for url in side.urls:
            try:
                conn, resp = call(side, url, "GET", "/health", None, {}, timeout)
            except Upstream as exc:
                got[url] = str(exc)
                continue
            resp.read()
            conn.close()
            got[url] = "ok" if resp.status == 200 else f"HTTP {resp.status}"
    return out


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: the client's, for one output token, not streamed, asking
    for a remote decode."""
    req = dict(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    for key in ("stream_options", "min_tokens"):
        req.pop(key, None)
    req["kv_transfer_params"] = dict(PREFILL_TRANSFER)
    return req


class Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: Side, decode: Side,
                 timeout_s: float) -> None:
        super().__init__(address, Handler)
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Proxy

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        log.warning("pd-proxy: %s", message)
        self._json(status, {"error": {"message": message, "type": "pd_proxy", "code": status}})

    def do_GET(self) -> None:
        p = self.server
        if self.path == "/health":
            got = health((p.prefill, p.decode), min(p.timeout_s, 5.0))
            ok = all(v == "ok" for side in got.values() for v in side.values())
            self._json(200 if ok else 503, got)
        elif self.path == "/v1/models":
            self._relay(p.decode, p.decode.pick(), "GET", self.path, None, {})
        else:
            self._error(404, f"no such path {self.path!r}")

    def do_POST(self) -> None:
        p = self.server
        if self.path not in COMPLETIONS:
            self._error(404, f"no such path {self.path!r} (this proxy serves "
                             f"{', '.join(COMPLETIONS)})")
            return
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_BODY:
            self._error(400, f"a JSON body of 1..{MAX_BODY} bytes is needed")
            return
        try:
            body = json.loads(self.rfile.read(size))
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self._error(400, f"the body is not a JSON object: {exc}")
            return
        rid = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        auth = self.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        prefill_url = p.prefill.pick()
        try:
            conn, resp = call(p.prefill, prefill_url, "POST", self.path,
                              json.dumps(prefill_request(body)).encode(), headers, p.timeout_s)
        except Upstream as exc:
            self._error(502, str(exc))
            return
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._error(502, f"prefill server {prefill_url} broke off: {exc}")
            return
        finally:
            conn.close()
        if resp.status != 200:  # the client's request is bad: say so, as the server did
            self._send(resp.status, resp.getheaders(), iter([data]))
            return
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if params:
            body = {**body, "kv_transfer_params": params}
        self._relay(p.decode, p.decode.pick(), "POST", self.path, json.dumps(body).encode(),
                    headers)

    def _relay(self, side: Side, url: str, method: str, path: str, body: bytes | None,
               headers: dict[str, str]) -> None:
        try:
            conn, resp = call(side, url, method, path, body, headers, self.server.timeout_s)
        except Upstream as exc:
            self._error(502, str(exc))
            return
        try:
            self._send(resp.status, resp.getheaders(), _pieces(resp))
        finally:
            conn.close()

    def _send(self, status: int, headers: list[tuple[str, str]], pieces: Iterator[bytes]
              ) -> None:
        """Sends a response chunked, the upstream's headers kept (but hop-by-hop ones)."""
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for piece in pieces:
                if piece:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as exc:
            log.warning("pd-proxy: a response was cut off: %s: %s", type(exc).__name__, exc)
            self.close_connection = True


def _pieces(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body as it arrives (a server-sent event stream event by event)."""
    while piece := resp.read1(65536):
        yield piece


def serve(prefill: Sequence[str], decode: Sequence[str], host: str = "127.0.0.1",
          port: int = 8000, timeout_s: float = 600.0) -> Proxy:
    """A proxy bound to (host, port) (port 0: any); call `serve_forever()` on it (and
    `shutdown()` from another thread to stop it)."""
    return Proxy((host, port), Side("prefill", prefill), Side("decode", decode), timeout_s)
