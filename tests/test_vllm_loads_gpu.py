"""The connector's worker loads and saves on a real GPU (`pytest -m gpu`; skipped without CUDA,
CuPy and torch CUDA): per-layer CUDA KV views in the layouts vLLM's CUDA backends register
(LBHNC: flash_attn, triton, flashinfer with the layout the connector asks for; BLHNC:
flashinfer's trtllm-gen on Blackwell; LHBNC: head groups outside the block), built as vLLM's
`create_kv_cache_views` builds them (`bench.vllm_views`, checked against vLLM in
tests/test_vllm_views.py: the GPU machine has no vLLM), saved through pinned staging into a real
daemon and loaded back from its shared-memory slots through the TransferEngine's CUDA backend,
layer by layer. Checks the bytes of every layer and that layer 0 is usable while later layers
are still copying."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.vllm_views import connector_base, kv_views
from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from kvtier.gpu import available
from tests.daemon_fixture import DaemonProc

torch = pytest.importorskip("torch")
connector_base()  # vLLM's, or the stand-in where vLLM is not installed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (available() and torch.cuda.is_available()), reason="needs CUDA, CuPy and torch CUDA")]

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

# Llama-3-8B at TP1: 32 layers, 8 KV heads of 128, bf16, 16-token blocks -> 64 KiB pages
BT, HEADS, HEAD, LAYERS, BLOCKS, LOADED = 16, 8, 128, 32, 96, 64
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
PAGE = 2 * BT * HEADS * HEAD * 2
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


def cuda_views(layout: str, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (BLOCKS * LAYERS * PAGE,), generator=g, dtype=torch.int8)
    return kv_views(raw.cuda(), LAYERS, BLOCKS, HEADS, BT, HEAD, torch.bfloat16, layout)


def page(view: Any, block: int) -> Any:
    return view[block].contiguous().view(torch.uint8).flatten().cpu()


CUDA_LAYOUTS = ["LBHNC", "BLHNC", "LHBNC"]


@pytest.mark.parametrize("saved", CUDA_LAYOUTS)
def test_cuda_worker_loads_layer_by_layer(big_daemon: DaemonProc, saved: str) -> None:
    """Saved from `saved`'s views, loaded into the next layout's (each layout saves and loads)."""
    layout = CUDA_LAYOUTS[(CUDA_LAYOUTS.index(saved) + 1) % len(CUDA_LAYOUTS)]
    settings = ConnectorSettings(socket=str(big_daemon.socket), use_plan=False,
                                 async_save=False, transfer="engine")
    keys = block_keys(list(range(3, 3 + LOADED * BT + 1)), BT)
    src = cuda_views(saved, 1)
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
    print(f"{saved} -> {layout}: issue {1e3 * (issued - t0):.2f} ms, layer 0 after "
          f"{1e3 * (first - t0):.2f} ms, all {LAYERS} layers after {1e3 * (last - t0):.2f} ms")
    # layers are copied in order on one stream: layer 0 is ready well before the last one
    assert first - t0 < 0.5 * (last - t0)
    for i in (0, 1, LAYERS // 2, LAYERS - 1):
        for s, d in zip(stored[::7], targets[::7], strict=True):
            assert torch.equal(page(dst[i], d), page(src[i], s)), (i, s, d)
    with Client(big_daemon.socket, layout=KV.decl()) as c:
        assert c.stats().active_leases == 0
    w2.close()
