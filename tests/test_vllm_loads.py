"""The connector's loads (`pages.py`, `common/loads.py`, the worker's layer-by-layer path) over KV
views built by vLLM's own code (`create_kv_cache_views`) for each of its physical layouts: on
the TransferEngine's CPU backend, on the fake CUDA of tests/fake_cuda.py (the
CUDA backend's real plumbing over host memory), and in a `WorkerSide` against a real daemon."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from kvtier.gpu.cpu import CpuBackend
from kvtier.gpu.plan import Calibration, CalibrationRow, Direction
from kvtier.gpu.transfer import KVPool, slot_geometry
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)
from tests.test_transfer_fakecuda import DevArray, FakeEvent, FakeRuntime, fake  # noqa: F401

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvtier.integrations.common.loads import LayerLoads, Lease, TorchLoads  # noqa: E402
from kvtier.integrations.vllm.layout import EngineKV, Shard, Unsupported  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob  # noqa: E402
from kvtier.integrations.vllm.pages import Paged, paged  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

BT, HEADS, HEAD, BLOCKS = 16, 2, 8, 12
LAYERS = ("l0", "l1", "l2")
SPEC = FullAttentionSpec(block_size=BT, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
PAGE = int(SPEC.page_size_bytes)
COPYABLE = [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.LHBNC, KVCacheLayout.BHLNC]


def vllm_views(layout: KVCacheLayout, seed: int, device: str = "cpu") -> list[Any]:
    """Per-layer [B, H, N, C] views over one random backing buffer, as vLLM allocates them."""
    ls, bs, *_ = compute_layout_strides(SPEC, BLOCKS, len(LAYERS), layout)
    tensor = KVCacheTensor(size=BLOCKS * len(LAYERS) * PAGE, layers=list(LAYERS),
                           layer_stride=ls, block_stride=bs)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (tensor.size,), generator=g, dtype=torch.int8).to(device)
    return list(create_kv_cache_views(raw, SPEC, BLOCKS, layout, tensor))


def page_bytes(view: Any, block: int) -> Any:
    """Block `block` of one layer in its logical [H, N, C] order, as bytes (the slot's page)."""
    return view[block].contiguous().view(torch.uint8).flatten()


def same(a: Any, b: Any) -> bool:
    """Equal bytes (random bf16 bytes hold NaNs, which never compare equal as values)."""
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def slot_rows(slots: int, seed: int, pad: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (slots, PAGE * len(LAYERS) + pad),
                                                dtype=np.uint8)


def expect_loaded(views: list[Any], rows: np.ndarray, slots: list[int], blocks: list[int],
                  layers: range | None = None) -> None:
    for i in layers if layers is not None else range(len(views)):
        for s, b in zip(slots, blocks, strict=True):
            want = torch.from_numpy(rows[s, i * PAGE:(i + 1) * PAGE].copy())
            assert torch.equal(page_bytes(views[i], b), want), (i, s, b)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_pages_of_every_vllm_layout(layout: KVCacheLayout) -> None:
    views = vllm_views(layout, 0)
    if layout not in COPYABLE:  # tokens outside heads: the page is H x N runs of 32 bytes
        with pytest.raises(Unsupported, match="VLLM_KV_CACHE_LAYOUT=LBHNC"):
            paged(views, PAGE)
        return
    pg = paged(views, PAGE)
    # head groups outside the block (LHBNC, BHLNC): one chunk per (layer, head)
    assert pg.per_layer == (HEADS if layout in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC)
                            else 1)
    assert pg.chunk_bytes * pg.per_layer == PAGE
    for i, view in enumerate(views):
        lo, hi = pg.layer_range(i)
        for b in (0, 5, BLOCKS - 1):
            got = torch.cat([pg.chunks[c][b] for c in range(lo, hi)])
            assert torch.equal(got, page_bytes(view, b))
        assert all(c.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
                   for c in pg.chunks[lo:hi])  # views of vLLM's cache, not copies
    with pytest.raises(Unsupported, match="pages of"):
        paged(views, PAGE + 2)


