"""The connector's recurrent-state pieces (Mamba / linear attention, vLLM's "align" checkpoints)
without an engine: the state shape in the fingerprint, the state block's key, the layout from
vLLM's own spec types (align accepted; mode "none", unequal pages and TP refused), a state
layer's cache viewed as whole pages, the scheduler's loads (a state group loads its one block at
the cut) and saves (a state block per block-aligned boundary vLLM offers, after the chain), the
lookup that cuts a hit at the last boundary with a state, against a real daemon, and a worker
storing and loading a state block. vLLM's scheduler objects are stand-ins carrying only the
fields the code reads."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client, KvtierRpcError
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

from kvtier.integrations.common.link import DaemonLink  # noqa: E402
from kvtier.integrations.common.lookup import Lookups  # noqa: E402
from kvtier.integrations.vllm.layout import EngineKV, Shard, Unsupported  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.pages import state_pages  # noqa: E402
from kvtier.integrations.vllm.scheduler import state_boundaries  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.test_vllm_hybrid_units import Block, Req, side  # noqa: E402  (its scheduler fakes)

BT, PAGE, BLOCKS = 32, 256, 16
STATE = "2x8:bfloat16+4x4:float32"


def kv(**over: Any) -> EngineKV:
    """Layers m0, m1: state groups 0 and 1; layer a: full attention, group 2."""
    base: dict[str, Any] = dict(model_id="m@1", dtype="bfloat16", block_tokens=BT,
                                layer_names=("m0", "m1", "a"), page_bytes=PAGE, kv_heads=1,
                                head_size=64, backend="cpu", shard=Shard(0, 1, True),
                                layer_groups=(0, 1, 2), windows=(0, 0, 0), hash_tokens=BT,
                                states=(STATE, STATE, ""))
    base.update(over)
    return EngineKV(**base)


def test_state_shapes_are_in_the_fingerprint_and_the_state_key_is_its_own() -> None:
    k = kv()
    assert k.stateful and k.hybrid and k.is_state(0) and not k.is_state(2)
    assert f"/groups[state({STATE}),state({STATE}),full]/layer-groups[0,1,2]" in k.describe()
    others = [kv(states=("2x8:bfloat16", "2x8:bfloat16", "")), kv(states=()),
              kv(states=("", STATE, STATE))]
    prints = {o.fingerprint() for o in others}
    assert k.fingerprint() not in prints and len(prints) == len(others)
    assert not kv(states=()).stateful
    key = bytes(range(32))
    assert k.state_key(key) == hashlib.sha256(b"kvtier-state\0" + key).digest()
    assert len(k.state_key(key[:16])) == 16 and k.state_key(key[:16]) != key[:16]
    # the daemon accounts bytes per group (tests/test_daemon_groups.py)
    assert k.decl().groups == (("0:state", PAGE), ("1:state", PAGE), ("2:full", PAGE))
    assert kv(states=(), layer_groups=(), windows=(0,), hash_tokens=0).decl().groups == ()


def vllm_config(tp: int = 1) -> Any:
    mc = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2,
                         hf_config=SimpleNamespace(to_dict=dict))
    return SimpleNamespace(model_config=mc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256_cbor"))


def test_engine_kv_from_vllms_mamba_groups() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvtier.integrations.vllm.layout import engine_kv

    full = KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=BT, num_kv_heads=1,
                                                     head_size=64, dtype=torch.bfloat16))
    page = 2 * BT * 64 * 2  # K and V, 1 head of 64, bf16: 8192 bytes

    def mamba(name: str, mode: str = "align", padded: int = page) -> Any:
        return KVCacheGroupSpec([name], MambaSpec(
            block_size=BT, shapes=((2, 8), (4, 4)), dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=padded, mamba_cache_mode=mode))

    def config(*groups: Any) -> Any:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups),
                             hash_block_size=BT)

    k = engine_kv(vllm_config(), config(mamba("m0"), mamba("m1"), full), 0, "m@1")
    assert k.layer_names == ("m0", "m1", "a") and k.layer_groups == (0, 1, 2)
    assert k.states == (STATE, STATE, "") and k.page_bytes == page and k.kv_heads == 1
    with pytest.raises(Unsupported, match="mamba_cache_mode 'none'"):
        engine_kv(vllm_config(), config(mamba("m0", "none"), full), 0, "m@1")
    with pytest.raises(Unsupported, match="state group's block"):
        engine_kv(vllm_config(), config(mamba("m0", padded=page * 2), full), 0, "m@1")
    with pytest.raises(Unsupported, match="tensor parallelism"):
        engine_kv(vllm_config(tp=2), config(mamba("m0"), full), 0, "m@1")
    with pytest.raises(Unsupported, match="no attention"):
        engine_kv(vllm_config(), config(mamba("m0")), 0, "m@1")


def test_state_pages_view_the_whole_page_over_the_same_memory() -> None:
    """vLLM 0.32 hands a state layer as [B, 1, 1, state bytes] int8 with the shared page's
    block stride (here 100 bytes of state in 256-byte pages)."""
    buf = torch.arange(BLOCKS * PAGE, dtype=torch.int64).remainder(251).to(torch.int8)
    layer = buf.as_strided((BLOCKS, 1, 1, 100), (PAGE, 100, 100, 1))
    pages = state_pages(layer, PAGE)
    assert pages.shape == (BLOCKS, PAGE) and pages.dtype == torch.uint8
    assert pages.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(pages[3, :100], layer[3, 0, 0].view(torch.uint8))
    pages[5].fill_(7)  # writes land in the layer's memory
    assert (layer[5].view(torch.uint8) == 7).all()
    with pytest.raises(Unsupported, match="not one run"):
        state_pages(buf.as_strided((BLOCKS // 2, 1, 1, 100), (2 * PAGE, 100, 100, 1)), PAGE)
    with pytest.raises(Unsupported, match="not one tensor"):
        state_pages([layer, layer], PAGE)


def test_a_load_fills_the_attention_blocks_and_each_state_groups_block_at_the_cut() -> None:
    sch = side(kv())
    null = Block(0, True)
    # a hit of 4 blocks from block 1: vLLM gives each state group one real block, at the cut
    blocks = SimpleNamespace(blocks=([null, null, null, Block(7)], [null, null, null, Block(8)],
                                     [Block(20 + j) for j in range(4)]))
    assert sch._load_groups(blocks, 1, 4) == (  # type: ignore[arg-type]
        [-1, -1, 7], [-1, -1, 8], [21, 22, 23])
    sch.close()


def test_state_boundaries_keep_block_aligned_offers_by_boundary() -> None:
    offers = [(0, 9, 96), (1, 10, 96), (0, 11, 80), (5, 12, 96), (1, 13, 64)]
    assert state_boundaries(offers, BT, 3) == {3: {0: 9, 1: 10}, 2: {1: 13}}


def test_saves_store_the_chain_then_a_state_block_per_offered_boundary() -> None:
    k = kv()
    sch = side(k)
    toks = list(range(3, 3 + 4 * BT + 5))
    keys = block_keys(toks, BT)
    req = Req(request_id="r", num_computed_tokens=0, block_hashes=keys, num_prompt_tokens=len(toks))
    sch.update_state_after_alloc(req, SimpleNamespace(blocks=()), 0)  # type: ignore[arg-type]
    # the step computes the prompt; vLLM checkpoints the states at 3 blocks (96 tokens) in
    # blocks 9 and 10, offers a partial-block boundary (100: dropped) and group 1 at 64 only
    ids = ([0, 0, 9, 0, 0], [0, 0, 10, 0, 0], [20, 21, 22, 23, 24])
    offers = {"r": [(0, 9, 96), (1, 10, 96), (0, 15, 100), (1, 16, 100), (1, 13, 64)]}
    out = SimpleNamespace(num_scheduled_tokens={"r": len(toks)},
                          kv_connector_block_state=SimpleNamespace(
                              get_block_ids=lambda r: ids, boundary_state_offloads=offers))
    chain, state = sch._saves(out)  # type: ignore[arg-type]
    # the chain: every block the attention group holds (the state groups' null blocks are no
    # reason to skip one: their pages in chain blocks are never loaded)
    assert chain.keys == keys[:4] and chain.parent == b""
    assert chain.groups == ([0, 0, 9, 0], [0, 0, 10, 0], [20, 21, 22, 23])
    # the state block of boundary 3: a sibling of chain block 2 (parent: block 1)
    assert state.keys == [k.state_key(keys[2])] and state.parent == keys[1]
    assert state.groups == ([9], [10], [22]) and state.block_ids == [9]
    out.kv_connector_block_state.boundary_state_offloads = {}
    assert sch._saves(out) == []  # saved once
    sch.close()


def test_no_state_block_for_a_boundary_beyond_the_step() -> None:
    sch = side(kv())
    toks = list(range(3, 3 + 4 * BT + 5))
    keys = block_keys(toks, BT)
    req = Req(request_id="r", num_computed_tokens=0, block_hashes=keys, num_prompt_tokens=len(toks))
    sch.update_state_after_alloc(req, SimpleNamespace(blocks=()), 0)  # type: ignore[arg-type]
    ids = ([0, 9], [0, 10], [20, 21])
    out = SimpleNamespace(num_scheduled_tokens={"r": BT},  # the step computes block 0 only
                          kv_connector_block_state=SimpleNamespace(
                              get_block_ids=lambda r: ids,
                              boundary_state_offloads={"r": [(0, 9, 64), (1, 10, 64)]}))
    (chain,) = sch._saves(out)  # type: ignore[arg-type]
    assert chain.keys == keys[:1]
    sch.close()


def settings(d: DaemonProc) -> ConnectorSettings:
    return ConnectorSettings.from_extra({"socket": str(d.socket), "async_save": False,
                                         "async_lookup": False})


def test_a_hit_ends_on_the_last_boundary_whose_state_is_held(
        daemon: DaemonProc) -> None:  # noqa: F811
    k = kv()
    keys = block_keys(list(range(3, 3 + 6 * BT)), BT)
    ends = [k.state_key(x) for x in keys]
    block = np.zeros(k.block_bytes, np.uint8)
    link = DaemonLink(settings(daemon), k.decl(), "test")
    look = Lookups([link], False, False)
    with Client(daemon.socket, layout=k.decl()) as c:
        c.store(keys[:4], [block] * 4)  # chain blocks 0..3
        assert look.lookup(keys, 0, ends) == 0  # no state anywhere: no hit
        c.store([ends[1]], [block], parent=keys[0])  # the state after block 1
        assert look.lookup(keys, 0, ends) == 2
        c.store([ends[4]], [block], parent=keys[3])  # after block 4, whose chain block is gone
        assert look.lookup(keys, 0, ends) == 5  # one past the chain's hit
        with pytest.raises(KvtierRpcError):  # a state block whose parent is not held
            c.store([ends[5]], [block], parent=keys[4])
        assert look.lookup(keys[:2], 0, ends[:2]) == 2
    assert look.lookup(keys, 0) == 4  # without ends: the chain's hit
    look.close()
    link.close()


def test_worker_stores_and_loads_a_state_block(daemon: DaemonProc) -> None:  # noqa: F811
    k = kv()
    rng = torch.Generator().manual_seed(3)
    caches = {n: torch.randint(0, 256, (BLOCKS, PAGE), generator=rng, dtype=torch.uint8)
              for n in k.layer_names}
    w1 = WorkerSide(settings(daemon), k, 0)
    w1.register_kv_caches({n: (c.view(torch.int8).as_strided((BLOCKS, 1, 1, 100),
                                                              (PAGE, 100, 100, 1))
                               if n != "a" else c) for n, c in caches.items()})
    keys = block_keys(list(range(3, 3 + 2 * BT)), BT)
    skey = k.state_key(keys[1])
    # the state block of boundary 2: state layers' blocks 4 and 5, the attention block 12
    w1.wait_for_save(KvtierMetadata(saves=[
        SaveJob("r", [0, 0], keys, b"", ([0, 0], [0, 0], [11, 12])),
        SaveJob("r", [4], [skey], keys[0], ([4], [5], [12]))]))
    with Client(daemon.socket, layout=k.decl()) as c, c.load([keys[0], skey]) as got:
        assert got.blocks == 2
        view = got.views[1]
        assert (view[:PAGE] == caches["m0"][4].numpy()).all()  # the whole page, padding too
        assert (view[PAGE:2 * PAGE] == caches["m1"][5].numpy()).all()
        assert (view[2 * PAGE:] == caches["a"][12].numpy()).all()
    w1.close()
    dst = {n: torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for n in k.layer_names}
    w2 = WorkerSide(settings(daemon), k, 0)
    w2.register_kv_caches({n: (c.view(torch.int8).as_strided((BLOCKS, 1, 1, 100),
                                                              (PAGE, 100, 100, 1))
                               if n != "a" else c) for n, c in dst.items()})
    w2.start_load_kv(KvtierMetadata(loads=[
        LoadJob("q", [-1, 7], [keys[0], skey], 0, ([-1, 7], [-1, 8], [2, 3]))]))
    assert w2.transfer_results() == ({"q"}, set())
    assert torch.equal(dst["m0"][7], caches["m0"][4]) and torch.equal(dst["m1"][8], caches["m1"][5])
    assert torch.equal(dst["a"][2], caches["a"][11]) and torch.equal(dst["a"][3], caches["a"][12])
    assert int(dst["m0"].sum()) == int(caches["m0"][4].sum())  # nothing else written
    assert w2.stats.take()["loaded_bytes"] == 4 * PAGE
    w2.close()
