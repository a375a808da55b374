"""The SGLang backend's SGLang-free parts, in the main venv (no SGLang): settings, key chains,
host-pool page views (a layer_first pool built like SGLang's, real torch tensors), and
`PageStore` against a real daemon: exists with the planner's cut, loads from mapped DRAM slots,
stores through Allocate/Commit, prefixes, and a daemon that is down or killed."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.client.decl import LayoutDecl
from kvtier.client.sync_client import Client
from kvtier.integrations.common.extra import SettingsError
from kvtier.integrations.sglang.chains import ChainMemory, page_key, page_keys
from kvtier.integrations.sglang.layout import declare, default_model_id, model_cost, shard
from kvtier.integrations.sglang.pool import HostPages, fingerprint, geometry, page_regions
from kvtier.integrations.sglang.settings import StorageSettings
from kvtier.integrations.sglang.store import PageStore
from tests.daemon_fixture import DaemonProc, daemon, wait_for  # noqa: F401  (the fixture)

PAGE = 16


class LayerFirstPool:
    """The page API of SGLang's MHATokenToKVPoolHost with layout "layer_first": one tensor
    [2, layers, slots, heads, head_dim], a page = PAGE consecutive slots of every layer."""

    layout = "layer_first"
    storage_format_tag = None
    start_layer, end_layer = 0, 2

    def __init__(self, slots: int = 8 * PAGE, layers: int = 2, heads: int = 2, dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size = PAGE
        self.dtype = dtype
        self.kv_buffer = torch.zeros((2, layers, slots, heads, dim), dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.kv_buffer[:, :, :PAGE]).flatten()


class Config:
    """The fields of SGLang's HiCacheStorageConfig the layout reads."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, mla: bool = False) -> None:
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, 0, 1
        self.attn_cp_rank, self.attn_cp_size, self.dcp_rank, self.dcp_size = 0, 1, 0, 1
        self.is_mla_model = mla