class Releases:
    def __init__(self, refuse: set[str] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.refuse = refuse or set()

    def __call__(self, lease_id: str, nbytes: int, seconds: float) -> bool:
        assert seconds >= 0
        self.calls.append((lease_id, nbytes))
        return lease_id not in self.refuse


LEASES = [Lease("a", [3, 0, 7], [4, 9, 1]), Lease("b", [7, 2], [6, 2])]  # slot 7 twice: fine
SLOTS = [3, 0, 7, 7, 2]
BLKS = [4, 9, 1, 6, 2]


class Gated(CpuBackend):
    """Copies of chunks at or past `from_chunk` wait for `gate`; blocks in `poison` fail in
    chunks at or past `from_chunk`."""

    def __init__(self, pg: Paged, rows: np.ndarray, from_chunk: int,
                 poison: frozenset[int] = frozenset()) -> None:
        pool = KVPool.paged(pg.chunks)
        super().__init__(pool.geometry(), pg.chunks, rows, slot_geometry(rows))
        self.gate = threading.Event()
        self.from_chunk, self.poison = from_chunk, poison
        self.ranges: list[tuple[int, int] | None] = []

    def copy(self, direction: Direction, slot_idx: Any, block_idx: Any,
             chunks: tuple[int, int] | None = None) -> None:
        self.ranges.append(chunks)
        if chunks is not None and chunks[0] >= self.from_chunk:
            assert self.gate.wait(10)
            if self.poison & set(block_idx.tolist()):
                raise OSError("injected copy failure")
        super().copy(direction, slot_idx, block_idx, chunks)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LHBNC],
                         ids=lambda x: x.name)
def test_layer_waits_for_its_own_copy_and_releases_after_the_last(layout: KVCacheLayout) -> None:
    views = vllm_views(layout, 1)
    before = [v.clone() for v in views]
    pg = paged(views, PAGE)
    rows = slot_rows(8, 2)
    backend = Gated(pg, rows, from_chunk=pg.per_layer)  # layers 1 and 2 wait for the gate
    rel = Releases()
    loads = LayerLoads(pg.chunks, pg.per_layer, rel, backend=backend)
    loads.start(rows, 1, LEASES)
    loads.wait_layer(0)  # returns while layer 1 and 2 still wait: it waited for layer 0 only
    expect_loaded(views, rows, SLOTS, BLKS, range(0, 1))
    for i in (1, 2):
        assert same(views[i], before[i])
    assert rel.calls == []  # no lease ends before its last layer is copied
    backend.gate.set()
    done = loads.finish()
    expect_loaded(views, rows, SLOTS, BLKS)
    assert done.loaded == 5 and done.failed == set()
    assert rel.calls == [("a", 3 * PAGE * 3), ("b", 2 * PAGE * 3)]
    lo = [r[0] for r in backend.ranges if r is not None]
    assert lo == [i * pg.per_layer for i in range(3)]  # one job per layer, in layer order
    untouched = [b for b in range(BLOCKS) if b not in BLKS]
    for i in range(3):
        assert same(views[i][untouched], before[i][untouched])
    assert loads.finish().loaded == 0  # nothing pending: a no-op
    loads.close()


def test_a_failed_pair_is_a_load_error_and_its_lease_is_still_released() -> None:
    views = vllm_views(KVCacheLayout.LHBNC, 3)
    pg = paged(views, PAGE)
    rows = slot_rows(8, 4)
    backend = Gated(pg, rows, from_chunk=2 * pg.per_layer, poison=frozenset({1}))
    backend.gate.set()
    rel = Releases()
    loads = LayerLoads(pg.chunks, pg.per_layer, rel, backend=backend)
    loads.start(rows, 1, LEASES)
    for i in range(3):
        loads.wait_layer(i)
    done = loads.finish()
    assert done.failed == {1} and done.loaded == 4  # block 1 failed in the last layer only
    assert rel.calls == [("a", 2 * PAGE * 3), ("b", 2 * PAGE * 3)]
    expect_loaded(views, rows, [3, 0, 7, 2], [4, 9, 6, 2])
    loads.close()


def test_a_refused_release_fails_every_block_of_its_lease() -> None:
    views = vllm_views(KVCacheLayout.LBHNC, 5)
    pg = paged(views, PAGE)
    rows = slot_rows(8, 6)
    rel = Releases(refuse={"a"})
    with_engine = LayerLoads(pg.chunks, pg.per_layer, rel, backend="cpu")
    with_torch = TorchLoads(pg.chunks, pg.per_layer, rel)
    for loads in (with_engine, with_torch):
        loads.start(rows, 1, LEASES)
        done = loads.finish()
        assert done.failed == {4, 9, 1} and done.loaded == 2
        expect_loaded(views, rows, SLOTS, BLKS)
        loads.close()


