"""Pure transfer planning: pair validation, run merging, DMA copy lists, calibration choice."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.gpu.cpu import execute_ops, flat_span, reference_copy
from kvtier.gpu.plan import (
    Calibration,
    CalibrationRow,
    Direction,
    PoolGeometry,
    PoolKind,
    Run,
    SlotGeometry,
    check_geometry,
    check_pairs,
    copy_ops,
    merge_runs,
    pairs_of_ops,
    per_chunk_ops,
    sort_pairs,
)

POOL = PoolGeometry(PoolKind.LAYERED, num_blocks=10, n_chunks=4, chunk_bytes=32, block_stride=32)
SLOTS = SlotGeometry(num_slots=6, slot_bytes=128, slot_stride=128)


def test_merge_runs_worked_example() -> None:
    s = np.array([3, 4, 5, 9, 10, 2], dtype=np.int64)
    b = np.array([7, 8, 9, 1, 3, 4], dtype=np.int64)
    # (3,7)(4,8)(5,9) advance together; (9,1)->(10,3) breaks on the block side; (2,4) alone.
    assert merge_runs(s, b) == [Run(3, 7, 3), Run(9, 1, 1), Run(10, 3, 1), Run(2, 4, 1)]
    assert merge_runs(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []


def test_sorting_exposes_runs() -> None:
    s = np.array([5, 3, 4], dtype=np.int64)
    b = np.array([9, 7, 8], dtype=np.int64)
    order = sort_pairs(s, b)
    assert merge_runs(s[order], b[order]) == [Run(3, 7, 3)]


def test_copy_ops_layered_are_2d_per_chunk() -> None:
    ops = copy_ops([Run(1, 2, 3)], POOL, SLOTS)
    assert len(ops) == POOL.n_chunks
    op = ops[1]
    # chunk 1 of slot 1 starts at 1*128 + 1*32 = 160; block 2 at 2*32 = 64; 3 rows of 32 B.
    assert (op.host_off, op.host_pitch, op.dev_off, op.dev_pitch) == (160, 128, 64, 32)
    assert (op.width, op.height, op.first_pair, op.n_pairs) == (32, 3, 0, 3)


def test_copy_ops_contiguous_collapse_to_1d() -> None:
    pool = PoolGeometry(PoolKind.CONTIGUOUS, 10, 1, 128, 128)
    ops = copy_ops([Run(0, 4, 5), Run(5, 0, 1)], pool, SLOTS)
    # dense on both sides: 5 rows of 128 B become one 640 B copy.
    assert [(o.host_off, o.dev_off, o.width, o.height, o.first_pair, o.n_pairs) for o in ops] == [
        (0, 512, 640, 1, 0, 5), (640, 0, 128, 1, 5, 1)]
    padded = SlotGeometry(6, 128, 192)
    assert copy_ops([Run(0, 4, 5)], pool, padded)[0].height == 5


def test_per_chunk_ops_counts() -> None:
    s = np.array([0, 1, 2], dtype=np.int64)
    b = np.array([0, 1, 2], dtype=np.int64)
    ops = per_chunk_ops(s, b, POOL, SLOTS)
    assert len(ops) == 3 * POOL.n_chunks
    assert all(o.height == 1 and o.width == POOL.chunk_bytes for o in ops)


def test_check_pairs_accepts_repeated_sources_unsorted() -> None:
    s, b = check_pairs(Direction.LOAD, [5, 5, 0], [9, 1, 3], POOL, SLOTS)
    assert s.tolist() == [5, 5, 0] and b.dtype == np.int64
    s, b = check_pairs(Direction.STORE, [4, 0, 2], [7, 7, 7], POOL, SLOTS)
    assert b.tolist() == [7, 7, 7]


@pytest.mark.parametrize(
    ("direction", "slots", "blocks", "message"),
    [
        (Direction.LOAD, [0, 1], [2, 2], "duplicate destination pool block 2"),
        (Direction.STORE, [3, 3], [0, 1], "duplicate destination slot 3"),
        (Direction.LOAD, [0, 6], [0, 1], "slot index 6 at pair 1 is out of range"),
        (Direction.LOAD, [0], [-1], "block index -1 at pair 0 is out of range"),
        (Direction.LOAD, [0, 1], [0], "2 slots but 1 blocks"),
        (Direction.LOAD, [0.5], [1], "must hold integers"),
        (Direction.LOAD, [[0]], [[1]], "1-D sequence"),
    ],
)
def test_check_pairs_rejects(direction: Direction, slots: object, blocks: object,
                             message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_pairs(direction, slots, blocks, POOL, SLOTS)  # type: ignore[arg-type]


def test_check_geometry_rejects_small_slots() -> None:
    with pytest.raises(ValueError, match="cannot hold a block of 128 B"):
        check_geometry(POOL, SlotGeometry(4, 127, 127))
    with pytest.raises(ValueError, match="block stride 16 B"):
        check_geometry(PoolGeometry(PoolKind.LAYERED, 4, 2, 32, 16), SLOTS)


def _views(pool: PoolGeometry, slots: SlotGeometry, seed: int
           ) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    slot_mem = rng.integers(0, 256, slots.num_slots * slots.slot_stride, dtype=np.uint8)
    rows = np.lib.stride_tricks.as_strided(
        slot_mem, (slots.num_slots, slots.slot_bytes), (slots.slot_stride, 1))
    chunk_mems = [rng.integers(0, 256, pool.num_blocks * pool.block_stride, dtype=np.uint8)
                  for _ in range(pool.n_chunks)]
    chunks = [np.lib.stride_tricks.as_strided(m, (pool.num_blocks, pool.chunk_bytes),
                                              (pool.block_stride, 1)) for m in chunk_mems]
    return rows, chunks


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    kind=st.sampled_from(list(PoolKind)),
    direction=st.sampled_from(list(Direction)),
    chunk_bytes=st.integers(1, 40),
    pad=st.integers(0, 9),
    stride_pad=st.integers(0, 7),
)
def test_dma_plan_equals_reference(data: st.DataObject, kind: PoolKind, direction: Direction,
                                   chunk_bytes: int, pad: int, stride_pad: int) -> None:
    n_chunks = 1 if kind is PoolKind.CONTIGUOUS else 2 * data.draw(st.integers(1, 3))
    pool = PoolGeometry(kind, 9, n_chunks, chunk_bytes, chunk_bytes + stride_pad)
    slots = SlotGeometry(8, n_chunks * chunk_bytes + pad, n_chunks * chunk_bytes + pad + stride_pad)
    n = data.draw(st.integers(0, 8))
    dst_pool = direction is Direction.LOAD
    dsts = data.draw(st.permutations(range(9 if dst_pool else 8)))[:n]
    srcs = data.draw(st.lists(st.integers(0, (8 if dst_pool else 9) - 1), min_size=n, max_size=n))
    s_list, b_list = (srcs, dsts) if dst_pool else (dsts, srcs)
    s, b = check_pairs(direction, s_list, b_list, pool, slots)

    want_rows, want_chunks = _views(pool, slots, seed=n)
    reference_copy(direction, want_rows, want_chunks, pool, s, b)
    got_rows, got_chunks = _views(pool, slots, seed=n)
    order = sort_pairs(s, b)
    ops = copy_ops(merge_runs(s[order], b[order]), pool, slots)
    execute_ops(direction, ops, flat_span(got_rows), [flat_span(c) for c in got_chunks])
    np.testing.assert_array_equal(got_rows, want_rows)
    for g, w in zip(got_chunks, want_chunks, strict=True):
        np.testing.assert_array_equal(g, w)


def test_calibration_chooses_measured_faster_path() -> None:
    cal = Calibration((
        CalibrationRow(Direction.LOAD, 4096, kernel_gbps=40.0, dma_gbps=1.1),
        CalibrationRow(Direction.LOAD, 2 << 20, kernel_gbps=40.0, dma_gbps=48.0),
        CalibrationRow(Direction.STORE, 4096, kernel_gbps=30.0, dma_gbps=1.0),
    ))
    small = per_chunk_ops(np.arange(4), np.arange(4), POOL, SLOTS)  # 32 B copies -> 4 KiB row
    big = copy_ops([Run(0, 0, 1)], PoolGeometry(PoolKind.CONTIGUOUS, 4, 1, 3 << 20, 3 << 20),
                   SlotGeometry(4, 3 << 20, 3 << 20))
    assert cal.choose(Direction.LOAD, small) == "kernel"
    assert cal.choose(Direction.LOAD, big) == "dma"
    assert cal.choose(Direction.STORE, big) == "kernel"
    assert Calibration.from_json(cal.to_json()) == cal
    with pytest.raises(LookupError):
        Calibration((), "empty").choose(Direction.LOAD, small)


def test_pairs_of_failed_ops_map_back_to_caller_order() -> None:
    s = np.array([9, 3, 4, 0], dtype=np.int64)
    b = np.array([1, 7, 8, 5], dtype=np.int64)
    order = sort_pairs(s, b)  # sorted by slot: (0,5) (3,7) (4,8) (9,1) -> caller idx 3,1,2,0
    ops = copy_ops(merge_runs(s[order], b[order]), POOL, SLOTS)
    # runs: (0,5,1) (3,7,2) (9,1,1); 4 chunks each -> ops 0-3, 4-7, 8-11
    assert pairs_of_ops(4, order, ops, [5]).tolist() == [False, True, True, False]
    assert pairs_of_ops(4, order, ops, [0, 11]).tolist() == [True, False, False, True]
    assert not pairs_of_ops(4, order, ops, []).any()
