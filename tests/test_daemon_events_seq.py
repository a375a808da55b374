"""Event sequence numbers per tenant (kvtier.daemon.cache.events), and node-wide ones for admin."""

from __future__ import annotations

import asyncio

from kvtier.core.types import Tier
from kvtier.daemon.cache.events import EventLog


def test_each_tenant_counts_its_own_events_and_admins_see_all() -> None:
    async def main() -> tuple[list[int], list[int], list[tuple[int, str]]]:
        log = EventLog()
        alice, bob, node = log.subscribe("alice"), log.subscribe("bob"), log.subscribe(None)
        for who in ("alice", "bob", "alice", "bob", "bob", "alice"):
            log.stored(who, bytes(32), Tier.DRAM, [bytes(32)])
        await asyncio.sleep(0)

        def drain(q: asyncio.Queue[object]) -> list[object]:
            out = []
            while not q.empty():
                out.append(q.get_nowait())
            return out

        a = [e.sequence for e in drain(alice.queue)]  # type: ignore[attr-defined]
        b = [e.sequence for e in drain(bob.queue)]  # type: ignore[attr-defined]
        n = [(e.node_sequence, e.tenant) for e in drain(node.queue)]  # type: ignore[attr-defined]
        replay = log.subscribe("bob", since=1)
        assert [e.sequence for e in drain(replay.queue)] == [2, 3]  # type: ignore[attr-defined]
        return a, b, n

    a, b, n = asyncio.run(main())
    assert a == [1, 2, 3] and b == [1, 2, 3]  # no gaps from the other tenant's events
    assert [s for s, _ in n] == [1, 2, 3, 4, 5, 6] and {t for _, t in n} == {"alice", "bob"}
