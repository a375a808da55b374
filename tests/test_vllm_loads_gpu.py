"""The connector's worker loads on a real GPU (`pytest -m gpu`; skipped without CUDA + CuPy +
vLLM): per-layer CUDA KV views built by vLLM's own `create_kv_cache_views` in the layouts its
CUDA backends register (LBHNC: flash_attn, triton, flashinfer with the layout the connector asks
for; BLHNC: flashinfer's trtllm-gen on Blackwell; LHBNC: head groups outside the block), loaded
from a real daemon's shared-memory slots through the TransferEngine's CUDA backend, layer by
layer. Checks the bytes of every layer and that layer 0 is usable while later layers are still
copying. Not run on the CPU-only dev machine (see docs/benchmarks.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from kvtier.gpu import available
from tests.daemon_fixture import DaemonProc

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (available() and torch.cuda.is_available()), reason="needs CUDA, CuPy and torch CUDA")]

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

# Llama-3-8B at TP1: 32 layers, 8 KV heads of 128, bf16, 16-token blocks -> 64 KiB pages
BT, HEADS, HEAD, LAYERS, BLOCKS, LOADED = 16, 8, 128, 32, 96, 64
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
SPEC = FullAttentionSpec(block_size=BT, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
PAGE = int(SPEC.page_size_bytes)
KV = EngineKV("test/gpu-loads@1", "bfloat16", BT, NAMES, PAGE, HEADS, HEAD, "cuda",
              Shard(0, 1, True))


@pytest.fixture
def big_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", f"{(LOADED + 8) * 2}MiB",
                                    "--slot-bytes", f"{PAGE * LAYERS // 1024}KiB",
                                    "--ssd-bytes", "0"]).start()
    try:
        yield d
    finally:
        d.stop()


def cuda_views(layout: KVCacheLayout, seed: int) -> list[Any]:
    ls, bs, *_ = compute_layout_strides(SPEC, BLOCKS, LAYERS, layout)
    tensor = KVCacheTensor(size=BLOCKS * LAYERS * PAGE, layers=list(NAMES), layer_stride=ls,
                           block_stride=bs)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (tensor.size,), generator=g, dtype=torch.int8).cuda()
    return list(create_kv_cache_views(raw, SPEC, BLOCKS, layout, tensor))


def page(view: Any, block: int) -> Any:
    return view[block].contiguous().view(torch.uint8).flatten().cpu()


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC,
                                    KVCacheLayout.LHBNC], ids=lambda x: x.name)
def test_cuda_worker_loads_layer_by_layer(big_daemon: DaemonProc, layout: KVCacheLayout) -> None:
    settings = ConnectorSettings(socket=str(big_daemon.socket), use_plan=False,
                                 async_save=False, transfer="engine")
    keys = block_keys(list(range(3, 3 + LOADED * BT + 1)), BT)
    src = cuda_views(KVCacheLayout.LBHNC, 1)
    w1 = WorkerSide(settings, KV, 0)
    w1.register_kv_caches(dict(zip(NAMES, src, strict=True)))
    stored = list(range(LOADED))
    w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", stored, keys, b"")]))  # D2H staging
    assert w1.stats.take()["stored_blocks"] == LOADED
    w1.close()

    dst = cuda_views(layout, 2)
    w2 = WorkerSide(settings, KV, 0)
    w2.register_kv_caches(dict(zip(NAMES, dst, strict=True)))
    assert w2.layerwise
    targets = list(range(BLOCKS - 1, BLOCKS - 1 - LOADED, -1))  # reversed: no run merges
    for _ in range(2):  # the first load maps and registers the pool, builds the engine
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w2.start_load_kv(KvtierMetadata(loads=[LoadJob("q", targets, keys, 0)]))
        issued = time.perf_counter()
        w2.wait_for_layer_load(NAMES[0])
        first = time.perf_counter()
        for name in NAMES:
            w2.wait_for_layer_load(name)
        last = time.perf_counter()
        assert w2.take_load_errors() == set()
    print(f"{layout.name}: issue {1e3 * (issued - t0):.2f} ms, layer 0 after "
          f"{1e3 * (first - t0):.2f} ms, all {LAYERS} layers after {1e3 * (last - t0):.2f} ms")
    # layers are copied in order on one stream: layer 0 is ready well before the last one
    assert first - t0 < 0.5 * (last - t0)
    for i in (0, 1, LAYERS // 2, LAYERS - 1):
        for s, d in zip(stored[::7], targets[::7], strict=True):
            assert torch.equal(page(dst[i], d), page(src[i], s)), (i, s, d)
    with Client(big_daemon.socket, layout=KV.decl()) as c:
        assert c.stats().active_leases == 0
    w2.close()