def test_a_new_pool_generation_rebuilds_the_engine() -> None:
    views = vllm_views(KVCacheLayout.BHLNC, 7)
    pg = paged(views, PAGE)
    loads = LayerLoads(pg.chunks, pg.per_layer, Releases(), backend="cpu")
    first = slot_rows(8, 8)
    loads.start(first, 1, LEASES)
    assert loads.finish().loaded == 5
    engine = loads._engine
    second = slot_rows(4, 9)  # the daemon restarted: another segment, fewer slots
    loads.start(second, 2, [Lease("c", [3, 1], [0, 11])])
    assert loads.finish().loaded == 2 and loads._engine is not engine
    expect_loaded(views, second, [3, 1], [0, 11])
    with pytest.raises(RuntimeError, match="not finished"):
        loads.start(second, 2, [Lease("d", [0], [3])])
        loads.start(second, 2, [Lease("e", [1], [5])])
    loads.close()


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LHBNC],
                         ids=lambda x: x.name)
def test_layer_loads_on_the_cuda_backend(fake: FakeRuntime, path: str,  # noqa: F811
                                         layout: KVCacheLayout) -> None:
    views = vllm_views(layout, 10)
    pg = paged(views, PAGE)
    dev = [DevArray(c.numpy()) for c in pg.chunks]  # "device" memory: vLLM's views, in place
    rows = slot_rows(8, 11)
    fast, slow = 10.0, 1.0
    cal = Calibration(tuple(CalibrationRow(d, pg.chunk_bytes, *(
        (fast, slow) if path == "kernel" else (slow, fast))) for d in Direction))
    rel = Releases()
    loads = LayerLoads(dev, pg.per_layer, rel, backend="auto", calibration=cal)
    after = FakeEvent()
    loads.start(rows, 1, LEASES, after)
    stream = loads._engine.backend._streams[Direction.LOAD]  # type: ignore[union-attr]
    assert stream.waited == [after]  # the first layer's job waits for vLLM's stream; the
    for i in range(3):               # rest follow it on the same stream
        loads.wait_layer(i)
    done = loads.finish()
    assert done.loaded == 5 and done.failed == set()
    expect_loaded(views, rows, SLOTS, BLKS)
    if path == "dma":  # no two pairs advance by one on both sides: 5 runs, one copy per chunk
        assert fake.calls == 5 * len(pg.chunks)
    loads.close()
    assert fake.registered == []  # the engine registered the unpinned rows, and let go


def test_a_failed_dma_copy_on_cuda_is_a_load_error(fake: FakeRuntime) -> None:  # noqa: F811
    views = vllm_views(KVCacheLayout.LBHNC, 12)
    pg = paged(views, PAGE)
    dev = [DevArray(c.numpy()) for c in pg.chunks]
    rows = slot_rows(8, 13)
    lo = pg.chunks[2].data_ptr() + 6 * pg.chunks[2].stride(0)  # layer 2, block 6
    fake.poison = (lo, lo + PAGE)
    cal = Calibration(tuple(CalibrationRow(d, pg.chunk_bytes, 1.0, 10.0) for d in Direction))
    rel = Releases()
    loads = LayerLoads(dev, pg.per_layer, rel, calibration=cal)
    loads.start(rows, 1, LEASES, FakeEvent())
    done = loads.finish()
    assert done.failed == {6} and done.loaded == 4
    assert rel.calls == [("a", 3 * PAGE * 3), ("b", 1 * PAGE * 3)]
    loads.close()


# -- the worker, against a real daemon ----------------------------------------------------------


def engine_kv(layout: KVCacheLayout) -> EngineKV:
    # the fingerprint does not name the physical layout: pages are in logical order whatever it is
    return EngineKV("test/loads@1", "bfloat16", BT, LAYERS, PAGE, HEADS, HEAD, "cpu",
                    Shard(0, 1, True))


def settings(d: DaemonProc, **over: object) -> ConnectorSettings:
    return ConnectorSettings(socket=str(d.socket), use_plan=False, retry_after_s=60.0,
                             **over)  # type: ignore[arg-type]


