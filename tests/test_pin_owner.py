"""One owner for pins: the prefix index's block pins are the only pins of the
daemon's pool, which asks the index (`DramPool.owner`) instead of keeping counts of its own.
The index's slot view on its own, then a real in-process `Cache` (real shm pool, real LMDB and
write-back thread; its calls awaited as the transports await them): a lease and a queued
write-back each pin through the index alone, and the pool refuses to free such a slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.keys import layout_id
from kvtier.core.segment import DramError
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.index.prefix import PrefixIndex
from kvtier.tiers.dram import SlotPinned
from tests.cache_calls import run

T = Tenant("t")
FP, MODEL = b"pin-owner-layout", "pin-owner"
LID = layout_id(MODEL, FP)
BLOCK = 4096


def test_the_index_knows_which_slots_hold_pinned_blocks() -> None:
    ix = PrefixIndex(dram_blocks=8, ssd_blocks=8, policy="lru")
    ix.insert("a", b"k0", None, Tier.DRAM, dram_slot=3)
    ix.insert("a", b"k1", None, Tier.SSD)
    assert not ix.slot_pinned(3) and ix.pinned_slots == 0
    ix.pin("a", b"k0")
    ix.pin("a", b"k0")  # two leases: one pinned slot
    assert ix.slot_pinned(3) and ix.pinned_slots == 1
    ix.unpin("a", b"k0")
    assert ix.slot_pinned(3)
    ix.unpin("a", b"k0")
    assert not ix.slot_pinned(3) and ix.pinned_slots == 0
    # an SSD-only block pinned by an Acquire gets its promoted slot pinned with it
    ix.pin("a", b"k1")
    assert ix.pinned_slots == 0
    ix.add_tier("a", b"k1", Tier.DRAM, dram_slot=5)
    assert ix.slot_pinned(5) and ix.pinned_slots == 1
    ix.unpin("a", b"k1")
    assert not ix.slot_pinned(5) and ix.pinned_slots == 0
    assert not ix.slot_pinned(99) and not ix.slot_pinned(-1)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    cfg = config.load({
        "socket": str(tmp_path / "s.sock"), "data_dir": str(tmp_path / "data"),
        "slot_bytes": "4KiB", "dram_bytes": "32KiB", "ssd_bytes": "1MiB", "metrics": "",
        "ssd_admit_after": "1", "writeback_queue_bytes": "32KiB",
    }, {"HOME": str(tmp_path)})
    c = Cache(config.cache_spec(cfg), DaemonMetrics())
    c.register_layout(T, MODEL, FP, BLOCK, 16, 32, None)
    yield c
    c.close()


def test_a_lease_pins_through_the_index_alone(cache: Cache) -> None:
    k = bytes([1]) + bytes(31)
    a = run(cache.allocate_async(T, LID, k, 32, b"", 0))
    assert cache.commit(T, a.lease_id) == 1
    assert cache.flush(30)  # the write-back (k = 1) is on SSD: its pin is gone
    slot = cache.pool.slot_at(a.offsets[0])
    assert slot is not None
    got = run(cache.acquire_async(T, LID, k, 32, 0))
    assert got.offsets == a.offsets
    pool = cache.pool
    assert pool.pins(slot) == 0  # the pool keeps no count of its own...
    assert pool.stats().slots_pinned == 1  # ...it asks the index
    with pytest.raises(SlotPinned):
        pool.free(slot)
    with pytest.raises(SlotPinned):
        pool.write(slot, bytes(BLOCK))
    with pytest.raises(DramError):
        pool.pin(slot)  # nobody pins a slot of this pool: pin the block
    cache.release(T, got.lease_id)
    assert pool.stats().slots_pinned == 0 and cache.leaked_slots() == 0


def test_a_queued_write_back_pins_through_the_index(cache: Cache) -> None:
    mover = cache.residency.mover
    assert mover is not None
    k = bytes([2]) + bytes(31)
    a = run(cache.allocate_async(T, LID, k, 32, b"", 0))
    with cache._lock:  # hold the writer's callback: the write-back stays queued meanwhile
        assert cache.commit(T, a.lease_id) == 1
        slot = cache.pool.slot_at(a.offsets[0])
        block = cache.index.get(cache._ns(T, LID).name, k)
        assert block is not None and block.pins == 1  # the write-back's pin, in the index
        assert slot is not None and cache.pool.pins(slot) == 0
        assert cache.pool.stats().slots_pinned == 1
    assert cache.flush(30)
    assert block.pins == 0 and cache.pool.stats().slots_pinned == 0
    assert run(cache.lookup_async(T, LID, k, 32)).tiers == [Tier.DRAM]
