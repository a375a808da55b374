"""TransferEngine on the CPU reference backend: layouts, dtypes, indices, bad input, failures."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.gpu.cpu import CpuBackend
from kvtier.gpu.plan import Direction, IntArray
from kvtier.gpu.transfer import KVPool, TransferEngine, TransferJob

L, NB, T, H, D = 3, 13, 4, 2, 8  # odd block count on purpose
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8]


def _rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random raw bytes reinterpreted as `dtype` (covers NaN/inf bit patterns too)."""
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bytes(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8).copy()
    out: np.ndarray = t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
    return out


def _layered(dtype: torch.dtype, seed: int) -> tuple[KVPool, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ks = [_rand_tensor((NB, T, H, D), dtype, gen) for _ in range(L)]
    vs = [_rand_tensor((NB, T, H, D), dtype, gen) for _ in range(L)]
    return KVPool.layered(ks, vs), [t for kv in zip(ks, vs, strict=True) for t in kv]


def _contiguous(dtype: torch.dtype, seed: int) -> tuple[KVPool, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    pool = _rand_tensor((NB, L, 2, T, H, D), dtype, gen)
    return KVPool.contiguous(pool), [pool]


def _slot_part(slots: np.ndarray, s: int, c: int, chunk: int) -> np.ndarray:
    """Slot layout contract: chunk c of slot s is bytes [c*chunk, (c+1)*chunk)."""
    return slots[s, c * chunk:(c + 1) * chunk]


def _chunk_bytes(t: torch.Tensor, b: int) -> np.ndarray:
    return _bytes(t[b])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", [_layered, _contiguous], ids=["layered", "contiguous"])
def test_store_then_load_is_bit_exact(dtype: torch.dtype, make: Any) -> None:
    pool, chunks = make(dtype, seed=1)
    geom = pool.geometry()
    slots = np.full((9, geom.payload_bytes + 5), 0xAB, dtype=np.uint8)  # 5 B tail never touched
    slot_ids = [8, 0, 3, 5, 1, 7, 2]  # unsorted, odd count
    block_ids = [12, 4, 0, 5, 6, 1, 11]
    with TransferEngine(pool, slots) as eng:
        res = eng.wait(eng.submit(TransferJob(Direction.STORE, slot_ids, block_ids)))
        assert res.all_ok and res.path == "cpu" and res.error is None
        assert res.nbytes == 7 * geom.payload_bytes
        for s, b in zip(slot_ids, block_ids, strict=True):
            for c, t in enumerate(chunks):
                np.testing.assert_array_equal(_slot_part(slots, s, c, geom.chunk_bytes),
                                              _chunk_bytes(t, b))
        assert (slots[:, geom.payload_bytes:] == 0xAB).all()
        assert (slots[[4, 6]] == 0xAB).all()

    pool2, chunks2 = make(dtype, seed=2)
    before = [_bytes(t) for t in chunks2]
    load_blocks = [3, 9, 10, 2, 0, 7, 8]
    with TransferEngine(pool2, slots) as eng:
        res = eng.wait(eng.submit(TransferJob(Direction.LOAD, slot_ids, load_blocks)))
    assert res.all_ok
    for s, sb, lb in zip(slot_ids, block_ids, load_blocks, strict=True):
        del s
        for t_old, t_new in zip(chunks, chunks2, strict=True):
            np.testing.assert_array_equal(_chunk_bytes(t_new, lb), _chunk_bytes(t_old, sb))
    untouched = sorted(set(range(NB)) - set(load_blocks))
    for t, old in zip(chunks2, before, strict=True):
        per = old.reshape(NB, -1)
        for b in untouched:
            np.testing.assert_array_equal(_chunk_bytes(t, b), per[b])


def test_numpy_pool_and_fp8_as_uint8_view() -> None:
    rng = np.random.default_rng(0)
    ks = [rng.integers(0, 256, (5, T, H, D), dtype=np.uint8) for _ in range(2)]
    vs = [rng.integers(0, 256, (5, T, H, D), dtype=np.uint8) for _ in range(2)]
    slots = np.zeros((4, 4 * T * H * D), dtype=np.uint8)
    with TransferEngine(KVPool.layered(ks, vs), slots) as eng:
        assert eng.wait(eng.submit(TransferJob(Direction.STORE, [2], [4]))).all_ok
    # slot = [K0 | V0 | K1 | V1], each T*H*D = 64 bytes
    np.testing.assert_array_equal(slots[2], np.concatenate(
        [ks[0][4].ravel(), vs[0][4].ravel(), ks[1][4].ravel(), vs[1][4].ravel()]))


def test_vllm_stacked_pool_and_torch_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    kv = [_rand_tensor((2, 5, T, H, D), torch.bfloat16, gen) for _ in range(L)]
    slots = torch.zeros((3, 2 * L * T * H * D * 2), dtype=torch.uint8)
    with TransferEngine(KVPool.stacked(kv), slots) as eng:
        assert eng.wait(eng.submit(TransferJob(Direction.STORE, [1], [3]))).all_ok
        chunk = T * H * D * 2
        np.testing.assert_array_equal(slots[1, 3 * chunk:4 * chunk].numpy(), _bytes(kv[1][1, 3]))
        assert eng.wait(eng.submit(TransferJob(Direction.LOAD, [1, 1], [0, 4]))).all_ok
    for layer in kv:
        assert torch.equal(layer[:, 0].view(torch.uint8), layer[:, 3].view(torch.uint8))
        assert torch.equal(layer[:, 4].view(torch.uint8), layer[:, 3].view(torch.uint8))


def test_gather_repeated_source_blocks() -> None:
    pool, _ = _layered(torch.float16, seed=4)
    geom = pool.geometry()
    slots = np.zeros((4, geom.payload_bytes), dtype=np.uint8)
    with TransferEngine(pool, slots) as eng:
        assert eng.wait(eng.submit(TransferJob(Direction.STORE, [3, 0, 1], [6, 6, 2]))).all_ok
    np.testing.assert_array_equal(slots[3], slots[0])
    assert not np.array_equal(slots[1], slots[0])


@pytest.mark.parametrize(
    ("direction", "slots", "blocks", "message"),
    [
        (Direction.LOAD, [0, 1], [5, 5], "duplicate destination pool block 5"),
        (Direction.STORE, [2, 2], [0, 1], "duplicate destination slot 2"),
        (Direction.LOAD, [0, 1], [0, NB], f"block index {NB} at pair 1 is out of range"),
        (Direction.STORE, [-1], [0], "slot index -1"),
        (Direction.LOAD, [0, 1, 2], [0, 1], "3 slots but 2 blocks"),
        ("sideways", [0], [0], "'sideways' is not a valid Direction"),
    ],
)
def test_bad_jobs_raise_and_write_nothing(direction: Any, slots: list[int], blocks: list[int],
                                          message: str) -> None:
    pool, chunks = _layered(torch.bfloat16, seed=5)
    buf = np.random.default_rng(5).integers(0, 256, (4, pool.geometry().payload_bytes),
                                            dtype=np.uint8)
    before_pool, before_slots = [_bytes(t) for t in chunks], buf.copy()
    with TransferEngine(pool, buf) as eng:
        with pytest.raises(ValueError, match=message):
            eng.submit(TransferJob(direction, slots, blocks))
        assert eng.pending() == 0
    for t, b in zip(chunks, before_pool, strict=True):
        np.testing.assert_array_equal(_bytes(t), b)
    np.testing.assert_array_equal(buf, before_slots)


def _k(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("pool", "slots", "message"),
    [
        (KVPool.layered([_k((4, T, H, D))], [_k((4, T, H, D), torch.float16)]),
         np.zeros((2, 1024), np.uint8), "differs from tensor 0"),
        (KVPool.layered([_k((4, T, H, D))], [_k((5, T, H, D))]),
         np.zeros((2, 1024), np.uint8), "differs from tensor 0"),
        (KVPool.layered([_k((4, T, D, H)).transpose(2, 3)], [_k((4, T, D, H)).transpose(2, 3)]),
         np.zeros((2, 1024), np.uint8), "each block must be contiguous"),
        (KVPool.layered([_k((4, T, H * D))], [_k((4, T, H * D))]),
         np.zeros((2, 1024), np.uint8), r"layered pool needs K/V pairs of \[blocks, T, H, D\]"),
        (KVPool.layered([_k((4, T, H, D))], [_k((4, T, H, D))]),
         np.zeros((2, 255), np.uint8), "cannot hold a block of 256 B"),  # 2 x 4*2*8*2 B
        (KVPool.layered([_k((4, T, H, D))], [_k((4, T, H, D))]),
         np.zeros((2, 256), np.float32), "slot buffer must be a uint8"),
        (KVPool.layered([_k((4, T, H, D))], [_k((4, T, H, D))]),
         np.zeros(2048, np.uint8), "slot buffer must be a uint8"),
        (KVPool.contiguous(_k((0, 16))), np.zeros((2, 32), np.uint8), "has no blocks"),
    ],
)
def test_bad_pools_and_slot_buffers(pool: KVPool, slots: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferEngine(pool, slots)


def test_unknown_backend_name() -> None:
    pool = KVPool.contiguous(np.zeros((2, 8), np.uint8))
    with pytest.raises(ValueError, match="unknown transfer backend 'tpu'"):
        TransferEngine(pool, np.zeros((2, 8), np.uint8), backend="tpu")


class _FaultyBackend(CpuBackend):
    """Copies raise whenever a batch touches one of `bad_slots` (before writing anything)."""

    bad_slots: frozenset[int] = frozenset()

    def copy(self, direction: Direction, slot_idx: IntArray, block_idx: IntArray) -> None:
        if self.bad_slots & set(slot_idx.tolist()):
            raise OSError("injected: slot memory unreadable")
        super().copy(direction, slot_idx, block_idx)


def test_failure_reported_for_exactly_the_affected_blocks() -> None:
    pool, chunks = _layered(torch.bfloat16, seed=6)
    geom = pool.geometry()
    slots = np.random.default_rng(6).integers(0, 256, (8, geom.payload_bytes), dtype=np.uint8)
    backend = _FaultyBackend(geom, pool.chunks, slots, TransferEngine(pool, slots).slot_geometry)
    backend.bad_slots = frozenset({2, 6})
    before = [_bytes(t).reshape(NB, -1) for t in chunks]
    with TransferEngine(pool, slots, backend=backend) as eng:
        res = eng.wait(eng.submit(TransferJob(Direction.LOAD, [0, 2, 4, 6, 7], [1, 3, 5, 7, 9])))
    assert res.ok.tolist() == [True, False, True, False, True]
    assert res.failed_blocks() == [3, 7] and res.failed_slots() == [2, 6]
    assert res.error is not None and "injected" in res.error
    assert res.nbytes == 3 * geom.payload_bytes
    for c, t in enumerate(chunks):
        for s, b in [(0, 1), (4, 5), (7, 9)]:
            np.testing.assert_array_equal(_chunk_bytes(t, b), _slot_part(slots, s, c,
                                                                         geom.chunk_bytes))
        for b in (3, 7):
            np.testing.assert_array_equal(_chunk_bytes(t, b), before[c][b])


def test_after_event_orders_the_job_and_poll_reports_it() -> None:
    pool, _ = _layered(torch.float32, seed=7)
    slots = np.zeros((2, pool.geometry().payload_bytes), dtype=np.uint8)
    gate = threading.Event()
    with TransferEngine(pool, slots) as eng:
        h = eng.submit(TransferJob(Direction.STORE, [1], [2], after=gate))
        assert eng.poll() == []  # still waiting on the gate
        gate.set()
        res = eng.wait(h, timeout=10)
        assert res.all_ok and res.handle == h
        with pytest.raises(KeyError):
            eng.wait(h)
        h2 = eng.submit(TransferJob(Direction.LOAD, [], []))
        assert [r.handle for r in eng.poll()] == [h2]


class _NeverSet:
    def wait(self) -> bool:
        return False


def test_failed_wait_fails_every_pair_and_writes_nothing() -> None:
    pool, chunks = _layered(torch.float32, seed=8)
    slots = np.ones((3, pool.geometry().payload_bytes), dtype=np.uint8)
    before = [_bytes(t) for t in chunks]
    with TransferEngine(pool, slots) as eng:
        res = eng.wait(eng.submit(TransferJob(Direction.LOAD, [0, 1], [4, 5], after=_NeverSet())))
    assert res.ok.tolist() == [False, False] and res.nbytes == 0
    assert res.error is not None and "wait failed" in res.error
    for t, b in zip(chunks, before, strict=True):
        np.testing.assert_array_equal(_bytes(t), b)


def test_slot_payload_matches_kvlayout_block_bytes() -> None:
    from kvtier.core.presets import get_preset

    for tp, heads in ((1, 8), (8, 1)):
        layout = get_preset("Llama-3-8B").layout(block_tokens=16, tp_size=tp)
        assert layout.kv_heads_per_rank == heads
        k = [torch.empty((1, 16, heads, 128), dtype=torch.bfloat16) for _ in range(32)]
        geom = KVPool.layered(k, k).geometry()
        # 16 tokens * heads * 128 * 2 B per chunk; 64 chunks: 2 MiB at TP1, 256 KiB at TP8
        assert geom.chunk_bytes == 16 * heads * 128 * 2
        assert geom.payload_bytes == layout.block_bytes() == (2 << 20) // tp


def test_slot_array_over_a_segment_and_read_only_slots() -> None:
    from kvtier.core.segment import slot_array

    seg = np.zeros(4096 + 3 * 512, dtype=np.uint8)
    rows = slot_array(seg, data_offset=4096, num_slots=3, slot_bytes=256, slot_stride=512)
    pool = KVPool.contiguous(np.arange(4 * 256, dtype=np.uint8).reshape(4, 256) % 251)
    with TransferEngine(pool, rows) as eng:
        assert eng.wait(eng.submit(TransferJob(Direction.STORE, [2, 0], [1, 3]))).all_ok
    # slot 2 at 4096 + 2*512 = 5120 holds block 1; slot 0 at 4096 holds block 3
    np.testing.assert_array_equal(seg[5120:5376], pool.chunks[0][1])
    np.testing.assert_array_equal(seg[4096:4352], pool.chunks[0][3])
    assert not seg[4352:5120].any() and not seg[:4096].any()
    with pytest.raises(ValueError, match="past the 5632 B segment"):
        slot_array(seg, 4096, 4, 256, 512)
    seg.flags.writeable = False
    ro = slot_array(seg, 4096, 3, 256, 512)
    with TransferEngine(pool, ro) as eng:
        with pytest.raises(ValueError, match="read-only"):
            eng.submit(TransferJob(Direction.STORE, [0], [0]))
        seg_before = seg.copy()
        assert eng.wait(eng.submit(TransferJob(Direction.LOAD, [2], [0]))).all_ok
    np.testing.assert_array_equal(seg, seg_before)
    np.testing.assert_array_equal(pool.chunks[0][0], pool.chunks[0][1])


@pytest.mark.parametrize("direction", list(Direction))
def test_chunk_ranges_move_only_their_chunks_of_a_paged_pool(direction: Direction) -> None:
    gen = torch.Generator().manual_seed(21)
    chunks = [_rand_tensor((NB, 40), torch.uint8, gen) for _ in range(5)]  # odd count: paged
    pool = KVPool.paged(chunks)
    slots = np.random.default_rng(22).integers(0, 256, (6, 5 * 40 + 3), dtype=np.uint8)
    before_slots, before = slots.copy(), [c.clone() for c in chunks]
    s, b = [4, 1], [7, 0]
    with TransferEngine(pool, slots, backend="cpu") as eng:
        res = eng.wait(eng.submit(TransferJob(direction, s, b, chunks=(1, 3))))
        assert res.all_ok and res.nbytes == 2 * 2 * 40  # two pairs x two chunks
        for bad in [(0, 0), (3, 6), (-1, 2), (2, 1), "ab"]:
            with pytest.raises(ValueError, match="chunk"):
                eng.submit(TransferJob(direction, s, b, chunks=bad))  # type: ignore[arg-type]
    for c in range(5):
        for si, bi in zip(s, b, strict=True):
            moved = 1 <= c < 3
            part, blk = _slot_part(slots, si, c, 40), _bytes(chunks[c][bi])
            if direction is Direction.LOAD:
                want = _slot_part(before_slots, si, c, 40) if moved else _bytes(before[c][bi])
                np.testing.assert_array_equal(blk, want)
            else:
                want = _bytes(before[c][bi]) if moved else _slot_part(before_slots, si, c, 40)
                np.testing.assert_array_equal(part, want)
    np.testing.assert_array_equal(slots[:, 200:], before_slots[:, 200:])  # the tail: untouched
    with pytest.raises(ValueError, match="paged pool"):
        KVPool.paged([]).geometry()
