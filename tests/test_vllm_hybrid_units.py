"""The connector's hybrid-model pieces without an engine: the per-group layout, per-group loads
(each layer copies only its group's pairs; never a -1), per-group saves, and the scheduler side's
choice of blocks (a sliding group's window only, never vLLM's null block; saves skip blocks some
group holds as the null block). The loads and the worker run against a real daemon where they
move bytes; vLLM's scheduler objects are stand-ins carrying only the fields the code reads."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

from kvtier.integrations.common.loads import LayerLoads, Lease, TorchLoads  # noqa: E402
from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

BT, PAGE, BLOCKS = 32, 256, 16
GROUPS = (0, 1, 0)  # layers 0 and 2 full attention, layer 1 a sliding window of 64 tokens
WINDOWS = (0, 64)


def kv(**over: Any) -> EngineKV:
    base: dict[str, Any] = dict(model_id="m@1", dtype="bfloat16", block_tokens=BT,
                                layer_names=("l0", "l1", "l2"), page_bytes=PAGE, kv_heads=1,
                                head_size=64, backend="cpu", shard=Shard(0, 1, True),
                                layer_groups=GROUPS, windows=WINDOWS, hash_tokens=BT)
    base.update(over)
    return EngineKV(**base)


def test_groups_are_in_the_fingerprint_and_a_plain_model_keeps_its_own() -> None:
    plain = kv(layer_groups=(), windows=(0,), hash_tokens=0)
    assert not plain.hybrid and "groups" not in plain.describe()
    hybrid = kv()
    assert hybrid.hybrid and "/groups[full,swa64]/layer-groups[0,1,0]/hash32" in hybrid.describe()
    others = [kv(windows=(0, 128)), kv(layer_groups=(1, 0, 1)), kv(hash_tokens=16), plain]
    prints = {o.fingerprint() for o in others}
    assert hybrid.fingerprint() not in prints and len(prints) == len(others)
    assert kv(windows=(128,), layer_groups=(0, 0, 0)).hybrid  # one sliding group: hybrid too


def test_window_blocks_hash_step_and_group_bytes() -> None:
    k = kv()
    assert k.window_blocks(0) == 0 and k.window_blocks(1) == 64 // BT + 1
    assert kv(windows=(0, 65)).window_blocks(1) == 4  # ceil(65 / 32) + 1
    assert k.hash_step() == 1 and kv(block_tokens=64, hash_tokens=16).hash_step() == 4
    assert k.group_bytes() == [2 * PAGE, PAGE] and sum(k.group_bytes()) == k.block_bytes


def chunks(seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BLOCKS, PAGE), generator=g, dtype=torch.uint8)
            for _ in GROUPS]


def rows(seed: int, slots: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (slots, PAGE * len(GROUPS)),
                                                dtype=np.uint8)


# slots 3, 5, 6 -> full blocks 4, 9, 1; the sliding group needs only the last two (blocks 7, 8)
LEASE = Lease("a", [3, 5, 6], [4, 9, 1], ([4, 9, 1], [-1, 7, 8]))


@pytest.mark.parametrize("kind", ["engine", "torch"])
def test_each_layer_copies_only_its_groups_pairs(kind: str) -> None:
    dst, src = chunks(1), rows(2)
    before = [c.clone() for c in dst]
    calls: list[tuple[str, int]] = []

    def release(lease_id: str, nbytes: int, seconds: float) -> bool:
        calls.append((lease_id, nbytes))
        return True

    loads = (LayerLoads(dst, 1, release, backend="cpu", layer_groups=GROUPS) if kind == "engine"
             else TorchLoads(dst, 1, release, GROUPS))
    loads.start(src, 1, [LEASE])
    done = loads.finish()
    assert done.loaded == 3 and not done.failed and not done.failed_leases
    pages = 3 + 2 + 3  # full layers: 3 blocks each; the sliding layer: 2
    assert done.nbytes == pages * PAGE and calls == [("a", pages * PAGE)]
    for layer, g in enumerate(GROUPS):
        want = {b: s for s, b in zip(LEASE.slots, LEASE.groups[g], strict=True) if b >= 0}
        for b in range(BLOCKS):
            got = dst[layer][b].numpy()
            if b in want:
                assert (got == src[want[b], layer * PAGE:(layer + 1) * PAGE]).all(), (layer, b)
            else:
                assert torch.equal(dst[layer][b], before[layer][b]), (layer, b)
    loads.close()


def test_a_refused_release_fails_the_lease() -> None:
    loads = LayerLoads(chunks(3), 1, lambda *_: False, backend="cpu", layer_groups=GROUPS)
    loads.start(rows(4), 1, [LEASE])
    done = loads.finish()
    assert done.failed_leases == {"a"} and done.failed == {4, 9, 1} and done.loaded == 0
    loads.close()


def settings(d: DaemonProc) -> ConnectorSettings:
    return ConnectorSettings.from_extra({"socket": str(d.socket), "async_save": False})


def test_worker_stores_and_loads_per_group_and_reports_per_request(
        daemon: DaemonProc) -> None:  # noqa: F811
    k = kv()
    caches = {n: c.view(BLOCKS, PAGE) for n, c in zip(k.layer_names, chunks(5), strict=True)}
    w1 = WorkerSide(settings(daemon), k, 0)
    w1.register_kv_caches(caches)
    keys = block_keys(list(range(3, 3 + 3 * BT)), BT)
    # block j of the full layers is vLLM block 2 + j, of the sliding layer 10 + j
    w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [2, 3, 4], keys, b"",
                                                   ([2, 3, 4], [10, 11, 12]))]))
    with Client(daemon.socket, layout=k.decl()) as c, c.load(keys) as got:
        assert got.blocks == 3
        for j, view in enumerate(got.views):
            for layer, g in enumerate(GROUPS):
                src = (2 + j) if g == 0 else (10 + j)
                page = view[layer * PAGE:(layer + 1) * PAGE]
                assert (page == caches[k.layer_names[layer]][src].numpy()).all()
    w1.close()
    dst = {n: torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for n in k.layer_names}
    w2 = WorkerSide(settings(daemon), k, 0)
    w2.register_kv_caches(dst)
    w2.start_load_kv(KvtierMetadata(loads=[
        LoadJob("q", [5, 6, 7], keys, 0, ([5, 6, 7], [-1, 14, 15])),
        LoadJob("gone", [8], block_keys(list(range(500, 500 + BT)), BT), 0, ([8], [9]))]))
    done, failed = w2.transfer_results()
    assert done == {"q", "gone"} and failed == {"gone"}  # nothing stored under its key
    assert w2.take_load_errors() == set()  # hybrid failures are per request, never block ids
    for layer, g in enumerate(GROUPS):
        name = k.layer_names[layer]
        if g == 0:
            for j in range(3):
                assert torch.equal(dst[name][5 + j], caches[name][2 + j])
        else:
            assert torch.equal(dst[name][14], caches[name][11])
            assert torch.equal(dst[name][15], caches[name][12])
            assert not dst[name][13].any()  # block 0 of the sliding group: not in its window
    assert w2.stats.take()["loaded_bytes"] == (3 + 3 + 2) * PAGE
    assert w2.transfer_results() == (set(), set())  # each request reported once
    w2.close()


@dataclass
class Block:
    block_id: int
    is_null: bool = False


class Req(SimpleNamespace):
    kv_transfer_params: dict[str, object] | None = None  # vLLM's Request has it (None: no hints)


def side(k: EngineKV) -> SchedulerSide:
    s = ConnectorSettings.from_extra({"socket": "/nonexistent/kvtier.sock",
                                      "async_lookup": False})
    return SchedulerSide(s, k, 1, 1, False)


def test_a_load_fills_the_window_of_a_sliding_group_and_never_the_null_block() -> None:
    sch = side(kv())
    null = Block(0, True)
    full = [Block(20 + j) for j in range(6)]
    # block 2 is a real block but outside the window: 64 / 32 + 1 = 3 blocks before the cut
    sliding = [null, null, Block(32), Block(33), Block(34), Block(35)]
    blocks = SimpleNamespace(blocks=(full, sliding))
    assert sch._load_groups(blocks, 1, 6) == (   # type: ignore[arg-type]
        [21, 22, 23, 24, 25], [-1, -1, 33, 34, 35])
    sliding[4] = null  # vLLM keeps less than the window: its null block is never written
    assert sch._load_groups(blocks, 1, 6)[1] == [-1, -1, 33, -1, 35]  # type: ignore[arg-type]
    sch.close()


def test_saves_skip_blocks_a_group_holds_as_the_null_block() -> None:
    sch = side(kv())
    toks = list(range(3, 3 + 5 * BT + 5))
    keys = block_keys(toks, BT)
    req = Req(request_id="r", num_computed_tokens=0, block_hashes=keys, num_prompt_tokens=len(toks))
    sch.update_state_after_alloc(req, SimpleNamespace(blocks=()), 0)  # type: ignore[arg-type]
    ids = ([20, 21, 22, 23, 24, 25], [0, 0, 32, 33, 34, 35])  # blocks 0-1 out of the window
    out = SimpleNamespace(num_scheduled_tokens={"r": len(toks)},
                          kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: ids))
    (job,) = sch._saves(out)  # type: ignore[arg-type]
    assert job.keys == keys[2:5] and job.parent == keys[1]
    assert job.groups == ([22, 23, 24], [32, 33, 34]) and job.block_ids == [22, 23, 24]
    assert sch._saves(out) == []  # saved once
    sch.close()


def vllm_config() -> Any:
    mc = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 1,
                         hf_config=SimpleNamespace(to_dict=dict))
    return SimpleNamespace(model_config=mc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256_cbor"))


def test_engine_kv_from_vllms_kv_cache_groups() -> None:
    """vLLM's own spec and config types in; the layers group after group, each group's window,
    vLLM's hash block size; Mamba state without "align" checkpoints refused (the connector
    then does nothing; align mode: tests/test_vllm_state_units.py)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvtier.integrations.vllm.layout import Unsupported, engine_kv

    shape = dict(block_size=BT, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    swa = KVCacheGroupSpec(["l0", "l2"], SlidingWindowSpec(**shape, sliding_window=128))
    full = KVCacheGroupSpec(["l1", "l3"], FullAttentionSpec(**shape))
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[swa, full],
                        hash_block_size=BT)
    k = engine_kv(vllm_config(), cfg, 0, "m@1")
    assert k.layer_names == ("l0", "l2", "l1", "l3") and k.layer_groups == (0, 0, 1, 1)
    assert k.windows == (128, 0) and k.hash_step() == 1 and k.hybrid
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full],
                        hash_block_size=BT)
    assert not engine_kv(vllm_config(), one, 0, "m@1").hybrid  # plain: the old layout
    mamba = KVCacheGroupSpec(["m0"], MambaSpec(block_size=BT, shapes=((4, 64),),
                                               dtypes=(torch.bfloat16,)))
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[mamba, full],
                        hash_block_size=BT)
    with pytest.raises(Unsupported, match="Mamba"):
        engine_kv(vllm_config(), cfg, 0, "m@1")
