"""Zero-copy engine API against a real daemon: `Loaded.slots`, `StoreTx.slot_ids` and
`slot_buffer()` address the very bytes the per-block views show (sync and asyncio clients), the
streaming path has neither, and a restart hands out the new pool's buffer."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from kvtier.client.async_client import AsyncClient
from kvtier.client.sync_client import Client, LayoutDecl
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401

BLOCK = 40_000  # smaller than the fixture's 64 KiB slot: rows are wider than blocks
LAYOUT = LayoutDecl(b"slots-layout-0001", BLOCK, 16, model_id="slots-model")
SLOT = 64 * 1024


def keys_for(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def test_store_through_slot_buffer_then_load_views(daemon: DaemonProc) -> None:  # noqa: F811
    keys = keys_for(1, 5)
    data = [np.frombuffer(os.urandom(BLOCK), dtype=np.uint8) for _ in keys]
    with Client(daemon.socket, layout=LAYOUT) as kv:
        buf = kv.slot_buffer()
        assert buf is not None and (buf.slot_bytes, buf.slot_stride) == (SLOT, SLOT)
        slots = buf.array()
        assert slots.shape == (16 * 1024 * 1024 // SLOT, SLOT)  # the fixture's 16 MiB pool
        with kv.store_into(keys) as tx:
            assert len(tx.slot_ids) == len(tx.slots) == 5 and len(set(tx.slot_ids)) == 5
            for (index, view), slot in zip(tx.slots, tx.slot_ids, strict=True):
                assert view.ctypes.data == slots[slot].ctypes.data  # the same bytes
                slots[slot, :BLOCK] = data[index]  # written only through the buffer
        assert tx.committed == 5
        with kv.load(keys) as got:
            assert got.blocks == 5 and len(got.slots) == 5
            for view, slot, want in zip(got.views, got.slots, data, strict=True):
                assert view.ctypes.data == slots[slot].ctypes.data
                assert np.array_equal(view, want)
                assert np.array_equal(slots[slot, :BLOCK], want)


def test_streaming_path_has_no_slots(daemon: DaemonProc) -> None:  # noqa: F811
    keys = keys_for(2, 2)
    with Client(daemon.socket, layout=LAYOUT, streaming=True) as kv:
        assert kv.slot_buffer() is None
        kv.store(keys, [os.urandom(BLOCK) for _ in keys])
        with kv.load(keys) as got:
            assert got.blocks == 2 and got.slots == ()


def test_restart_hands_out_the_new_pools_buffer(daemon: DaemonProc) -> None:  # noqa: F811
    with Client(daemon.socket, layout=LAYOUT) as kv:
        before = kv.slot_buffer()
        assert before is not None
        assert daemon.stop() == 0
        daemon.start()
        kv.store(keys_for(3, 1), [os.urandom(BLOCK)])  # reconnects, re-registers, re-maps
        after = kv.slot_buffer()
        assert after is not None and after.generation != before.generation
        with kv.load(keys_for(3, 1)) as got:
            assert got.views[0].ctypes.data == after.array()[got.slots[0]].ctypes.data


def test_async_client_slots(daemon: DaemonProc) -> None:  # noqa: F811
    keys = keys_for(4, 3)
    data = [os.urandom(BLOCK) for _ in keys]

    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, layout=LAYOUT) as kv:
            buf = kv.slot_buffer()
            assert buf is not None
            slots = buf.array()
            async with kv.store_into(keys) as tx:
                for (index, _), slot in zip(tx.slots, tx.slot_ids, strict=True):
                    slots[slot, :BLOCK] = np.frombuffer(data[index], dtype=np.uint8)
            async with kv.load(keys) as got:
                assert [bytes(slots[s, :BLOCK]) for s in got.slots] == data
                assert [bytes(v) for v in got.views] == data

    asyncio.run(main())
