"""`kvtier pd-proxy` (`kvtier.integrations.vllm.pd_proxy`) against small stand-in OpenAI servers
that record what they are sent: what the prefill and the decode server get, a stream relayed as
it comes, health, and the error a client sees when either side is down. (With real vLLM servers
behind it: tests/test_vllm_pd.py.)"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtier.integrations.vllm.pd_proxy import Proxy, check_url, serve
from tests.daemon_fixture import ROOT


class Fake(ThreadingHTTPServer):
    """An OpenAI-style server: /health, /v1/models and the completions, recording each body."""

    daemon_threads = True

    def __init__(self, name: str, status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.name = name
        self.status = status
        self.seen: list[tuple[str, dict[str, Any], str]] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Fake

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {})
        else:
            self._reply(200, {"data": [{"id": self.server.name}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body, self.headers.get("X-Request-Id", "")))
        if self.server.status != 200:
            self._reply(self.server.status, {"error": {"message": "bad prompt"}})
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                event = f"data: {json.dumps({'i': i, 'by': self.server.name})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._reply(200, {"by": self.server.name, "choices": [{"text": "x"}],
                              "kv_transfer_params": {"remote_block_ids": [1, 2],
                                                     "from": self.server.name}})


@pytest.fixture
def fleet() -> Iterator[tuple[Fake, Fake, Proxy]]:
    p, d = Fake("prefill"), Fake("decode")
    proxy = serve([p.url], [d.url], port=0, timeout_s=30)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield p, d, proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        p.stop()
        d.stop()


def post(url: str, body: object, headers: dict[str, str] | None = None
         ) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_prefill_with_one_token_then_decode_as_asked(fleet: tuple[Fake, Fake, Proxy]) -> None:
    p, d, proxy = fleet
    asked = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 40, "min_tokens": 4,
             "temperature": 0.0}
    status, data = post(proxy.url + "/v1/completions", asked, {"X-Request-Id": "req-1"})
    assert status == 200 and json.loads(data)["by"] == "decode"
    ((path, first, rid1),) = p.seen
    assert path == "/v1/completions" and rid1 == "req-1"
    assert first["max_tokens"] == 1 and first["stream"] is False and "min_tokens" not in first
    assert first["prompt"] == [5, 6, 7] and first["kv_transfer_params"]["do_remote_decode"]
    ((_, second, rid2),) = d.seen
    assert rid2 == "req-1"
    assert second == {**asked, "kv_transfer_params": {"remote_block_ids": [1, 2],
                                                      "from": "prefill"}}


def test_chat_and_streams_are_relayed_as_they_come(fleet: tuple[Fake, Fake, Proxy]) -> None:
    p, d, proxy = fleet
    asked = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
             "max_completion_tokens": 9, "stream": True,
             "stream_options": {"include_usage": True}}
    status, data = post(proxy.url + "/v1/chat/completions", asked)
    assert status == 200
    events = [json.loads(e) for e in re.findall(rb"data: (.*)\n\n", data)]
    assert events == [{"i": i, "by": "decode"} for i in range(3)]
    first = p.seen[0][1]
    assert first["max_completion_tokens"] == 1 and first["stream"] is False
    assert "stream_options" not in first
    assert d.seen[0][1]["stream"] is True and d.seen[0][1]["max_completion_tokens"] == 9
    assert p.seen[0][2] == d.seen[0][2] != ""  # one request id, made up by the proxy


def test_either_side_down_is_a_clear_502(fleet: tuple[Fake, Fake, Proxy]) -> None:
    p, d, proxy = fleet
    body = {"model": "m", "prompt": [1], "max_tokens": 2}
    d.stop()
    status, data = post(proxy.url + "/v1/completions", body)
    assert status == 502
    message = json.loads(data)["error"]["message"]
    assert message.startswith(f"decode server {d.url} unreachable"), message
    status, data = get(proxy.url + "/health")
    got = json.loads(data)
    assert status == 503 and got["prefill"] == {p.url: "ok"}
    assert got["decode"][d.url].startswith("decode server")
    p.stop()
    status, data = post(proxy.url + "/v1/completions", body)
    assert status == 502
    assert json.loads(data)["error"]["message"].startswith(f"prefill server {p.url} unreachable")


def test_health_and_models(fleet: tuple[Fake, Fake, Proxy]) -> None:
    p, d, proxy = fleet
    status, data = get(proxy.url + "/health")
    assert status == 200 and json.loads(data) == {"prefill": {p.url: "ok"},
                                                  "decode": {d.url: "ok"}}
    status, data = get(proxy.url + "/v1/models")
    assert status == 200 and json.loads(data) == {"data": [{"id": "decode"}]}
    assert get(proxy.url + "/nope")[0] == 404


def test_a_bad_request_answers_as_the_prefill_server_did() -> None:
    p, d = Fake("prefill", status=400), Fake("decode")
    proxy = serve([p.url], [d.url], port=0, timeout_s=30)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        status, data = post(proxy.url + "/v1/completions", {"prompt": [1]})
        assert status == 400 and json.loads(data)["error"]["message"] == "bad prompt"
        assert d.seen == []  # the decode server is not asked
        assert post(proxy.url + "/v1/completions", [1, 2])[0] == 400  # not an object
    finally:
        proxy.shutdown()
        proxy.server_close()
        p.stop()
        d.stop()


@pytest.mark.parametrize("bad", ["ftp://h:1", "http://h:1/v1", "h:1", "http://:1"])
def test_server_urls_are_checked(bad: str) -> None:
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        check_url(bad)


def test_the_command_serves_and_stops(tmp_path: Any) -> None:
    p, d = Fake("prefill"), Fake("decode")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "pd-proxy", "--prefill", p.url, "--decode", d.url,
         "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"kvtier pd-proxy on http://127.0.0.1:{port}: prefill {p.url}")
        status, data = post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": [3]})
        assert status == 200 and json.loads(data)["by"] == "decode"
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        p.stop()
        d.stop()
    bad = subprocess.run([sys.executable, "-m", "kvtier", "pd-proxy", "--prefill", "x",
                          "--decode", d.url], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "expected http://HOST:PORT, got 'x'" in bad.stderr
