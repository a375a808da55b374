"""A real daemon's DRAM pool and a CUDA KV pool (`pytest -m gpu`; skipped without CUDA, CuPy and
torch CUDA): the client registers the daemon's whole shared-memory segment with CUDA
(`register_cuda`), blocks are stored straight from GPU memory into the daemon's slots and loaded
back into other GPU blocks, by the block-copy kernel and by batched DMA; and the reference
engine on CUDA serves a prompt from kvtier's hits with the logits of a full recompute."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.keys import block_keys
from kvtier.gpu import available, hostmem
from kvtier.gpu.plan import Direction
from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob, slot_geometry
from tests.daemon_fixture import DaemonProc

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (available() and torch.cuda.is_available()), reason="needs CUDA, CuPy and torch CUDA")]

LAYERS, BT, HEADS, HEAD = 4, 16, 2, 64  # bf16: 4 KiB chunks, 32 KiB blocks
BLOCK = 2 * LAYERS * BT * HEADS * HEAD * 2
BLOCKS, STORED = 40, 24
DECL = LayoutDecl(b"gpu-test-layout", BLOCK, BT, model_id="test/gpu-daemon@1")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d").start()  # 16 MiB of 64 KiB slots
    try:
        yield d
    finally:
        d.stop()


def gpu_pool(seed: int) -> tuple[KVPool, list[Any]]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BT, HEADS, HEAD)
    tensors = [torch.randint(0, 256, (int(np.prod(shape)) * 2,), generator=g, dtype=torch.uint8)
               .view(torch.bfloat16).view(shape).cuda() for _ in range(2 * LAYERS)]
    return KVPool.layered(tensors[0::2], tensors[1::2]), tensors


def block_bytes(tensors: list[Any], block: int) -> bytes:
    return b"".join(t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                    for t in tensors)


def engine(pool: KVPool, slots: np.ndarray, path: str) -> TransferEngine:
    from kvtier.gpu.backend import CudaBackend

    backend = CudaBackend(pool.geometry(), pool.chunks, slots, slot_geometry(slots),
                          force_path=path)
    assert backend._reg is None  # the client's registration of the segment serves the copy
    return TransferEngine(pool, slots, backend=backend)


@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_store_from_gpu_memory_and_load_back(daemon: DaemonProc, path: str) -> None:
    src, src_t = gpu_pool(1)
    dst, dst_t = gpu_pool(2)
    keys = block_keys(list(range(5, 5 + STORED * BT + 1)), BT)
    stored_from = list(range(BLOCKS - 1, BLOCKS - 1 - STORED, -1))
    with Client(daemon.socket, layout=DECL) as c:
        assert c.register_cuda() and c.register_cuda()  # idempotent
        buf = c.slot_buffer()
        assert buf is not None
        slots = buf.array()
        reg = hostmem.device_pointer(buf.segment.ctypes.data)
        assert reg is not None  # the whole segment is mapped for the device
        assert hostmem.device_pointer(buf.segment.ctypes.data + buf.segment.size - 1) is not None
        with c.store_into(keys) as tx:
            assert [i for i, _ in tx.slots] == list(range(STORED))
            with engine(src, slots, path) as eng:
                res = eng.wait(eng.submit(TransferJob(Direction.STORE, tx.slot_ids,
                                                      stored_from)))
            assert res.all_ok and res.path == path, res.error
        assert tx.committed == STORED
        for (i, view), b in zip(tx.slots, stored_from, strict=True):
            assert view.tobytes() == block_bytes(src_t, b), i

        loaded_into = [3 * i % BLOCKS for i in range(STORED)]  # 0, 3, 6, ...: scattered
        with c.load(keys) as got:
            assert got.blocks == STORED and len(got.slots) == STORED
            with engine(dst, slots, path) as eng:
                res = eng.wait(eng.submit(TransferJob(Direction.LOAD, got.slots, loaded_into)))
            assert res.all_ok and res.path == path, res.error
        for s, d in zip(stored_from, loaded_into, strict=True):
            assert block_bytes(dst_t, d) == block_bytes(src_t, s), (s, d)
        assert c.stats().active_leases == 0


def test_reference_engine_on_cuda_loads_hits_bit_exact(daemon: DaemonProc) -> None:
    from kvtier.engine import Engine, Sequence, get_config
    from kvtier.engine.kvtier_adapter import KvtierEngine, LinkOptions

    cfg = get_config("tiny").with_dtype("bfloat16")
    eng = Engine(cfg, num_blocks=128, device="cuda")
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, cfg.vocab_size, 20 * BT + 5)]
    seq = Sequence()
    ref = eng.prefill(seq, prompt).logits
    eng.release(seq)
    with KvtierEngine(eng, LinkOptions(socket=daemon.socket, use_plan=False)) as replica:
        first = replica.serve(prompt)  # nothing cached: recompute, then store from the GPU
        eng.release(first.seq)
        assert first.loaded_blocks == 0 and first.stored_blocks == 20, first.fallback
        client = replica.client()
        assert client is not None and client.slot_buffer() is not None
        again = replica.serve(prompt)  # every full block but the last position's from kvtier
        eng.release(again.seq)
    assert again.fallback == "" and again.loaded_blocks == 20 and again.computed_tokens == 5
    assert torch.equal(first.logits, ref) and torch.equal(again.logits, ref)