def keys_of(seed: int, blocks: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return block_keys(rng.integers(3, 1000, blocks * BT + 1).tolist(), BT)


@pytest.mark.parametrize("transfer", ["engine", "torch"])
def test_worker_round_trips_pages_between_layouts(daemon: DaemonProc,  # noqa: F811
                                                  transfer: str) -> None:
    keys = keys_of(1, 4)
    src = vllm_views(KVCacheLayout.LHBNC, 20)
    w1 = WorkerSide(settings(daemon, async_save=False, transfer=transfer),
                    engine_kv(KVCacheLayout.LHBNC), 0)
    w1.register_kv_caches(dict(zip(LAYERS, src, strict=True)))
    assert w1.layerwise == (transfer == "engine")
    with torch.inference_mode():
        w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [7, 2, 9, 0], keys, b"")]))
    assert w1.stats.take()["stored_blocks"] == 4
    w1.close()
    dst = vllm_views(KVCacheLayout.LBHNC, 21)  # another engine, another physical layout
    w2 = WorkerSide(settings(daemon, transfer=transfer), engine_kv(KVCacheLayout.LBHNC), 0)
    w2.register_kv_caches(dict(zip(LAYERS, dst, strict=True)))
    with torch.inference_mode():
        w2.start_load_kv(KvtierMetadata(loads=[LoadJob("q", [1, 3, 5], keys[:4], 1)]))
        for name in LAYERS:
            w2.wait_for_layer_load(name)
        assert w2.take_load_errors() == set()
    for i in range(len(LAYERS)):
        for s, d in zip([2, 9, 0], [1, 3, 5], strict=True):
            assert torch.equal(page_bytes(dst[i], d), page_bytes(src[i], s))
    with Client(daemon.socket, layout=engine_kv(KVCacheLayout.LBHNC).decl()) as kv:
        assert kv.stats().active_leases == 0
    assert w2.stats.take()["loaded_blocks"] == 3
    w2.close()


