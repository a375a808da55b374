"""The asyncio client against a real daemon: shm and streaming paths, concurrent tasks."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvtier.client.async_client import AsyncClient
from kvtier.client.sync_client import KvtierRpcError, LayoutDecl
from kvtier.core.types import Tier
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401

BLOCK = 65536
LAYOUT = LayoutDecl(b"async-layout-0001", BLOCK, 16, model_id="async-model")


@pytest.mark.parametrize("streaming", [False, True])
def test_async_roundtrip_and_concurrency(daemon: DaemonProc, streaming: bool) -> None:  # noqa: F811
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, layout=LAYOUT,
                                             streaming=streaming) as kv:
            assert kv.uses_shm is not streaming

            async def one(tag: int) -> None:
                keys = [bytes([tag, i]) + bytes(30) for i in range(4)]
                data = [os.urandom(BLOCK) for _ in keys]
                assert (await kv.store(keys, data)).stored == 4
                look = await kv.lookup(keys)
                assert look.hit_blocks == 4 and look.tiers == [Tier.DRAM] * 4
                async with kv.load(keys) as got:
                    assert [bytes(v) for v in got.views] == data

            await asyncio.gather(*(one(t) for t in range(8)))
            stats = await kv.stats()
            assert stats.tiers[0].blocks == 32 and stats.active_leases == 0
            with pytest.raises(KvtierRpcError):
                await kv.store([bytes(32)], [os.urandom(BLOCK)], parent=b"\x01" * 32)

    asyncio.run(main())


def test_async_store_into_aborts_on_error(daemon: DaemonProc) -> None:  # noqa: F811
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket, layout=LAYOUT) as kv:
            keys = [bytes([77, i]) + bytes(30) for i in range(2)]
            with pytest.raises(ValueError):
                async with kv.store_into(keys) as tx:
                    assert len(tx.slots) == 2
                    raise ValueError("boom")
            assert (await kv.lookup(keys)).hit_blocks == 0
            assert (await kv.stats()).tiers[0].used_bytes == 0

    asyncio.run(main())
