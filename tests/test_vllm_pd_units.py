"""The connector's prefill/decode roles against a real daemon, without a vLLM engine: a
producer's stores are pending at the daemon when `wait_for_save` returns (before its save thread
copies and commits them), a consumer neither stores nor allocates, a producer never looks up,
and a consumer's Lookups wait for blocks being written. (Real engines: tests/test_vllm_pd.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc, wait_for
from tests.test_pd_daemon import LONG, Waiting, daemon, metric, waiting  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtier.integrations.vllm.metadata import KvtierMetadata, SaveJob  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings, role_of  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.test_vllm_connector_threads import BT, KV, kv_caches, tokens  # noqa: E402


def settings(d: DaemonProc, **over: object) -> ConnectorSettings:
    return ConnectorSettings(socket=str(d.socket), use_plan=False, retry_after_s=60.0,
                             **over)  # type: ignore[arg-type]


def worker(d: DaemonProc, kv_role: str) -> tuple[WorkerSide, threading.Event]:
    """A worker of `kv_role` whose save thread waits for the returned event before it stores."""
    s = settings(d)
    w = WorkerSide(s, KV, 0, role_of(kv_role, s))
    w.register_kv_caches(kv_caches(16, 0))
    go = threading.Event()
    store = w.saver.store

    def held(staged: Any) -> None:
        assert go.wait(LONG)
        store(staged)

    w.saver.store = held  # type: ignore[method-assign]
    return w, go


def rpcs(d: DaemonProc, method: str) -> float:
    return metric(d, "kvtier_rpcs_total", f'method="{method}"')


def test_a_producers_blocks_are_pending_when_the_step_ends(daemon: DaemonProc) -> None:  # noqa: F811
    keys = block_keys(tokens(1, 6 * BT + 1), BT)
    w, go = worker(daemon, "kv_producer")
    with Client(daemon.socket, layout=KV.decl()) as consumer:
        with torch.inference_mode():
            w.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [3, 5, 7], keys[:3], b""),
                                                  SaveJob("r", [9, 2, 4], keys[3:6], keys[2])]))
        assert consumer.lookup(keys[:6]).hit_blocks == 0  # not committed: the save thread waits
        looking = Waiting(consumer, keys[:6])
        waiting(daemon)  # the Allocates were made within wait_for_save: the keys are pending
        go.set()
        assert looking.result().hit_blocks == 6
    assert w.saver.idle(10)
    w.close()


def test_a_kv_both_engines_stores_are_not_pending_before_its_save_thread(
        daemon: DaemonProc) -> None:  # noqa: F811
    """The control: without the hand-off, nothing is pending until the save thread allocates,
    so a consumer looking up then would miss (and recompute)."""
    keys = block_keys(tokens(2, 3 * BT + 1), BT)
    w, go = worker(daemon, "kv_both")
    with Client(daemon.socket, layout=KV.decl()) as consumer:
        with torch.inference_mode():
            w.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [3, 5, 7], keys[:3], b"")]))
        assert consumer.lookup(keys[:3], wait_pending_s=LONG).hit_blocks == 0
        go.set()
        assert w.saver.idle(10)
        assert consumer.lookup(keys[:3]).hit_blocks == 3
    w.close()


def test_a_consumer_stores_nothing_and_allocates_nothing(daemon: DaemonProc) -> None:  # noqa: F811
    keys = block_keys(tokens(3, 3 * BT + 1), BT)
    before = rpcs(daemon, "Allocate")
    w, go = worker(daemon, "kv_consumer")
    go.set()
    with torch.inference_mode():
        w.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [3, 5, 7], keys[:3], b"")]))
    assert w.saver.idle(10)
    assert w.stats.take()["stored_blocks"] == 0
    w.close()
    assert rpcs(daemon, "Allocate") == before
    with Client(daemon.socket, layout=KV.decl()) as kv:
        assert kv.lookup(keys[:3]).hit_blocks == 0


class Req(SimpleNamespace):
    kv_transfer_params: dict[str, object] | None = None  # vLLM's Request has it (None: no hints)


def scheduler(d: DaemonProc, kv_role: str, **over: object) -> SchedulerSide:
    s = settings(d, **{"async_lookup": False, "pending_wait_s": LONG, **over})
    return SchedulerSide(s, KV, 1, 1, False, role_of(kv_role, s))


def request(rid: str, toks: list[int]) -> Req:
    return Req(request_id=rid, block_hashes=block_keys(toks, BT), num_tokens=len(toks),
               num_prompt_tokens=len(toks), num_computed_tokens=0)


def test_scheduler_sides_of_the_roles(daemon: DaemonProc) -> None:  # noqa: F811
    toks = tokens(4, 4 * BT + 5)
    keys = block_keys(toks, BT)
    with Client(daemon.socket, layout=KV.decl()) as kv:
        kv.store(keys, [bytes([i]) * KV.block_bytes for i in range(len(keys))])
    lookups = metric(daemon, "kvtier_lookups_total")
    state = SimpleNamespace(get_block_ids=lambda rid: ([20, 21, 22, 23, 24],))
    out = SimpleNamespace(num_scheduled_tokens={"r": len(toks)}, kv_connector_block_state=state)
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],))

    producer = scheduler(daemon, "kv_producer")
    req = request("r", toks)
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert metric(daemon, "kvtier_lookups_total") == lookups  # not even asked
    producer.update_state_after_alloc(req, blocks, 0)  # type: ignore[arg-type]
    assert [j.keys for j in producer.build_connector_meta(out).saves] == [keys]  # type: ignore[arg-type]
    producer.close()

    consumer = scheduler(daemon, "kv_consumer")
    req = request("r", toks)
    assert consumer.get_num_new_matched_tokens(req, 0) == (4 * BT, False)  # type: ignore[arg-type]
    consumer.update_state_after_alloc(req, blocks, 4 * BT)  # type: ignore[arg-type]
    meta = consumer.build_connector_meta(out)  # type: ignore[arg-type]
    assert len(meta.loads) == 1 and meta.saves == []
    consumer.close()


def test_a_consumers_lookup_waits_for_the_prefills_blocks(daemon: DaemonProc) -> None:  # noqa: F811
    toks = tokens(5, 3 * BT + 5)
    keys = block_keys(toks, BT)
    consumer = scheduler(daemon, "kv_consumer", async_lookup=True)
    with Client(daemon.socket, layout=KV.decl()) as producer:
        reply = producer.allocate(keys, handoff=True)
        req = request("r", toks)
        assert consumer.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
        waiting(daemon)
        # another request's Lookup is not held up behind the waiting one
        other = request("o", tokens(6, 2 * BT + 1))
        wait_for(lambda: consumer.get_num_new_matched_tokens(other, 0) == (0, False))  # type: ignore[arg-type]
        assert consumer.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
        with producer.store_into(keys, allocated=reply) as tx:
            for _, view in tx.slots:
                view[:] = 7
    wait_for(lambda: consumer.get_num_new_matched_tokens(req, 0) == (3 * BT, False))  # type: ignore[arg-type]
    consumer.close()