def test_worker_round_trips_pages_as_a_tenant(tmp_path: Path) -> None:
    """With a tokens file the connector's worker maps its tenant's memory (handed over by fd,
    issue 25) and still saves and loads pages in place."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.a]\ntoken = "vllm-tenant-a"\n\n'
                      '[tenants.b]\ntoken = "vllm-tenant-b"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        keys = keys_of(3, 4)
        src = vllm_views(KVCacheLayout.LHBNC, 23)
        w1 = WorkerSide(settings(d, async_save=False, transfer="engine", token="vllm-tenant-a"),
                        engine_kv(KVCacheLayout.LHBNC), 0)
        w1.register_kv_caches(dict(zip(LAYERS, src, strict=True)))
        with torch.inference_mode():
            w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [7, 2, 9, 0], keys, b"")]))
        assert w1.stats.take()["stored_blocks"] == 4
        w1.close()
        dst = vllm_views(KVCacheLayout.LHBNC, 24)
        w2 = WorkerSide(settings(d, transfer="engine", token="vllm-tenant-a"),
                        engine_kv(KVCacheLayout.LHBNC), 0)
        w2.register_kv_caches(dict(zip(LAYERS, dst, strict=True)))
        with torch.inference_mode():
            w2.start_load_kv(KvtierMetadata(loads=[LoadJob("q", [1, 3, 5], keys[:4], 1)]))
            for name in LAYERS:
                w2.wait_for_layer_load(name)
            assert w2.take_load_errors() == set()
        for i in range(len(LAYERS)):
            for s, t in zip([2, 9, 0], [1, 3, 5], strict=True):
                assert torch.equal(page_bytes(dst[i], t), page_bytes(src[i], s))
        assert w2.stats.take()["loaded_blocks"] == 3
        client = w2.link.client()
        assert client is not None and client.uses_shm
        assert client._segment is not None and client._segment.info.by_fd
        w2.close()
    finally:
        d.stop()


def test_worker_failed_pair_is_recomputed_and_the_lease_released(
        daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    keys = keys_of(2, 5)
    kv = engine_kv(KVCacheLayout.LBHNC)
    with Client(daemon.socket, layout=kv.decl()) as c:
        c.store(keys, [bytes([i + 1]) * kv.block_bytes for i in range(5)])
    dst = vllm_views(KVCacheLayout.LBHNC, 22)
    w = WorkerSide(settings(daemon, transfer="engine"), kv, 0)
    w.register_kv_caches(dict(zip(LAYERS, dst, strict=True)))
    real_copy = CpuBackend.copy

    def flaky(self: CpuBackend, direction: Direction, s: Any, b: Any,
              chunks: tuple[int, int] | None = None) -> None:
        if chunks == (1, 2) and 8 in b.tolist():  # layer 1 of block 8
            raise OSError("injected")
        real_copy(self, direction, s, b, chunks)

    monkeypatch.setattr(CpuBackend, "copy", flaky)
    w.start_load_kv(KvtierMetadata(loads=[LoadJob("q", [4, 8, 6, 10, 11], keys, 0)]))
    w.wait_for_layer_load("l0")
    w.wait_for_layer_load("l1")
    assert w.take_load_errors() == {8}
    for i in range(len(LAYERS)):
        for n, blk in zip([1, 3, 4, 5], [4, 6, 10, 11], strict=True):
            assert set(page_bytes(dst[i], blk).tolist()) == {n}
    with Client(daemon.socket, layout=kv.decl()) as c:
        assert c.stats().active_leases == 0
    totals = w.stats.take()
    assert totals["loaded_blocks"] == 4 and totals["load_failed_blocks"] == 1
    w.close()


def test_unsupported_layout_disables_the_worker(daemon: DaemonProc) -> None:  # noqa: F811
    w = WorkerSide(settings(daemon), engine_kv(KVCacheLayout.LBNHC), 0)
    with pytest.raises(Unsupported, match="LBNHC"):
        w.register_kv_caches(dict(zip(LAYERS, vllm_views(KVCacheLayout.LBNHC, 23),
                                      strict=True)))
    w.close()


def test_settings_check_transfer() -> None:
    from kvtier.integrations.vllm.settings import SettingsError

    assert ConnectorSettings.from_extra({"transfer": "torch"}).transfer == "torch"
    with pytest.raises(SettingsError, match="transfer"):
        ConnectorSettings.from_extra({"transfer": "dma"})


def test_cuda_loads_calibrate_at_start(fake: FakeRuntime,  # noqa: F811
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TRANSFER_CALIBRATION", raising=False)
    pg = paged(vllm_views(KVCacheLayout.LBHNC, 30), PAGE)
    loads = LayerLoads([DevArray(c.numpy()) for c in pg.chunks], pg.per_layer, Releases())
    loads.calibrate()  # at register_kv_caches, not inside the first forward
    assert loads.calibration is not None
    assert min(r.chunk_bytes for r in loads.calibration.rows) == pg.chunk_bytes
    cpu = LayerLoads(pg.chunks, pg.per_layer, Releases())
    cpu.calibrate()
    assert cpu.calibration is None  # nothing to choose on CPU


def test_loads_that_cannot_be_issued_are_all_recomputed(caplog: pytest.LogCaptureFixture) -> None:
    pg = paged(vllm_views(KVCacheLayout.LBHNC, 31), PAGE)
    rel = Releases()
    loads = LayerLoads(pg.chunks, pg.per_layer, rel, backend="cpu")
    small = np.zeros((8, PAGE), dtype=np.uint8)  # a slot of one page cannot hold 3 layers
    with caplog.at_level("WARNING", "kvtier.integrations"):
        for _ in range(2):
            loads.start(small, 1, LEASES)
            done = loads.finish()
            assert done.failed == set(BLKS) and done.loaded == 0
    assert rel.calls == [("a", 0), ("b", 0)] * 2  # the leases still end
    assert sum("loads not issued" in r.message for r in caplog.records) == 1  # one warning
    loads.close()


def test_the_planner_gets_the_copy_time_not_the_forward() -> None:
    """A time that counted the forward would be at least FORWARD (the sleep between the layers'
    waits); the copies of 3 layers x 8 small rows take milliseconds, so the bound separates the
    two however loaded the machine is, short of a copy that itself takes FORWARD."""
    pg = paged(vllm_views(KVCacheLayout.LBHNC, 32), PAGE)
    rows = slot_rows(8, 33)
    seen: list[float] = []
    forward = 1.0

    def release(lease_id: str, nbytes: int, seconds: float) -> bool:
        seen.append(seconds)
        return True

    for loads in (LayerLoads(pg.chunks, pg.per_layer, release, backend="cpu"),
                  TorchLoads(pg.chunks, pg.per_layer, release)):
        loads.start(rows, 1, LEASES)
        loads.wait_layer(0)  # the forward's first attention layer
        time.sleep(forward)  # the rest of the forward, while the copies are done
        for i in range(1, 3):
            loads.wait_layer(i)
        took = loads.finish().seconds
        assert 0 < took < forward
        loads.close()
    assert len(seen) == 4 and min(seen) > 0 and max(seen) < forward  # both leases, both paths