def sglang_keys(n: int, salt: str = "") -> list[str]:
    """Chained hex page keys like SGLang's get_hash_str."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{salt}page{i}".encode()).digest()
        out.append(prev.hex())
    return out


# -- settings --------------------------------------------------------------------------------

def test_settings_defaults_and_sglang_keys_ignored() -> None:
    s = StorageSettings.from_extra({"backend_name": "kvtier", "module_path": "m",
                                    "class_name": "C", "interface_v1": 1})
    assert s == StorageSettings()
    s = StorageSettings.from_extra({"timeout_s": "2.5", "use_plan": "false", "chain_memory": 7})
    assert (s.timeout_s, s.use_plan, s.chain_memory) == (2.5, False, 7)


@pytest.mark.parametrize("extra, fragment", [
    ({"sokcet": "/x"}, "unknown"), ({"timeout_s": "soon"}, "timeout_s"),
    ({"timeout_s": 0}, "timeout_s must be > 0"), ({"use_plan": 3}, "use_plan"),
    ({"chain_memory": 1.5}, "chain_memory"), ({"retry_after_s": -1}, "retry_after_s"),
])
def test_settings_refuse_bad_values(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        StorageSettings.from_extra(extra)


# -- keys and chains -------------------------------------------------------------------------

def test_page_keys_are_sglang_digests_else_hashed() -> None:
    k = sglang_keys(1)[0]
    assert page_key(k) == bytes.fromhex(k)
    other = page_key("not-hex.mamba")
    assert len(other) == 32 and other != page_key("not-hex.swa")
    assert page_key("zz" * 32) != page_key("zy" * 32)  # 64 chars, not hex: hashed


def test_chain_memory_walks_back_to_the_first_page_and_forgets_oldest() -> None:
    keys = page_keys(sglang_keys(5))
    m = ChainMemory(capacity=10)
    m.remember(keys[:2])
    m.remember(keys[2:5], parent=keys[1])
    assert m.prefix(keys[4]) == keys[:4] and m.prefix(keys[0]) == []
    assert m.parent(keys[0]) == b"" and m.prefix(b"x" * 32) is None
    small = ChainMemory(capacity=3)
    small.remember(keys[:2])
    small.remember(keys[2:4], parent=keys[1])  # keys[0] forgotten: the chain is broken
    assert small.prefix(keys[3]) is None and small.parent(keys[2]) == keys[1]
    links = ChainMemory(capacity=10)
    links.remember(keys[1:3], parent=None)  # keys[1]'s parent unknown: only the inner link
    assert links.parent(keys[2]) == keys[1] and links.parent(keys[1]) is None
    assert links.prefix(keys[2]) is None
    assert len(ChainMemory(0)) == 0


# -- host pool pages -------------------------------------------------------------------------

def test_page_views_alias_the_pool_in_flat_page_order() -> None:
    pool = LayerFirstPool()
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.dtype))
    pages = HostPages(pool)
    g = pages.geometry
    assert g.block_bytes == 2 * 2 * PAGE * 2 * 8 * 2 and g.layout == "layer_first"
    out = np.empty(g.block_bytes, dtype=np.uint8)
    pages.copy_out(2 * PAGE, out)
    assert out.tobytes() == pool.get_data_page(2 * PAGE).view(torch.uint8).numpy().tobytes()
    pages.copy_in(5 * PAGE, out)  # the same bytes into another page
    assert torch.equal(pool.get_data_page(5 * PAGE), pool.get_data_page(2 * PAGE))
    assert pages.firsts(torch.arange(3 * PAGE, 5 * PAGE), 2) == [3 * PAGE, 4 * PAGE]
    with pytest.raises(ValueError, match="host_indices has 17 slots for 1 pages"):
        pages.firsts(torch.arange(17), 1)


def test_fingerprint_separates_geometry_and_shards_but_not_mla_ranks() -> None:
    g = geometry(LayerFirstPool())
    pool = LayerFirstPool()
    fps = {fingerprint(g, shard(Config(r, 2), pool)) for r in range(2)}
    assert len(fps) == 2  # MHA: each TP rank its own heads
    mla = {fingerprint(g, shard(Config(r, 2, mla=True), pool)) for r in range(2)}
    assert len(mla) == 1  # MLA: one copy for every rank
    assert fingerprint(geometry(LayerFirstPool(dtype=torch.float16)), shard(Config(), pool)) \
        != fingerprint(g, shard(Config(), pool))
    assert fingerprint(g._replace(layout="page_first"), shard(Config(), pool)) \
        != fingerprint(g, shard(Config(), pool))


def test_model_cost_from_a_local_config(tmp_path: Path) -> None:
    assert model_cost(None) is None and model_cost(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512, '
        '"vocab_size": 1024}')
    cost = model_cost(str(tmp_path))
    assert cost is not None and cost.num_layers == 2 and cost.active_params > 0


# -- model identity: the default id follows the weights ---------------------------------------

def write_weights(path: Path, seed: int) -> Path:
    """A local checkpoint: config.json and one safetensors file of three fp16 tensors drawn from
    `seed` (the same names, shapes and file size for every seed)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({f"layers.{i}.w": (rng.standard_normal((64, 32)) * 0.02).astype(np.float16)
               for i in range(3)}, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    return path


def args(model: Path | str, **over: Any) -> dict[str, Any]:
    """The fields of SGLang's resolved server args the default id reads."""
    return {"model_path": str(model), "revision": None, "load_format": "auto",
            "random_seed": 0, "dtype": "bfloat16", "quantization": None, **over}


def test_default_model_id_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    m = write_weights(tmp_path / "a" / "tiny", 0)
    first = default_model_id(args(m), "ignored")
    assert first.startswith("tiny@w:") and first.endswith("/bfloat16")
    assert default_model_id(args(m), "ignored") == first  # the same weights: the same id
    copy = tmp_path / "b" / "tiny"
    copy.mkdir(parents=True)
    for f in m.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    assert default_model_id(args(copy), None) == first  # the same files elsewhere: same KV
    size = (m / "model.safetensors").stat().st_size
    write_weights(m, 1)  # rewritten in place: same names, sizes and header, other values
    assert (m / "model.safetensors").stat().st_size == size
    rewritten = default_model_id(args(m), "ignored")
    assert rewritten.startswith("tiny@w:") and rewritten != first
    write_weights(m, 0)
    assert default_model_id(args(m), "ignored") == first


def test_default_model_id_names_dtype_quantization_and_dummy_weights(tmp_path: Path) -> None:
    m = write_weights(tmp_path / "tiny", 0)
    first = default_model_id(args(m), None)
    digest = first.removesuffix("/bfloat16")
    assert default_model_id(args(m, quantization="fp8"), None) == digest + "/bfloat16/q:fp8"
    assert default_model_id(args(m, dtype="float16"), None) == digest + "/float16"
    assert default_model_id(args(m, load_format="dummy", random_seed=3), None) \
        == f"{m}@dummy-seed3/bfloat16"
    # not published in this process (a backend built by hand): the storage config's model path
    assert default_model_id(None, str(m)) == digest
    with pytest.raises(ValueError, match="set model_id in hicache_storage_backend_extra_config"):
        default_model_id(None, None)


# -- PageStore against a real daemon ---------------------------------------------------------

def make_store(socket: Path, model_id: str = "test/sglang-units",
               clock: Callable[[], float] = time.monotonic, **extra: Any
               ) -> tuple[PageStore, HostPages, LayerFirstPool]:
    pool = LayerFirstPool()
    pages = HostPages(pool)
    settings = StorageSettings.from_extra({"socket": str(socket), "retry_after_s": 0.2,
                                           "verify_sample": 0.0, **extra})
    decl = declare(pages.geometry, Config(), pool, model_id, None)
    return PageStore(settings, decl, page_regions(pages.geometry), clock), pages, pool


def fill(pool: LayerFirstPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def test_store_saves_then_loads_pages_through_dram_slots(daemon: DaemonProc) -> None:  # noqa: F811
    a, pa, pool_a = make_store(daemon.socket)
    b, pb_, pool_b = make_store(daemon.socket)
    fill(pool_a, 1)
    keys = page_keys(sglang_keys(4))
    assert a.exists(keys, []) == 0
    assert a.save(keys[:2], [], lambda i, v: pa.copy_out(i * PAGE, v))
    assert a.save(keys[2:], keys[:2], lambda i, v: pa.copy_out(i * PAGE + 2 * PAGE, v))
    assert a.stats.stored_pages == 4
    assert a.save(keys[:2], [], lambda i, v: pytest.fail("already cached: not copied"))
    assert a.stats.skipped_pages == 2
    assert b.exists(keys, []) == 4
    assert b.exists(keys[2:], keys[:2]) == 2  # counted after the prefix
    assert b.exists(keys[3:], None) == 1  # b remembers the chain from the calls above
    c = make_store(daemon.socket)[0]
    assert c.exists(keys[2:], None) == 0  # c never saw keys[:2]: no chain, a clean miss
    c.close()
    # into other host pages of another pool
    n = b.load(keys[1:], keys[:1], lambda i, v: pb_.copy_in(4 * PAGE + i * PAGE, v))
    assert n == 3
    for i in range(3):
        assert torch.equal(pool_b.get_data_page(4 * PAGE + i * PAGE),
                           pool_a.get_data_page((1 + i) * PAGE))
    load_pages, load_gbps, save_pages, _ = b.drain()
    assert load_pages == [3] and load_gbps[0] > 0 and save_pages == []
    assert b.drain() == ([], [], [], [])
    a.close()
    b.close()


def test_weights_rewritten_in_place_miss_the_old_pages(daemon: DaemonProc,  # noqa: F811
                                                       tmp_path: Path) -> None:
    """A server restarted on weights rewritten under the same path must not load the KV the old
    weights computed: its default id differs, so kvtier has none of its pages; the old weights
    back, the pages are hits again."""
    m = write_weights(tmp_path / "tiny", 0)
    a, pa, pool = make_store(daemon.socket, default_model_id(args(m), None))
    fill(pool, 3)
    keys = page_keys(sglang_keys(3, salt="weights"))
    assert a.save(keys, [], lambda i, v: pa.copy_out(i * PAGE, v))
    write_weights(m, 1)
    b = make_store(daemon.socket, default_model_id(args(m), None))[0]
    assert b.exists(keys, []) == 0
    assert b.load(keys, [], lambda i, v: pytest.fail("no page of the old weights")) == 0
    write_weights(m, 0)
    c = make_store(daemon.socket, default_model_id(args(m), None))[0]
    assert c.exists(keys, []) == 3
    for s in (a, b, c):
        s.close()


def test_store_chain_memory_serves_calls_without_prefix(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    s, pages, pool = make_store(daemon.socket)
    fill(pool, 2)
    keys = page_keys(sglang_keys(3, salt="m"))
    with caplog.at_level(logging.WARNING, "kvtier.integrations.sglang"):
        # an unknown chain is never stored (it could be a mid-prompt batch)
        assert not s.save(keys[1:], None, lambda i, v: pytest.fail("not stored"))
        assert not s.save(keys[2:], None, lambda i, v: pytest.fail("not stored"))
    assert caplog.text.count("refused to store") == 1 and s.stats.unanchored == 2
    assert s.exists(keys, []) == 0  # as SGLang asks before it computes: the chain is learnt
    assert s.save(keys[:1], None, lambda i, v: pages.copy_out(0, v))
    assert s.save(keys[1:], None, lambda i, v: pages.copy_out((1 + i) * PAGE, v))
    assert s.exists(keys[2:], None) == 1
    out = []
    assert s.load(keys[2:], None, lambda i, v: out.append(v.copy())) == 1
    assert out[0].tobytes() == pool.get_data_page(2 * PAGE).view(torch.uint8).numpy().tobytes()
    s.close()


def test_store_refuses_a_chain_whose_parent_is_not_cached(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    s, pages, _ = make_store(daemon.socket)
    keys = page_keys(sglang_keys(2, salt="orphan"))
    with caplog.at_level(logging.WARNING, "kvtier.integrations"):
        assert not s.save(keys[1:], keys[:1], lambda i, v: pages.copy_out(0, v))
    assert s.exists(keys, []) == 0 and s.stats.failures == 1
    assert "store failed" in caplog.text
    s.close()


def test_store_with_the_daemon_down_misses_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = make_store(tmp_path / "nobody.sock", retry_after_s=30)[0]
    keys = page_keys(sglang_keys(2))
    with caplog.at_level(logging.WARNING, "kvtier.integrations"):
        for _ in range(3):
            assert s.exists(keys, []) == 0
            assert s.load(keys, [], lambda i, v: pytest.fail("nothing to load")) == 0
            assert not s.save(keys, [], lambda i, v: pytest.fail("nothing to store"))
    assert caplog.text.count("daemon unavailable") == 1
    s.close()


def test_store_survives_the_daemon_killed_and_restarted(tmp_path: Path) -> None:
    """The daemon killed: misses, no exception, and the store does not call it within
    `retry_after_s` (30 s here, on its clock, stepped by the test: no real wait) while it stays
    down; a new daemon on the socket (a new socket file, looked at every `PROBE_S`) ends the
    outage at once: the store reconnects within the window."""
    from kvtier.integrations.common.link import PROBE_S

    now = [0.0]
    d = DaemonProc(tmp_path / "d").start()
    s, pages, pool = make_store(d.socket, clock=lambda: now[0], retry_after_s=30)
    fill(pool, 3)
    keys = page_keys(sglang_keys(2, salt="k"))
    try:
        assert s.save(keys, [], lambda i, v: pages.copy_out(i * PAGE, v))
        d.kill()
        assert s.exists(keys, []) == 0  # a miss, not an exception
        assert not s.save(keys, [], lambda i, v: pages.copy_out(i * PAGE, v))
        now[0] = 10.0  # within the outage, the daemon still down: not asked
        assert s.link.down() and s.exists(keys, []) == 0
        assert not s.save(keys, [], lambda i, v: pytest.fail("saved within the outage"))
        d.start()
        now[0] = 10.0 + PROBE_S  # a new daemon took the socket: the outage ends at once
        assert not s.link.down()
        assert s.save(keys, [], lambda i, v: pages.copy_out(i * PAGE, v))
        assert s.exists(keys, []) == 2  # stored again after the restart (DRAM was lost)
    finally:
        s.close()
        d.stop()


def test_planner_cut_bounds_exists(daemon: DaemonProc) -> None:  # noqa: F811
    """With a model cost the answer is the plan's fetch cut, never more than the hit."""
    pool = LayerFirstPool()
    pages = HostPages(pool)
    from kvtier.client.decl import ModelCost
    decl = declare(pages.geometry, Config(), pool, "test/sglang-plan",
                   ModelCost(active_params=1e6, num_layers=2, attn_dim=32))
    assert isinstance(decl, LayoutDecl)
    s = PageStore(StorageSettings(socket=str(daemon.socket)), decl)
    keys = page_keys(sglang_keys(3, salt="p"))
    assert s.save(keys, [], lambda i, v: pages.copy_out(i * PAGE, v))
    found = s.link.client().lookup(keys, prompt_tokens=3 * PAGE, plan=True)  # type: ignore[union-attr]
    assert s.exists(keys, []) == min(found.hit_blocks, found.fetch_blocks)
    s.close()


if os.environ.get("KVTIER_SGLANG_UNITS_DEBUG"):
    logging.basicConfig(level=logging.DEBUG)


def test_verification_compares_sampled_hits_when_sglang_backs_them_up(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """A sampled hit is answered 0; when SGLang backs the computed pages up, they are compared
    with the stored ones: equal pages match, a page of other values is quarantined (with the
    pages after it) and replaced by the computed one."""
    a, pa, pool_a = make_store(daemon.socket)
    fill(pool_a, 1)
    keys = page_keys(sglang_keys(4, "verify"))
    assert a.save(keys, [], lambda i, v: pa.copy_out(i * PAGE, v))
    b, pb_, pool_b = make_store(daemon.socket, verify_sample=1.0)
    assert b.exists(keys, []) == 0 and b.stats.verify_sampled == 1
    pool_b.kv_buffer.copy_(pool_a.kv_buffer)
    other = LayerFirstPool()
    fill(other, 2)
    pool_b.kv_buffer[:, :, 2 * PAGE:3 * PAGE] = other.kv_buffer[:, :, 2 * PAGE:3 * PAGE]
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.sglang"):
        assert b.save(keys, [], lambda i, v: pb_.copy_out(i * PAGE, v))
    assert (b.stats.verified_pages, b.stats.mismatched_pages) == (3, 1)
    assert "kvtier verify: MISMATCH" in caplog.text and "page 2: layer 0 (full, bfloat16)" \
        in caplog.text
    # pages 2 and 3 leave (at once, or once the SSD write-back the lookups queued unpins them)
    with Client(daemon.socket, layout=b.decl) as kv:
        wait_for(lambda: kv.stats().verify_quarantined_blocks == 2)
    if b.stats.stored_pages == 0:  # quarantined after the save: stored at the next one
        assert b.save(keys, [], lambda i, v: pb_.copy_out(i * PAGE, v))
    assert b.stats.stored_pages == 2
    c, pc, pool_c = make_store(daemon.socket)
    assert c.load(keys, [], lambda i, v: pc.copy_in(i * PAGE, v)) == 4
    assert torch.equal(pool_c.kv_buffer[:, :, :4 * PAGE], pool_b.kv_buffer[:, :, :4 * PAGE])
    # a page not sampled is stored as before, nothing compared
    assert b.save(keys, [], lambda i, v: pytest.fail("already cached: not copied"))
    assert b.stats.verified_pages == 3
    for s in (a, b, c):
        s.close()
