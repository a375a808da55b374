"""Operators' actions in-process (`kvtier.daemon.cache.control` over a real `Cache`: real shm
pool, real LMDB, a lease clock the test drives): pins expire exactly at their deadline and only
the later of two deadlines counts, a purge with a lease in the way dooms what the lease holds and
frees it at the release with nothing leaked, tenants' bytes go back to zero, and the pin table's
bookkeeping. What the daemon process does with these over gRPC and the CLI:
tests/test_operations.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvtier.core.keys import layout_id
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.cache.api import Scope
from kvtier.daemon.cache.cache import Cache
from kvtier.daemon.cache.namespaces import Namespace, Tenant
from kvtier.daemon.cache.pins import Cost, PinTable
from kvtier.daemon.metrics import DaemonMetrics
from tests.cache_calls import run

BLOCK = 4096
ADMIN = Tenant("default", admin=True)
FP = b"control-layout-1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp: Path, clock: Clock, slots: int = 16, ssd: str = "0") -> Cache:
    cfg = config.load({
        "socket": str(tmp / "s.sock"), "data_dir": str(tmp / "data"), "slot_bytes": "4KiB",
        "dram_bytes": str(slots * BLOCK), "ssd_bytes": ssd, "metrics": "",
        "writeback_queue_bytes": str(slots * BLOCK), "max_pin_ttl_s": "3600", "policy": "lru",
    }, {"HOME": str(tmp)})
    cache = Cache(config.cache_spec(cfg), DaemonMetrics(), clock=clock)
    for model in ("m/a", "m/b"):
        cache.register_layout(ADMIN, model, FP, BLOCK, 16, 32, None)
    return cache


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(tmp_path: Path, clock: Clock) -> Iterator[Cache]:
    c = make(tmp_path, clock)
    yield c
    c.close()


def keys(tag: int, n: int) -> bytes:
    return b"".join(bytes([tag, i]) + bytes(30) for i in range(n))


def store(c: Cache, model: str, k: bytes, parent: bytes = b"") -> None:
    a = run(c.allocate_async(ADMIN, layout_id(model, FP), k, 32, parent, 0))
    if a.lease_id:
        c.commit(ADMIN, a.lease_id)


def hits(c: Cache, model: str, k: bytes) -> int:
    return len(run(c.lookup_async(ADMIN, layout_id(model, FP), k, 32)).tiers)


def flood(c: Cache, tag: int, n: int) -> None:
    for i in range(n):
        store(c, "m/b", keys(tag + i, 1))


def test_a_pin_holds_until_its_deadline_and_not_a_tick_longer(cache: Cache,
                                                               clock: Clock) -> None:
    store(cache, "m/a", keys(1, 4))
    pinned = cache.pin(ADMIN, Scope(model_id="m/a", keys=keys(1, 6), key_width=32), 10.0)
    assert (pinned.pinned, pinned.new, pinned.asked) == (4, 4, 6)  # what is cached: 4 of 6
    clock.now += 5
    again = cache.pin(ADMIN, Scope(model_id="m/a", keys=keys(1, 2), key_width=32), 1.0)
    assert again.new == 0  # a shorter pin never shortens the first one
    clock.now += 4.999
    cache.expire()
    flood(cache, 100, 40)  # 16 slots: everything unpinned has gone several times over
    assert hits(cache, "m/a", keys(1, 4)) == 4
    assert cache.pins(ADMIN, Scope())[0].blocks == 4
    clock.now += 0.002
    cache.expire()
    assert cache.pins(ADMIN, Scope()) == []
    flood(cache, 150, 40)
    assert hits(cache, "m/a", keys(1, 4)) == 0
    assert cache.leaked_slots() == 0


def test_a_later_pin_extends_and_unpin_ends_it_early(cache: Cache, clock: Clock) -> None:
    store(cache, "m/a", keys(1, 3))
    scope = Scope(model_id="m/a", keys=keys(1, 3), key_width=32)
    cache.pin(ADMIN, scope, 10.0)
    clock.now += 8
    cache.pin(ADMIN, scope, 10.0)  # now until t+18
    clock.now += 9
    cache.expire()
    assert cache.pins(ADMIN, Scope())[0].first_expiry_s == pytest.approx(1.0)
    assert cache.unpin(ADMIN, Scope(model_id="m/a")) == 3
    flood(cache, 100, 40)
    assert hits(cache, "m/a", keys(1, 3)) == 0


def test_purge_under_a_lease_dooms_then_frees_at_release(cache: Cache) -> None:
    store(cache, "m/a", keys(1, 4))
    store(cache, "m/a", keys(2, 2))
    store(cache, "m/b", keys(1, 4))
    lease = run(cache.acquire_async(ADMIN, layout_id("m/a", FP), keys(1, 2), 32, 0))
    assert len(lease.offsets) == 2
    got = run(cache.evict_async(ADMIN, Scope(model_id="m/a")))
    # keys(1, ..)[2:] and keys(2, ..) go now; the two leased blocks stay, doomed
    assert (got.blocks, got.doomed, got.dram_blocks) == (4, 2, 4)
    assert hits(cache, "m/a", keys(1, 4)) == 0  # no lookup finds a doomed block
    assert hits(cache, "m/b", keys(1, 4)) == 4  # another model's blocks with the same keys
    store(cache, "m/a", keys(1, 3))  # a commit under a doomed block: doomed with it
    cache.release(ADMIN, lease.lease_id)
    assert cache.stats().dram_blocks == 4 and cache.leaked_slots() == 0
    run(cache.evict_async(ADMIN, Scope(model_id="m/b")))
    assert cache.stats().dram_blocks == 0 and cache.leaked_slots() == 0
    assert cache.names.tenants[ADMIN.name].dram_bytes == 0  # every byte given back


def test_evict_of_a_prefix_keeps_its_ancestors_and_siblings(cache: Cache) -> None:
    store(cache, "m/a", keys(1, 3))
    branch = b"".join(bytes([9, i]) + bytes(30) for i in range(2))
    store(cache, "m/a", branch, parent=keys(1, 3)[-32:])
    store(cache, "m/a", keys(1, 5)[96:], parent=keys(1, 3)[-32:])  # keys(1, 5): 3 + 2 more
    got = run(cache.evict_async(ADMIN, Scope(model_id="m/a", keys=branch[:32],
                                                      key_width=32)))
    assert got.blocks == 2
    assert hits(cache, "m/a", keys(1, 5)) == 5


def test_bad_scopes_are_refused_and_change_nothing(cache: Cache) -> None:
    store(cache, "m/a", keys(1, 2))
    alice = Tenant("alice")
    for scope, clear, err in [
        (Scope(), False, InvalidArgument),  # evict of nothing named
        (Scope(keys=keys(1, 1), key_width=32), True, InvalidArgument),
        (Scope(model_id="m/a", keys=b"\x01" * 33, key_width=32), False, InvalidArgument),
        (Scope(layout_id=b"\x00" * 5), False, InvalidArgument),
        (Scope(all_tenants=True), True, PermissionDenied),
    ]:
        with pytest.raises(err):
            run(cache.evict_async(alice if err is PermissionDenied else ADMIN, scope,
                                          clear))
    with pytest.raises(InvalidArgument):
        cache.pin(ADMIN, Scope(model_id="m/a", keys=keys(1, 2), key_width=32), 3601)
    with pytest.raises(InvalidArgument):
        cache.pin(ADMIN, Scope(model_id="m/a", keys=keys(1, 2), key_width=32), float("nan"))
    with pytest.raises(PermissionDenied):
        cache.unpin(alice, Scope(tenant="default"))
    assert hits(cache, "m/a", keys(1, 2)) == 2 and cache.pins(ADMIN, Scope()) == []


def test_pins_are_refused_whole_past_what_the_pool_holds(tmp_path: Path, clock: Clock) -> None:
    """16 slots, 24 blocks cached (8 of them on SSD only): a pinned block counts at its DRAM
    cost wherever it is, so pins of 24 are refused whole, and of 16 fit."""
    c = make(tmp_path, clock, slots=16, ssd="16MiB")
    try:
        chain = keys(1, 24)
        for i in range(0, 24, 4):
            store(c, "m/a", chain[i * 32:(i + 4) * 32], parent=chain[i * 32 - 32:i * 32])
            hits(c, "m/a", chain[:(i + 4) * 32])  # the 2nd access: written back
            assert c.flush(30)
        assert hits(c, "m/a", chain) == 24
        assert c.stats().dram_blocks <= 16 < c.stats().ssd_blocks
        with pytest.raises(ResourceExhausted, match="pinned blocks would take"):
            c.pin(ADMIN, Scope(model_id="m/a", keys=chain, key_width=32), 60)
        assert c.pins(ADMIN, Scope()) == []
        assert c.pin(ADMIN, Scope(model_id="m/a", keys=chain[:16 * 32], key_width=32),
                     60).pinned == 16
        with pytest.raises(ResourceExhausted):
            c.pin(ADMIN, Scope(model_id="m/a", keys=chain[:17 * 32], key_width=32), 60)
    finally:
        c.close()


def test_the_pin_table_keeps_the_later_deadline_and_its_costs() -> None:
    t = PinTable()
    ns = Namespace("alice", b"\x01" * 32)
    assert t.pin(ns, b"k1", 10.0, Cost(100, 110)) is True
    assert t.pin(ns, b"k1", 5.0, Cost(100, 110)) is False and t.until(ns, b"k1") == 10.0
    assert t.pin(ns, b"k1", 20.0, Cost(100, 110)) is False and t.until(ns, b"k1") == 20.0
    t.pin(ns, b"k2", 15.0, Cost(100, 110))
    assert t.held("alice") == Cost(200, 220) and t.blocks("alice") == 2
    assert t.expired(15.0) == [(ns, b"k2")]  # k1's old deadline (10) is skipped
    assert t.expired(19.9) == [] and t.held("alice") == Cost(100, 110)
    assert t.drop(ns) == [b"k1"] and len(t) == 0 and t.held("alice") == Cost(0, 0)


def test_ssd_copies_go_in_one_batch_and_a_restart_finds_none(tmp_path: Path,
                                                              clock: Clock) -> None:
    c = make(tmp_path, clock, slots=16, ssd="16MiB")
    try:
        store(c, "m/a", keys(1, 6))
        store(c, "m/b", keys(1, 6))
        hits(c, "m/a", keys(1, 6))
        hits(c, "m/b", keys(1, 6))  # the 2nd access: written back
        assert c.flush(30)
        assert c.stats().ssd_blocks == 12
        got = run(c.evict_async(ADMIN, Scope(model_id="m/a")))
        assert (got.blocks, got.dram_blocks, got.ssd_blocks) == (6, 6, 6)
        assert c.stats().ssd_blocks == 6
    finally:
        c.close()
    c = make(tmp_path, clock, slots=16, ssd="16MiB")
    try:
        assert c.stats().ssd_blocks == 6
        assert c.index.lookup(Namespace(ADMIN.name, layout_id("m/a", FP)),
                              [keys(1, 1)], touch=False).tiers == []
        assert c.index.lookup(Namespace(ADMIN.name, layout_id("m/b", FP)),
                              [keys(1, 1)], touch=False).tiers == [Tier.SSD]
    finally:
        c.close()
