"""`KvtierStorage` itself, SGLang's class for real (runs in the SGLang venv: the engine tests
run this file there, `test_sglang_engine.py::test_backend_class_in_the_sglang_venv`; the main
venv skips it): built from a real `HiCacheStorageConfig` and loaded by SGLang's own
`StorageBackendFactory`, over a layer_first host pool's page API and a real daemon. The v1
path, the generic path and their equal bytes; None never returned; the daemon down; the
default model id following the weights SGLang was launched with, and `model_id` pinning it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)
from tests.test_sglang_units import PAGE, LayerFirstPool, fill, sglang_keys

BACKEND = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.backend",
           "class_name": "KvtierStorage", "interface_v1": 1}


def backend(socket: Path, pool: LayerFirstPool, **extra: Any) -> Any:
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=False,
        model_name="test/sglang-backend",
        extra_config={**BACKEND, "socket": str(socket), "use_plan": False,
                      "verify_sample": 0.0, **extra})
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)  # as SGLang's cache controller does
    return b


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def test_v1_and_generic_paths_store_the_same_pages(daemon: DaemonProc) -> None:  # noqa: F811
    pool_a, pool_b = LayerFirstPool(), LayerFirstPool()
    fill(pool_a, 7)
    a, b = backend(daemon.socket, pool_a), backend(daemon.socket, pool_b)
    keys = sglang_keys(4, salt="v1")
    first = HiCacheStorageExtraInfo(prefix_keys=[])
    assert a.batch_exists(keys, first) == 0
    assert a.batch_set_v1(keys[:2], slots(0, 2), first) == [True, True]
    assert a.batch_set_v1(keys[2:], slots(2, 2), HiCacheStorageExtraInfo(prefix_keys=keys[:2])) \
        == [True, True]
    assert b.batch_exists(keys, first) == 4
    # into pages 4..7 of another pool
    assert b.batch_get_v1(keys, slots(4, 4), first) == [True] * 4
    for i in range(4):
        assert torch.equal(pool_b.get_data_page((4 + i) * PAGE), pool_a.get_data_page(i * PAGE))
    # the generic path reads the same bytes (the chain known from the calls above)
    flat = b.get(keys[3], pool_b.get_dummy_flat_data_page())
    assert flat is not None and torch.equal(flat, pool_a.get_data_page(3 * PAGE))
    assert b.exists(keys[3]) and not b.exists(sglang_keys(1, salt="none")[0])
    got = b.batch_get(keys[:2], [pool_b.get_dummy_flat_data_page() for _ in range(2)])
    assert all(g is not None and torch.equal(g, pool_a.get_data_page(i * PAGE))
               for i, g in enumerate(got))
    # generic stores: a chain started by `set`, continued by `batch_set`
    more = sglang_keys(3, salt="generic")
    assert not a.set(more[0], pool_a.get_data_page(5 * PAGE))  # chain unknown: refused
    assert a.batch_exists(more, first) == 0  # SGLang asks first: now the chain is known
    assert a.set(more[0], pool_a.get_data_page(5 * PAGE))
    assert a.batch_set(more[1:], [pool_a.get_data_page(6 * PAGE), pool_a.get_data_page(7 * PAGE)])
    assert b.batch_exists(more, first) == 3
    assert b.batch_get_v1(more[1:], slots(0, 2), HiCacheStorageExtraInfo(prefix_keys=more[:1])) \
        == [True, True]
    assert torch.equal(pool_b.get_data_page(PAGE), pool_a.get_data_page(7 * PAGE))
    stats = b.get_stats()
    assert stats.prefetch_pgs == [4, 1, 2, 2] and len(stats.prefetch_bandwidth) == 4
    with pytest.raises(ValueError, match="host_indices"):
        a.batch_get_v1(keys, slots(0, 3), first)
    a.close()
    b.close()


def test_daemon_down_gives_lists_not_none(tmp_path: Path) -> None:
    pool = LayerFirstPool()
    b = backend(tmp_path / "nobody.sock", pool)
    keys = sglang_keys(2, salt="down")
    first = HiCacheStorageExtraInfo(prefix_keys=[])
    assert b.batch_exists(keys, first) == 0
    assert b.batch_get_v1(keys, slots(0, 2), first) == [False, False]
    assert b.batch_set_v1(keys, slots(0, 2), first) == [False, False]
    assert b.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert b.batch_exists(keys, first) == 0  # the chain is known, the daemon is not
    assert not b.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(PAGE)])
    assert b.batch_get(keys) == [None, None]
    b.close()


def test_model_id_follows_the_published_weights_unless_pinned(
        daemon: DaemonProc, tmp_path: Path) -> None:  # noqa: F811
    """Inside a server, SGLang has published its launch arguments: the default id follows the
    weights at `model_path`, so a server on weights rewritten in place misses the old pages;
    `model_id` in the extra config pins the id."""
    from sglang.srt.runtime_context import get_context

    from tests.test_sglang_units import write_weights

    m = write_weights(tmp_path / "tiny", 0)
    keys = sglang_keys(2, salt="ident")
    first = HiCacheStorageExtraInfo(prefix_keys=[])
    pool = LayerFirstPool()
    fill(pool, 5)
    with get_context().override_server_args(model_path=str(m), dtype="bfloat16"):
        a = backend(daemon.socket, pool)
        assert a.model_id.startswith("tiny@w:") and a.model_id.endswith("/bfloat16")
        assert a.batch_set_v1(keys, slots(0, 2), first) == [True, True]
        pinned = backend(daemon.socket, LayerFirstPool(), model_id="team/tiny@v1")
        assert pinned.model_id == "team/tiny@v1" and pinned.batch_exists(keys, first) == 0
        write_weights(m, 1)  # same names and sizes, other values
        b = backend(daemon.socket, LayerFirstPool())
        assert b.model_id.startswith("tiny@w:") and b.model_id != a.model_id
        assert b.batch_exists(keys, first) == 0
        write_weights(m, 0)
        c = backend(daemon.socket, LayerFirstPool())
        assert c.model_id == a.model_id and c.batch_exists(keys, first) == 2
    for s in (a, pinned, b, c):
        s.close()
